"""Host memory per rank during setup, save and load of the sharded strategies, as a ratio to the full model's bytes.

Run: ``.venv/bin/python benchmarks/memory.py`` (CPU, gloo; a few minutes). Options: ``--world 4 8``, ``--models dense
moe``, ``--layouts zero3 zero3_ep zero_topo zero_topo_ep epso``; ``--export``: instead, ``mula export`` of a
checkpoint saved by ZeRO-3 ranks, streamed (the default for sharded checkpoints) vs in memory, measured in a fresh
process; ``--init-from``: instead, the setup of a run that starts from existing weights (``init_from``: a DCP
checkpoint and a transformers directory of the model, written by one process), per layout; ``--precision bf16-true``:
bf16 parameters (the optimizers keep float32 masters, moments and, for ``epso``, float32 gradient buffers);
``--two-call``: setup as ``fabric.setup_module(model)`` then ``fabric.setup_optimizers(AdamW(model.parameters()))``.

Why: the presets go to 220B parameters; a rank that holds the whole model (or several copies of it) at any phase
cannot start or checkpoint such a run. For each phase every rank samples its resident memory (``/proc/self/statm``,
every 2 ms, in a thread: ``ru_maxrss`` would hide a later phase behind an earlier peak) and reports the rise of the
phase (peak during it minus resident memory just before it); the table prints the largest rise over the ranks divided
by the full model's fp32 bytes, and what setup left resident (``kept``: the parameter shards, gradient shards and
optimizer state the strategy's layout keeps) on the same scale: a setup rise near ``kept`` is what a sharded setup
costs; anything above it is transient memory (whole-model materialisation, copies). Each rank fixes glibc's mmap
threshold first (``fixed_mmap_threshold``), so that freed buffers leave the resident set and a rise is memory the
program holds, not heap fragmentation.

Phases, with Fabric (``fabric.init_module(empty_init=True)``: the model starts on the meta device), measured after
the same phases ran once on a tiny model of the same family (the code they import and the strategy's process groups
are then in place: what remains is what the model's size causes):
``setup`` = ``fabric.setup(model, AdamW(...))``; ``step`` = one training step (forward and backward of one sequence
of 64 tokens, ``optimizer.step()``: where the optimizer state appears, as with torch's AdamW); ``save`` =
``fabric.save(dir, {"model", "optimizer"})`` (DCP) after that step; ``load`` = ``fabric.load(dir, state)`` into the
same objects; ``model-only`` = what ``ModelOnlyCheckpoint(hf_export=True)`` writes (bf16 weights and the transformers
export, every rank writing what it holds).

Layouts: ``zero3`` = ``FabricZeroTopoStrategy`` with weights, gradients and optimizer states sharded over every
rank; ``zero_topo`` = its 3-level layout with 2 ranks per GPU and per node (weights over 2, gradients over 2,
optimizer over all); ``zero3_ep`` / ``zero_topo_ep`` = the same with expert parallelism inside (EP = 2: each rank keeps
half the experts, sharded over their 2 replicas by the same levels; MoE only); ``epso`` = ``FabricEPSOStrategy``
(EP = 2 for the MoE, 1 for the dense model). ``to-step`` is the rise from before the model is built to the end of the
first optimizer step (its moments allocated): the most a rank needs to start training. ``step 2 MB`` is the rise from
the same point to the end of a second step (the moments exist during its forward and backward: a step's steady-state
peak), beside ``mula plan``'s memory for the rank (``plan MB``: weights, gradients, master, moments, the activations
of the 64-token sequence, communication buffers; :func:`planned_bytes`) and their ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch

from mula_lightning.testing import run_distributed_test

PAGE = os.sysconf("SC_PAGE_SIZE")
MODELS = {  # >= 150 MB in fp32 each
    "dense": dict(
        vocab_size=8192, hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=12, intermediate_size=2048,
        num_experts=0, top_k=0,
    ),
    "moe": dict(
        vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8, intermediate_size=768,
        num_experts=8, top_k=2,
    ),
}  # fmt: skip
LAYOUTS = ("zero3", "zero3_ep", "zero_topo", "zero_topo_ep", "epso")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PhaseSampler:
    """Samples this process's resident memory in a thread while a phase runs; ``rise`` = peak - start."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s = every_s

    def __enter__(self) -> PhaseSampler:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.every_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end = _rss()
        self.peak = max(self.peak, self.end)

    @property
    def rise(self) -> int:
        return self.peak - self.start

    @property
    def kept(self) -> int:
        return self.end - self.start


