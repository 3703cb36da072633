"""End-to-end training throughput: ``mula fit`` (MulaLM, FastSparseMoE, ``epso``) vs a plain Lightning DDP run of
transformers' ``OlmoeForCausalLM``, with the same model, batch and machine, in one run.

Run::

    python benchmarks/train.py                      # CPU, 2 processes per contender (gloo)
    python benchmarks/train.py --steps 20 --repeats 3 --hidden 512
    python benchmarks/train.py --accelerator cuda --procs 2 --hidden 2048 --experts 64 --top-k 8 --expert-size 1024

Contenders (each a Lightning ``Trainer(devices=N)`` on N fresh processes started by
:func:`mula_lightning.testing.run_distributed_test`, each rank a torchrun-style process Lightning attaches to):

* ``mula epso EP=N``: :class:`~mula_lightning.lightning_module.MulaLM` exactly as ``mula fit`` builds it (meta
  device, materialised and expert-sharded by the strategy, EP-aware sharded AdamW, FastSparseMoE blocks with the
  all-gather dispatcher, or ``--dispatcher alltoall``), experts split over the N ranks;
* ``mula epso EP=1``: the same with DP=N (every rank holds all experts); on CUDA also with the Triton experts and
  loss (``, triton``), with ``cuda_graphs=True`` (``, cuda graphs``: forward + backward replayed as CUDA graphs), and
  both;
* ``HF eager, ddp``: ``OlmoeForCausalLM`` (transformers' per-expert loop) in a minimal LightningModule, ``ddp``;
* ``HF grouped_mm, ddp``: the same with ``experts_implementation="grouped_mm"``.

All share one :class:`~mula_lightning.models.MulaConfig` (HF weights are converted from the Mula model, so every
contender computes the same function), the same random-token batches, AdamW with the same hyper-parameters, the
LM loss plus the load-balancing loss, fp32 (``--precision bf16``: each contender's bf16 as its users run it).
Tokens/s count all ranks; the first ``--warmup`` steps are excluded; each contender runs ``--repeats`` times,
interleaved, and the best run is reported with the ratio to HF eager and to HF grouped_mm.

Two more columns:

* **fraction of the GEMM limit**: the model FLOPs of a step (``MulaConfig.flops_per_token``: 6 x active parameters
  + attention, forward and backward, the figure ``MulaLM`` logs for MFU; the same for every contender, which compute
  the same function) over the step time, divided by the machine's own GEMM rate: a ``torch.mm`` of the model's largest
  GEMM (the LM head: tokens of a rank's batch x hidden x vocabulary) in the run's dtype, timed in ``--procs``
  processes at once with ``--threads`` threads each, summed over them, in the same run. On a GPU the same ratio
  against the GPU's GEMM rate is MFU measured against what the device reaches, not its datasheet;
* **peak MB/rank**: the largest ``VmHWM`` (peak resident memory; on a GPU its allocator's peak) of the contender's
  ranks after its timed steps (before a profiled step, whose profiler holds every event).

``--profile`` adds one profiled step per contender (after the timed ones) and prints where its time goes, as shares
(:mod:`step_profile`: forward and backward per part, collectives, optimizer step, the LightningModule's step, the
Lightning loop and data).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_profile, beside this script

from machine_limits import gemm_rate, peak_memory_mb  # noqa: E402

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # Lightning accelerator -> process-group backend


def _config(args):
    from mula_lightning.models import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=args.hidden // 64,
        intermediate_size=args.expert_size,
        num_experts=args.experts,
        top_k=args.top_k,
        max_seq_len=args.seq_len,
        moe_impl="fast",
    )


class _Batches(torch.utils.data.Dataset):
    """Fixed random token rows (the same for every contender): ``{"input_ids", "labels"}``."""

    def __init__(self, rows: int, seq_len: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _hf_module(config, impl: str):
    """A minimal LightningModule over ``OlmoeForCausalLM`` with ``impl`` experts (weights from the Mula model)."""
    from lightning.pytorch import LightningModule
    from transformers import OlmoeForCausalLM

    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.models.hf_convert import hf_config_from_mula, to_hf

    class HFOlmoeLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            hf_config = hf_config_from_mula(config)
            hf_config._experts_implementation = impl
            hf_config.output_router_logits = True  # the load-balancing loss, as Mula computes it
            self.model = OlmoeForCausalLM(hf_config)
            self.model.load_state_dict(to_hf(init_weights(MulaForCausalLM(config), seed=0)).state_dict())

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)

    return HFOlmoeLM()


def _precision(contender: str, precision: str) -> str:
    """Lightning's precision for a contender: each runs ``bf16`` the way its users would (the sharded strategies own
    precision: bf16 weights with an fp32 master in the optimizer, ``bf16-true``; DDP autocasts fp32 weights,
    ``bf16-mixed``)."""
    if precision == "32":
        return "32-true"
    return "bf16-true" if contender.startswith("mula") else "bf16-mixed"


def _run(rank, world_size, contender: str, args) -> dict:
    """One contender on this rank: Trainer.fit for warmup + steps optimizer steps; tokens/s after the warm-up."""
    from lightning.pytorch import Callback, Trainer

    import mula_lightning.strategies  # noqa: F401
    from mula_lightning.lightning_module import MulaLM
    from mula_lightning.strategies import EPSOStrategy
    from mula_lightning.utils import synchronize

    torch.set_num_threads(args.threads)
    config = _config(args)
    if contender.startswith("mula"):
        ep = world_size if "EP=1" not in contender else 1
        overrides = {k: v for k, v in config.to_dict().items() if k != "name"}
        if "triton" in contender:  # the experts and the loss in the Triton kernels
            overrides.update(experts_backend="triton", loss_backend="triton")
        module = MulaLM(
            model="mula-tiny-moe",
            model_overrides=overrides,
            lr=1e-4,
            warmup_steps=0,
            grad_clip=0.0,
            log_grad_norm=False,
        )
        strategy = EPSOStrategy(ep_size=ep, bucket_numel=args.bucket_numel, dispatcher=args.dispatcher,
                                cuda_graphs="cuda graphs" in contender)  # fmt: skip
    else:
        module = _hf_module(config, "eager" if "eager" in contender else "grouped_mm")
        strategy = "ddp"

    stamps: list[float] = []
    profiled = args.warmup + args.steps  # the extra step profiled with --profile
    profile: dict[str, Any] = {}

    class _Clock(Callback):
        def on_train_start(self, trainer, pl_module):
            if args.profile:
                import step_profile

                step_profile.label_parts(pl_module.model, pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.profile and batch_idx == profiled:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                profile["profiler"] = torch_profile(activities=[ProfilerActivity.CPU])
                profile["profiler"].__enter__()
                profile["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            synchronize(trainer.strategy.root_device)  # accelerator work of the step finished
            stamps.append(time.perf_counter())
            if len(stamps) == profiled:  # the timed steps' peak, before a profiler holds its events
                profile["peak_mb"] = peak_memory_mb(trainer.strategy.root_device)
            if "profiler" in profile and "wall_us" not in profile:
                profile["wall_us"] = (time.perf_counter() - profile["start"]) * 1e6
                profile["profiler"].__exit__(None, None, None)

    steps = args.warmup + args.steps + (1 if args.profile else 0)
    loader = torch.utils.data.DataLoader(_Batches(steps * args.batch * world_size, args.seq_len, args.vocab),
                                         batch_size=args.batch)  # fmt: skip
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=world_size,
        strategy=strategy,
        precision=_precision(contender, args.precision),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Clock()],
    )
    trainer.fit(module, loader)
    elapsed = stamps[args.warmup + args.steps - 1] - stamps[args.warmup - 1]
    result = {
        "tokens_per_s": args.steps * args.batch * args.seq_len * world_size / elapsed,
        "s_per_step": elapsed / args.steps,
        "peak_mb": profile["peak_mb"],
    }
    if "profiler" in profile:
        import step_profile

        result["profile"] = step_profile.shares(profile["profiler"], profile["wall_us"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=2, help="processes (devices) per contender")
    parser.add_argument("--accelerator", choices=sorted(BACKENDS), default="cpu", help="one process per device")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--only", nargs="*", help="run only the contenders whose name contains one of these")
    parser.add_argument("--bucket-numel", type=int, default=4_000_000,
                        help="epso's reduce-scatter bucket (elements; 4M: best of a sweep on gloo)")  # fmt: skip
    parser.add_argument("--dispatcher", choices=("allgather", "alltoall"), default="allgather",
                        help="epso's MoE token dispatcher (EP > 1)")  # fmt: skip
    parser.add_argument("--precision", choices=("32", "bf16"), default="32",
                        help="bf16: mula bf16-true (fp32 master), HF bf16-mixed; GEMM limit in bf16")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="profile one more step per contender: shares")
    args = parser.parse_args()

    from mula_lightning.testing import run_distributed_test

    names = [f"mula epso EP={args.procs}", "mula epso EP=1", "HF eager, ddp", "HF grouped_mm, ddp"]
    if args.accelerator == "cuda":  # the Triton kernels and the CUDA-graph step (one model replica per device)
        names[2:2] = ["mula epso EP=1, triton", "mula epso EP=1, cuda graphs", "mula epso EP=1, triton, cuda graphs"]
    contenders = list(dict.fromkeys(names))
    if args.only:
        contenders = [c for c in contenders if any(o in c for o in args.only)]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in contenders:  # interleaved: a slow phase of a shared machine hits every contender alike
            ranks = run_distributed_test(
                _run, args.procs, backend=BACKENDS[args.accelerator], timeout=1800, contender=name, args=args
            )
            result = {**ranks[0], "peak_mb": max(r["peak_mb"] for r in ranks)}
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    config = _config(args)
    gemm = (args.batch * args.seq_len, config.hidden_size, config.vocab_size)  # the LM head, the largest GEMM
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    rate = sum(run_distributed_test(gemm_rate, args.procs, backend=BACKENDS[args.accelerator], m=gemm[0], k=gemm[1],
                                    n=gemm[2], threads=args.threads, device=args.accelerator, dtype=dtype))  # fmt: skip
    flops_per_step = config.flops_per_token(args.seq_len) * args.batch * args.seq_len * args.procs
    precision = "fp32" if args.precision == "32" else "bf16 (mula bf16-true, transformers bf16-mixed)"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}")
    print(
        f"model: hidden {config.hidden_size}, {config.num_layers} layers, {config.num_experts} experts top-"
        f"{config.top_k} of width {config.intermediate_size}, vocab {config.vocab_size}; batch {args.batch} x "
        f"{args.seq_len} tokens per rank, {args.procs} processes x {args.threads} thread(s); {precision}, AdamW; "
        f"best of {args.repeats}, {args.steps} timed steps after {args.warmup}"
    )
    eager = best.get("HF eager, ddp", {}).get("tokens_per_s", float("nan"))
    grouped = best.get("HF grouped_mm, ddp", {}).get("tokens_per_s", float("nan"))
    print(
        f"GEMM limit: torch.mm {gemm[0]} x {gemm[1]} x {gemm[2]} {str(dtype)[6:]}, {args.procs} processes x "
        f"{args.threads} thread(s) at once: {rate / 1e9:.1f} GFLOP/s in all; model FLOPs per step "
        f"{flops_per_step / 1e9:.2f} G"
    )
    print(
        "\n| contender | tokens/s (all ranks) | s/step | vs HF eager | vs HF grouped_mm | fraction of the GEMM limit |"
        " peak MB/rank |\n|---|---|---|---|---|---|---|"
    )
    for name in contenders:
        r = best[name]
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['s_per_step']:.3f} | {r['tokens_per_s'] / eager:.2f}x | "
            f"{r['tokens_per_s'] / grouped:.2f}x | {flops_per_step / r['s_per_step'] / rate:.2f} | "
            f"{r['peak_mb']:.0f} |"
        )
    if args.profile:
        import step_profile

        print("\nWhere one step's time goes (rank 0, shares of the profiled step):\n")
        print(step_profile.table({name: best[name]["profile"] for name in contenders}))


if __name__ == "__main__":
    main()
