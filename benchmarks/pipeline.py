"""Pipeline parallelism: step time, per-rank memory and the measured bubble of each schedule at PP = 1, 2, 4.

Run::

    python benchmarks/pipeline.py                       # the table in BENCHMARKS.md
    python benchmarks/pipeline.py --microbatches 16 --steps 3

Every row trains the same MoE model (every layer MoE) on the same global batch: ``--microbatches`` sequences of
``--seq`` tokens per step, one sequence per micro-batch, with ``epso`` (Fabric, ``strategy.pipeline_step``) on
``pp`` gloo processes, one thread each; PP=1 is one process accumulating the same micro-batches. Columns:

* ``step s``: median time of one optimizer step (schedule + clip + AdamW);
* ``peak MB``: the largest rise of a rank's resident memory (``/proc/self/statm``, sampled in a thread) from before
  the model is built to the end of the timed steps (weights, gradients, optimizer states, activations), the
  largest over the ranks;
* ``bubble``: the measured idle fraction of the schedule, ``1 - busy / schedule time``, where ``busy`` is the time
  a rank's stages take to run forward and backward of every micro-batch on their own (no communication, one rank
  at a time), averaged over the ranks, beside the ideal ``(p - 1) / (v m + p - 1)`` (``v`` virtual stages per
  rank, ``m`` micro-batches).

On a CPU of fewer cores than processes (PP=4 on 2 cores) the ranks share cores, so the schedule's time and the
bubble grow for that reason as well; the ideal column is what a machine with a core (or a GPU) per rank approaches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from memory import PhaseSampler  # noqa: E402
from mula_lightning.testing import run_distributed_test  # noqa: E402

ROWS = [  # (pp, schedule, virtual stages)
    (1, "none", 1),
    (2, "gpipe", 1),
    (2, "1f1b", 1),
    (2, "interleaved_1f1b", 2),
    (4, "gpipe", 1),
    (4, "1f1b", 1),
    (4, "interleaved_1f1b", 2),
]


def _config(args):
    from mula_lightning.models import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
        num_kv_heads=4, intermediate_size=args.hidden, num_experts=8, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _stage_busy(runner, args, repeats: int = 3) -> float:
    """Seconds this rank's stages take for forward + backward of every micro-batch, alone (median of repeats)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(args.microbatches):
            for index, stage in runner.stages:
                if index == 0:
                    x = torch.randint(0, args.vocab, (1, args.seq))
                else:
                    x = torch.randn(1, args.seq, args.hidden, requires_grad=True)
                out = stage(x)
                grad = torch.randn_like(out)
                out.backward(grad)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank, world_size, args, schedule, virtual):
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy

    torch.set_num_threads(1)
    pp = world_size
    with PhaseSampler() as memory:
        kwargs = dict(pp_size=pp, pp_schedule=schedule, pp_virtual_stages=virtual) if pp > 1 else {}
        strategy = FabricEPSOStrategy(**kwargs)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = MulaForCausalLM(_config(args))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        batch = torch.randint(0, args.vocab, (args.microbatches, args.seq), generator=torch.Generator().manual_seed(0))
        steps, schedule_times = [], []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            if pp > 1:
                strategy.pipeline_step(batch, batch)
            else:
                for i in range(args.microbatches):
                    out = model(batch[i : i + 1], labels=batch[i : i + 1])
                    with fabric.no_backward_sync(model, enabled=i < args.microbatches - 1):
                        fabric.backward((out.loss + out.aux_loss) / args.microbatches)
            scheduled = time.perf_counter()
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            if step >= args.warmup:
                steps.append(time.perf_counter() - start)
                schedule_times.append(scheduled - start)
    busy = None
    if pp > 1:  # one rank at a time, so that nothing else runs on the cores
        for r in range(world_size):
            if r == rank:
                busy = _stage_busy(strategy.pipeline, args)
            dist.barrier()
    return {
        "step": statistics.median(steps),
        "schedule": statistics.median(schedule_times),
        "busy": busy,
        "peak_mb": memory.rise / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8, help="sequences per step = micro-batches (m)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"pipeline parallelism, {args.layers} MoE layers (hidden {args.hidden}, 8 experts top-2), vocabulary "
        f"{args.vocab}; global batch {args.microbatches} x {args.seq} tokens, m = {args.microbatches} micro-batches "
        f"of one sequence; {os.cpu_count()} CPU cores, one thread per rank; gloo"
    )
    print(f"{'PP':>3} {'schedule':<24} {'step s':>8} {'vs PP1':>7} {'peak MB':>8} {'bubble':>7} {'ideal':>7}")
    base = None
    for pp, schedule, virtual in ROWS:
        results = run_distributed_test(_rank, pp, args=args, schedule=schedule, virtual=virtual, timeout=900)
        step = max(r["step"] for r in results)
        peak = max(r["peak_mb"] for r in results)
        base = base or step
        if pp > 1:
            bubble = statistics.mean(1 - r["busy"] / r["schedule"] for r in results)
            ideal = (pp - 1) / (virtual * args.microbatches + pp - 1)
            cells = f"{bubble:7.2f} {ideal:7.2f}"
        else:
            cells = f"{'-':>7} {'-':>7}"
        name = schedule if virtual == 1 else f"{schedule} (v={virtual})"
        print(f"{pp:>3} {name:<24} {step:8.3f} {step / base:7.2f} {peak:8.1f} {cells}", flush=True)


if __name__ == "__main__":
    main()