def _config(model: str):
    from mula_lightning.models import MulaConfig

    return MulaConfig(**MODELS[model])


def _strategy(layout: str, model: str, world_size: int):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    ep = dict(ep_size=2) if layout.endswith("_ep") else {}
    if layout.startswith("zero3"):
        sizes = dict(weight_size=world_size, grad_size=world_size, optimizer_size=world_size)
        return FabricZeroTopoStrategy(ranks_per_node=world_size, **sizes, **ep)
    if layout.startswith("zero_topo"):
        return FabricZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, **ep)
    return FabricEPSOStrategy(ep_size=2 if model == "moe" and world_size > 1 else 1)


def _phases(fabric, config, path: str, two_call: bool = False) -> dict:
    """Build on meta, setup, one step, save and load: each phase's rise and what setup kept (bytes). ``two_call``:
    setup is ``fabric.setup_module(model)`` then ``fabric.setup_optimizers(AdamW(model.parameters()))``."""
    from mula_lightning.models import MulaForCausalLM

    out: dict[str, int] = {}
    steady = PhaseSampler()  # from before the model exists to the end of a second step (the moments exist then)
    steady.__enter__()
    with PhaseSampler() as to_step:  # from before the model exists to after the first step's allocations
        with fabric.init_module(empty_init=True):
            net = MulaForCausalLM(config)
        out["full_bytes"] = sum(p.numel() * 4 for p in net.parameters())
        with PhaseSampler() as phase:
            if two_call:  # the order Lightning documents for sharded strategies
                net = fabric.setup_module(net)
                optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-4))
            else:
                net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
        out["setup"], out["kept"] = phase.rise, phase.kept
        fabric.barrier()
        tokens = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        with PhaseSampler() as phase:
            fabric.backward(net(tokens, labels=tokens).loss)
            optimizer.step()
            optimizer.zero_grad()
        out["step"] = phase.rise
    out["to-step"] = to_step.rise
    fabric.backward(net(tokens, labels=tokens).loss)
    optimizer.step()
    optimizer.zero_grad()
    steady.__exit__(None, None, None)
    out["steady"] = steady.rise
    fabric.barrier()
    state = {"model": net, "optimizer": optimizer}
    with PhaseSampler() as phase:
        fabric.save(path, state)
    out["save"] = phase.rise
    fabric.barrier()
    with PhaseSampler() as phase:
        fabric.load(path, state)
    out["load"] = phase.rise
    fabric.barrier()
    from mula_lightning.callbacks.model_only_checkpoint import _sharded_state
    from mula_lightning.checkpoint.model_only_sharded import save_model_only_sharded

    with PhaseSampler() as phase:
        weights, planner = _sharded_state(fabric.strategy, net.module)
        save_model_only_sharded(weights, planner, config, path + "-weights", torch.bfloat16, hf_export=True)
    out["model-only"] = phase.rise
    fabric.barrier()
    return out


def fixed_mmap_threshold() -> None:
    """Serve every allocation above 128 KiB with its own mapping, returned to the system when freed.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which a unit's
    buffer, freed between its uses, goes back to the heap, where fragmentation keeps it resident: a ZeRO-3 step then
    rises by 2x the model per rank and the resident size grows step after step (measured: 6.6x, 7.3x, 7.8x the model
    after steps 1-3; with the fixed threshold 3.4x each time). The table measures the program, not that policy.
    """
    import contextlib
    import ctypes

    m_mmap_threshold = -3  # mallopt's M_MMAP_THRESHOLD; setting it also turns the dynamic threshold off
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy applies
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024)


