"""Context parallelism on the CPU: activation memory per rank against the sequence length at CP 1 / 2 / 4, and the
step time at CP 2 against CP 1 at equal tokens per rank.

Run::

    python benchmarks/context_parallel.py                         # the table in BENCHMARKS.md
    python benchmarks/context_parallel.py --seqs 1024 2048 --reps 1

Each layout runs on ``cp`` gloo processes holding one sequence (the batch of one CP group), the model an OLMoE-like MoE
(every layer MoE, q/k norm, grouped-query attention) in float32. On every rank, after a warm-up step (gradients
allocated), one forward is measured two ways: ``saved``, the bytes of the distinct storages autograd saves for backward
(:func:`~mula_lightning.plan.activations.saved_tensor_bytes`: what the plan's closed forms count), and ``held``, what
the forward left resident (``/proc/self/statm`` sampled every 2 ms, glibc's mmap threshold fixed so freed memory leaves
the process; see ``benchmarks/memory.py``); the busiest rank's are printed, with their ratio to CP 1 at the same length
and ``mula plan``'s prediction (:func:`~mula_lightning.plan.activations.stage_activation_bytes` at ``cp``) beside
``saved``. The step (forward + backward, median of ``--reps``) is timed on rank 0; the second table sets CP 2 at length
2L against CP 1 at length L (equal tokens per rank: CP 2 attends twice the keys, and exchanges them). On 2 cores, CP 4's
4 processes share the cores: its times are not comparable.
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

MB = 2**20


def _config(args):
    from mula_lightning.models import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
        num_kv_heads=2, intermediate_size=args.hidden, num_experts=8, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _rank(rank: int, world_size: int, args, seq: int) -> dict[str, float]:
    import torch.distributed as dist

    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.parallel.context_parallel import apply_context_parallel
    from mula_lightning.plan.activations import saved_tensor_bytes

    fixed_mmap_threshold()
    torch.set_num_threads(1)  # one core per rank, CP 1 too: equal resources per rank
    model = init_weights(MulaForCausalLM(_config(args)), seed=0)
    if world_size > 1:
        apply_context_parallel(model, dist.group.WORLD, world_size, rank)
    x = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    times, held, saved = [], 0, 0
    for rep in range(args.reps + 1):  # the first step allocates the gradients
        start = time.perf_counter()
        with PhaseSampler() as sampler, saved_tensor_bytes(list(model.parameters())) as counted:
            out = model(x, labels=x, return_logits=False)
        (out.loss + out.aux_loss).backward()
        times.append(time.perf_counter() - start)
        if rep:
            held, saved = max(held, sampler.kept), counted["bytes"]
    return {"held": held, "saved": saved, "step": statistics.median(times[1:])}


def _planned(args, seq: int, cp: int) -> int:
    from mula_lightning.plan.activations import stage_activation_bytes

    (stage,) = stage_activation_bytes(_config(args), 1, 1, seq, 1, 4, cp=cp)
    return stage["per_micro_batch"]  # what autograd keeps (the loss's chunk of logits in flight is not kept)


def _measure(args, seq: int, cp: int) -> dict[str, float]:
    from mula_lightning.testing import run_distributed_test

    ranks = run_distributed_test(_rank, cp, args=args, seq=seq, timeout=1800)
    busiest = max(ranks, key=lambda r: r["saved"])
    return {**busiest, "held": max(r["held"] for r in ranks), "step": ranks[0]["step"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, one thread per rank; hidden {args.hidden}, {args.layers} MoE "
          "layers (8 experts top-2, 8 heads over 2 key heads), float32, one sequence per CP group")  # fmt: skip
    print("| tokens | cp | tokens per rank | saved MB (busiest rank) | plan MB | plan / saved | held MB | "
          "saved / CP 1 | held / CP 1 | step s |")  # fmt: skip
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    results: dict[tuple[int, int], dict[str, float]] = {}
    for seq in args.seqs:
        for cp in args.cps:
            got = results[seq, cp] = _measure(args, seq, cp)
            one = results.get((seq, 1))
            planned = _planned(args, seq, cp)
            ratios = (f"{got['saved'] / one['saved']:.2f}x | {got['held'] / one['held']:.2f}x" if one and one["held"]
                      else "- | -")  # fmt: skip
            print(f"| {seq} | {cp} | {seq // cp} | {got['saved'] / MB:.1f} | {planned / MB:.1f} | "
                  f"{planned / got['saved']:.3f} | {got['held'] / MB:.1f} | {ratios} | {got['step']:.3f} |",
                  flush=True)  # fmt: skip
    print("\nequal tokens per rank: CP 2 at length 2L against CP 1 at length L")
    print("| tokens per rank | CP 1 step s | CP 2 step s | CP 2 / CP 1 |")
    print("|--:|--:|--:|--:|")
    for seq in args.seqs:
        if (seq, 1) in results and (2 * seq, 2) in results:
            one, two = results[seq, 1]["step"], results[2 * seq, 2]["step"]
            print(f"| {seq} | {one:.3f} | {two:.3f} | {two / one:.2f}x |")


if __name__ == "__main__":
    main()
