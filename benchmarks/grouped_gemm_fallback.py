"""The grouped-GEMM fallbacks side by side: the per-expert ``torch.mm`` loop, one padded ``torch.bmm`` over experts,
and (where it has a kernel) ``torch._grouped_mm``, for the expert MLP's GEMM shapes and growing load imbalance.

Run::

    python benchmarks/grouped_gemm_fallback.py                 # CPU, fp32 and fp64
    python benchmarks/grouped_gemm_fallback.py --hidden 128 --intermediate 64 --shapes 8x64,32x16,64x8,128x4

Why: where no grouped kernel exists (XPU before torch has one, MPS, float64 anywhere) the experts used to run as one
small GEMM per expert. A padded batched GEMM does the work in one call but copies the rows into the padded layout
and computes the padding too: ``waste = experts x max(count) / rows`` times the real rows. The table shows, per
dtype, expert count x rows per expert and waste, the time of one forward GEMM (rows x H -> rows x 2I) plus one weight
gradient (2I x H per expert) for each contender, the loop / padded ratio and what the rule of
``mula_lightning.moe.experts.padded_bmm_pays`` picks; ``PADDED_BMM_CALL_WORK`` and ``PADDED_BMM_COPY_WORK`` are
fitted so that it picks the faster one on the machine this was measured on.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from mula_lightning.moe.experts import (
    _GROUPED_MM,
    PADDED_BMM_CALL_WORK,
    PADDED_BMM_COPY_WORK,
    padded_bmm,
    padded_bmm_pays,
    per_group_mm,
)


def _counts(experts: int, rows: int, waste: float) -> list[int]:
    """Group sizes summing to ``rows`` whose largest is about ``waste`` times the mean (the rest as equal as can be)."""
    largest = min(rows, max(1, round(waste * rows / experts)))
    rest, spare = divmod(rows - largest, experts - 1)
    return [largest] + [rest + (1 if e < spare else 0) for e in range(experts - 1)]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"8x256,64x16"`` -> [(8, 256), (64, 16)]: experts x rows per expert."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_shapes, default=_shapes("8x256,32x64,64x16,128x8"))
    parser.add_argument("--wastes", type=lambda t: [float(v) for v in t.split(",")], default=[1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} threads")
    print(f"torch {torch.__version__}; H={args.hidden}, I={args.intermediate}")
    print(
        f"time of one forward GEMM + one weight gradient, best of {args.repeats}; rule: padded when equal groups or "
        f"padding rows x K x N + {PADDED_BMM_COPY_WORK:.0e} < (experts - 1) x {PADDED_BMM_CALL_WORK:.0e} "
        "(left side x2 in float64)\n"
    )
    head = f"{'dtype':<9}{'experts':>8}{'rows/e':>7}{'waste':>6}{'loop ms':>9}{'padded ms':>10}{'grouped ms':>11}"
    print(f"{head}{'loop/padded':>13}  rule")
    for dtype in (torch.float32, torch.float64):
        for experts, per_expert in args.shapes:
            rows = experts * per_expert
            x = torch.randn(rows, args.hidden, dtype=dtype)
            w = torch.randn(experts, args.hidden, 2 * args.intermediate, dtype=dtype)
            g = torch.randn(rows, 2 * args.intermediate, dtype=dtype)
            for waste in args.wastes:
                counts = _counts(experts, rows, waste)

                def loop(counts=counts, x=x, w=w, g=g):
                    per_group_mm(x, w, counts)
                    per_group_mm(g.t(), x, counts)

                def padded(counts=counts, x=x, w=w, g=g):
                    padded_bmm(x, w, counts)
                    padded_bmm(g.t(), x, counts)

                t_loop, t_pad = _time(loop, args.repeats), _time(padded, args.repeats)
                grouped = "-"
                if _GROUPED_MM is not None and dtype != torch.float64:
                    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)

                    def kernel(offs=offs, x=x, w=w, g=g):
                        _GROUPED_MM(x, w, offs=offs)
                        _GROUPED_MM(g.t().contiguous(), x, offs=offs)

                    grouped = f"{_time(kernel, args.repeats) * 1e3:.2f}"
                name = str(dtype).replace("torch.", "")
                real_waste = experts * max(counts) / rows
                forward = padded_bmm_pays(counts, args.hidden * 2 * args.intermediate, dtype)
                rule = "padded" if forward else "loop"
                print(
                    f"{name:<9}{experts:>8}{per_expert:>7}{real_waste:>6.2f}{t_loop * 1e3:>9.2f}{t_pad * 1e3:>10.2f}"
                    f"{grouped:>11}{t_loop / t_pad:>12.2f}x  {rule}"
                )


if __name__ == "__main__":
    main()