def _rank(
    rank: int, world_size: int, layout: str, model: str, path: str, precision: str = "32-true", two_call: bool = False
) -> dict:
    from lightning.fabric import Fabric

    fixed_mmap_threshold()
    torch.set_num_threads(1)
    strategy = _strategy(layout, model, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    # warm-up on a tiny model of the same family: the code each phase imports and the process groups the strategy
    # creates (a fixed cost of the order of 100 MB) are in place before the measured run, whose rises are then what
    # the model's size causes
    tiny = dict(MODELS[model], vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    tiny["intermediate_size"] = 64
    from mula_lightning.models import MulaConfig

    _phases(fabric, MulaConfig(**tiny), path + "-warmup", two_call)
    return _phases(fabric, _config(model), path, two_call)


def _export_rank(rank: int, world_size: int, model: str, path: str, out: str, streamed: bool) -> dict:
    """One fresh process exports the checkpoint ``path`` to a transformers directory: its resident-memory rise."""
    from mula_lightning.checkpoint.export import export_to_hf, read_checkpoint
    from mula_lightning.models.hf_convert import save_hf

    fixed_mmap_threshold()
    config = _config(model)
    with PhaseSampler() as phase:
        if streamed:
            export_to_hf(path, out, config)
        else:  # the in-memory path: every tensor read, the model built, converted and written at once
            save_hf(read_checkpoint(path, config)[0], out)
    return {"rise": phase.rise}


def _init_from_rank(rank: int, world_size: int, layout: str, model: str, source: str) -> dict:
    """Setup of the model from ``source`` (``init_from``), after a warm-up setup of a tiny model drawn from the seed:
    the rise and what setup kept (bytes)."""
    from lightning.fabric import Fabric

    from mula_lightning.models import MulaConfig, MulaForCausalLM

    fixed_mmap_threshold()
    torch.set_num_threads(1)
    strategy = _strategy(layout, model, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    tiny = dict(MODELS[model], vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    tiny["intermediate_size"] = 64
    with fabric.init_module(empty_init=True):
        net = MulaForCausalLM(MulaConfig(**tiny))
    fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    fabric.barrier()
    strategy.init_from = source
    with fabric.init_module(empty_init=True):
        net = MulaForCausalLM(_config(model))
    with PhaseSampler() as phase:
        fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    fabric.barrier()
    return {"setup": phase.rise, "kept": phase.kept}


def init_from_table(models: list[str], worlds: list[int], layouts: list[str]) -> None:
    """Setup from existing weights (a DCP checkpoint, a transformers directory) per layout: rise / full fp32 bytes."""
    import torch.distributed.checkpoint as dcp

    from mula_lightning.checkpoint.export import CHECKPOINT_KEY
    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.models.hf_convert import save_hf
    from mula_lightning.utils.safe_load import dumps_data

    print("setup from init_from; ratios = largest rise over the ranks / full fp32 bytes (kept: what setup holds)")
    print(f"{'world':>5} {'model':>6} {'MB':>6} {'layout':>10} {'source':>13} {'setup':>8} {'kept':>8}")
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            source = init_weights(MulaForCausalLM(_config(model)), seed=1)
            full = sum(p.numel() * 4 for p in source.parameters())
            state = {f"model.{k}": v for k, v in source.state_dict().items()}  # as MulaLM's checkpoints hold it
            state["metadata"] = dumps_data({CHECKPOINT_KEY: {"config": source.config.to_dict()}})
            dcp.save(state, checkpoint_id=f"{tmp}/dcp", no_dist=True)
            save_hf(source, f"{tmp}/hf")
            del source, state
            for world in worlds:
                for layout in layouts:
                    for kind in ("dcp", "hf"):
                        results = run_distributed_test(
                            _init_from_rank, world, layout=layout, model=model, source=f"{tmp}/{kind}", timeout=900
                        )
                        setup, kept = (max(r[c] for r in results) / full for c in ("setup", "kept"))
                        name = "DCP" if kind == "dcp" else "transformers"
                        print(f"{world:>5} {model:>6} {full / 2**20:>6.0f} {layout:>10} {name:>13} {setup:>7.2f}x "
                              f"{kept:>7.2f}x", flush=True)  # fmt: skip


def _sizes(model: str) -> tuple[int, int]:
    """(full model, largest tensor) bytes in fp32."""
    from mula_lightning.models import MulaForCausalLM

    with torch.device("meta"):
        net = MulaForCausalLM(_config(model))
    numels = [p.numel() for p in net.parameters()]
    return 4 * sum(numels), 4 * max(numels)


def export_table(models: list[str], world: int) -> None:
    """``mula export`` of a checkpoint saved by ``world`` ZeRO-3 ranks: streamed vs in memory, in a fresh process."""
    print(f"mula export of a checkpoint saved by {world} ZeRO-3 ranks; rise of the exporting process")
    print(f"{'model':>6} {'MB':>6} {'largest MB':>11} {'streamed MB':>12} {'in memory MB':>13} {'target MB':>10}")
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt")
            run_distributed_test(_rank, world, layout="zero3", model=model, path=path, timeout=900)
            rises = {}
            for streamed in (True, False):
                out = os.path.join(tmp, f"hf-{streamed}")
                result = run_distributed_test(
                    _export_rank, 1, model=model, path=path, out=out, streamed=streamed, timeout=900
                )
                rises[streamed] = result[0]["rise"]
        full, largest = _sizes(model)
        mb = 2**20
        print(
            f"{model:>6} {full / mb:>6.0f} {largest / mb:>11.1f} {rises[True] / mb:>12.1f} {rises[False] / mb:>13.1f} "
            f"{(2 * largest + 100 * mb) / mb:>10.1f}",
            flush=True,
        )


def planned_bytes(layout: str, model: str, world: int, precision: str) -> int:
    """``mula plan``'s memory for the worst rank of this run (weights, gradients, master, moments, the activations of
    its one 64-token sequence, communication buffers; no reserve): what a step's peak should come to."""
    from mula_lightning.plan import Cluster, Layout, Training, plan_layout
    from mula_lightning.plan.clusters import GB

    ep = 2 if (layout.endswith("_ep") or (layout == "epso" and model == "moe" and world > 1)) else 1
    if layout.startswith("zero3"):
        plan = Layout(world, "zero_topo", ep, zero_sizes=(world, world, world, 0), ranks_per_node=world,
                      precision=precision)  # fmt: skip
    elif layout.startswith("zero_topo"):
        plan = Layout(world, "zero_topo", ep, ranks_per_node=2, ranks_per_gpu=2, precision=precision)
    else:
        plan = Layout(world, "epso", ep, precision=precision, ranks_per_node=world)
    cluster = Cluster("cpu", plan.ranks_per_node, 10**6 * GB, plan.ranks_per_gpu, reserved_bytes=0,
                      inplace_all_gather=False)  # gloo  # fmt: skip
    result = plan_layout(_config(model), plan, cluster, Training(micro_batch_size=1, seq_len=64, micro_batches=1))
    return result["memory_bytes"]["total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[4])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["dense", "moe"])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--export", action="store_true", help="measure mula export instead (streamed vs in memory)")
    parser.add_argument("--init-from", action="store_true", help="measure setup from existing weights instead")
    parser.add_argument(
        "--precision", choices=("32-true", "bf16-true"), default="32-true",
        help="bf16-true: bf16 parameters with the optimizer's float32 master, moments and gradient buffers",
    )  # fmt: skip
    parser.add_argument(
        "--two-call", action="store_true",
        help="set up with fabric.setup_module(model), then fabric.setup_optimizers(AdamW(model.parameters()))",
    )  # fmt: skip
    args = parser.parse_args()
    if args.init_from:
        init_from_table(args.models, args.world, args.layouts)
        return
    if args.export:
        export_table(args.models, args.world[0])
        return
    print(
        f"torch {torch.__version__}, {args.precision}{', setup_module + setup_optimizers' if args.two_call else ''}, "
        "CPU threads 1 per rank; ratios = largest rise over the ranks / full fp32 bytes"
    )
    columns = ("setup", "kept", "step", "to-step", "save", "load", "model-only")
    print(f"{'world':>5} {'model':>6} {'MB':>6} {'layout':>10} " + " ".join(f"{c:>10}" for c in columns)
          + f" {'plan MB':>8} {'step 2 MB':>10} {'/ plan':>7}")  # fmt: skip
    for world in args.world:
        for model in args.models:
            for layout in args.layouts:
                if layout.endswith("_ep") and model == "dense":
                    continue  # expert parallelism needs experts
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "ckpt")
                    results = run_distributed_test(
                        _rank, world, layout=layout, model=model, path=path, precision=args.precision,
                        two_call=args.two_call, timeout=900,
                    )  # fmt: skip
                full = results[0]["full_bytes"]
                ratios = " ".join(f"{max(r[c] for r in results) / full:>9.2f}x" for c in columns)
                planned = planned_bytes(layout, model, world, args.precision)
                steady = max(r["steady"] for r in results)
                print(f"{world:>5} {model:>6} {full / 2**20:>6.0f} {layout:>10} {ratios} {planned / 2**20:>8.0f} "
                      f"{steady / 2**20:>10.0f} {steady / planned:>6.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
