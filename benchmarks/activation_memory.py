"""Activation memory and step time of each activation-checkpointing option against none, side by side.

Run::

    python benchmarks/activation_memory.py                  # the table in BENCHMARKS.md
    python benchmarks/activation_memory.py --seq 256 --reps 1
    python benchmarks/activation_memory.py --device cuda --seq 4096 --hidden 2048   # allocator counters

One process builds a Mula MoE (every layer MoE, OLMoE-like q/k norm, GQA) per option and, after a warm-up step,
samples its resident memory (``/proc/self/statm``, every 2 ms, in a thread; glibc's mmap threshold fixed so freed
activations leave the process, see ``benchmarks/memory.py``) during one forward and one backward: ``held`` is what
the forward left resident for the backward (the activations), ``peak`` the largest rise over the whole step; both
as MB and as a ratio to no checkpointing, with the step time (median of ``--reps``). Weights and gradients are
allocated before the measured step, so the columns are activations (and the recomputation's transients).
On a GPU (``--device cuda``) the same columns come from the allocator's counters (``memory_allocated`` after the
forward, ``max_memory_allocated`` over the step, each minus what was allocated before it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from memory import PhaseSampler, fixed_mmap_threshold  # noqa: E402

OPTIONS = {
    "none": False,
    "full": "full",
    "norm": ["norm"],
    "attention": ["attention"],
    "moe": ["moe"],
    "norm+attention+moe (220B)": ["norm", "attention", "moe"],
}


def _model(args, option):
    from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
    from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing

    config = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
        num_kv_heads=4, intermediate_size=args.hidden, num_experts=8, top_k=2, moe_impl="fast",
    )  # fmt: skip
    return apply_activation_checkpointing(init_weights(MulaForCausalLM(config), seed=0), option)


class _DeviceMemory:
    """The allocator's view of one phase on an accelerator: ``kept`` after it, ``rise`` at its peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> _DeviceMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.kept = torch.cuda.memory_allocated(self.device) - self.start
        self.rise = torch.cuda.max_memory_allocated(self.device) - self.start


def _measure(args, option) -> dict[str, float]:
    device = torch.device(args.device)
    model = _model(args, option).to(device)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    sampler = (lambda: _DeviceMemory(device)) if device.type == "cuda" else PhaseSampler
    held, peak, times = [], [], []
    for rep in range(args.reps + 1):  # the first step allocates gradients and warms up
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        start = time.perf_counter()
        with sampler() as whole:
            with sampler() as forward:
                out = model(x, labels=x)
                loss = out.loss + out.aux_loss
            loss.backward()
        del out, loss
        if rep:
            held.append(forward.kept)
            peak.append(whole.rise)
            times.append(time.perf_counter() - start)
    return {"held": statistics.median(held), "peak": statistics.median(peak), "time": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (allocator counters instead of RSS)")
    args = parser.parse_args()
    fixed_mmap_threshold()
    torch.manual_seed(0)
    shape = f"hidden {args.hidden}, {args.layers} layers, 8 experts top-2, vocab {args.vocab}"
    run = f"batch {args.batch} x seq {args.seq}; float32 on {args.device}, torch {torch.__version__}"
    print(f"MoE: {shape}; {run}, {torch.get_num_threads()} threads\n")
    rows = {name: _measure(args, option) for name, option in OPTIONS.items()}
    base = rows["none"]
    print(f"{'option':<28}{'held MB':>9}{'ratio':>7}{'peak MB':>9}{'ratio':>7}{'step s':>8}{'ratio':>7}")
    for name, r in rows.items():
        print(
            f"{name:<28}{r['held'] / 2**20:>9.1f}{r['held'] / base['held']:>7.2f}{r['peak'] / 2**20:>9.1f}"
            f"{r['peak'] / base['peak']:>7.2f}{r['time']:>8.2f}{r['time'] / base['time']:>7.2f}"
        )


if __name__ == "__main__":
    main()
