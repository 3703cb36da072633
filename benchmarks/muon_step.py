"""The optimizer step of Muon against AdamW for one MoE layer, at DP 1 and sharded over DP ranks, and the
Newton-Schulz share of a whole training step.

Run: ``.venv/bin/python benchmarks/muon_step.py`` (CPU; ``--hidden 2048 --intermediate 1024 --experts 64`` are
Mula-7B-A1B's layers, minutes per step on a CPU; the default is 4 of them at a quarter of their width: H 512, I 256,
E 64, 8 heads; owners balance over every matrix of the layers, each expert's included).

What is timed (best of ``--repeats``, one process; the ranks' work is computed, not communicated):

* **AdamW** on every element of the layer (torch's fused kernel, the update ``epso`` runs), at DP 1 and on one rank's
  ``1 / DP`` of the elements (``ep_aware`` shards every family element-wise over the ranks that replicate it);
* **Muon** with its AdamW split (:func:`~mula_lightning.optim.muon.muon_update_`: momentum, the Newton-Schulz
  iteration in bfloat16 batched per shape, decoupled weight decay) on the layer's matrices (q, k, v, o and each
  expert's two matrices), at DP 1 and on the most loaded rank's matrices when
  :func:`~mula_lightning.parallel.sharded_muon.partition_matrices` cuts them into DP ranges, as
  :class:`~mula_lightning.parallel.sharded_muon.ShardedMuon` does (an expert tensor cut between experts); the norms
  and the router take AdamW, counted;
* **the training step** of the layer (forward + backward of ``--tokens`` tokens through the attention projections as
  matrix products and :class:`~mula_lightning.moe.block.FastSparseMoEBlock`), to put the Newton-Schulz time in
  proportion.

Communication is not timed: the sharded Muon moves the bytes of AdamW's reduce-scatter and all-gather (a reduce to
each owner and a broadcast from it), so on a device the ratio of the update times is the ratio of the steps' optimizer
parts. The ratios are the point; absolute times are this CPU's.
"""

from __future__ import annotations

import argparse
import time

import torch

from mula_lightning.optim.adamw import adamw_update_pieces_
from mula_lightning.optim.muon import MUON_DEFAULTS, muon_update_, newton_schulz_flops
from mula_lightning.parallel.sharded_muon import partition_matrices


def owned_shapes(shapes: list[tuple[int, ...]], lo: int, hi: int) -> list[tuple[int, ...]]:
    """The matrices (an expert tensor's owned experts as one batch) of elements ``[lo, hi)`` of ``shapes``'
    concatenation: what the owner of that range iterates."""
    out, at = [], 0
    for shape in shapes:
        *batch, rows, cols = shape
        start, end = max(lo, at), min(hi, at + torch.Size(shape).numel())
        if start < end:
            out.append(((end - start) // (rows * cols), rows, cols) if batch else shape)
        at += torch.Size(shape).numel()
    return out


def layer_matrices(hidden: int, intermediate: int, experts: int, heads: int) -> list[tuple[int, ...]]:
    """The shapes Muon trains in one MoE layer: q, k, v, o (full multi-head attention) and the two expert tensors."""
    attention = [(hidden, hidden)] * 4
    return [*attention, (experts, 2 * intermediate, hidden), (experts, hidden, intermediate)]


def best_of(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls (the least-disturbed run), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def adamw_time(numel: int, repeats: int) -> float:
    params, grads, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    group = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return best_of(lambda: adamw_update_pieces_([(params, grads, m, v, 0)], [group], 2), repeats)


def muon_time(shapes: list[tuple[int, ...]], repeats: int) -> float:
    if not shapes:
        return 0.0
    params = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    momenta = [torch.zeros(s) for s in shapes]
    group = dict(lr=1e-3, weight_decay=0.1, **MUON_DEFAULTS)
    return best_of(lambda: muon_update_(params, grads, momenta, group), repeats)


def training_step_time(hidden: int, intermediate: int, experts: int, top_k: int, tokens: int, repeats: int) -> float:
    """Forward + backward of the layer's matrix products on ``tokens`` tokens (attention's four projections, the
    MoE block's experts through FastSparseMoE)."""
    from mula_lightning.moe.block import FastSparseMoEBlock
    from mula_lightning.moe.config import MoEConfig

    block = FastSparseMoEBlock(MoEConfig(hidden_size=hidden, intermediate_size=intermediate, num_experts=experts,
                                         top_k=top_k))  # fmt: skip
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    attention = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
    x = torch.randn(tokens, hidden, requires_grad=True)

    def step() -> None:
        h = x
        for proj in attention:
            h = proj(h)
        y = block(h.unsqueeze(0))
        y = y[0] if isinstance(y, tuple) else y
        y.float().pow(2).mean().backward()

    return best_of(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="layers of the model (owners balance over all of them)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = layer_matrices(args.hidden, args.intermediate, args.experts, args.heads) * args.layers
    muon_numel = sum(torch.Size(s).numel() for s in shapes)
    rest = (2 * args.hidden + args.experts * args.hidden) * args.layers  # norms and routers: AdamW under Muon too
    costs = [newton_schulz_flops(s) for s in shapes]
    print(f"{args.layers} layers H {args.hidden} I {args.intermediate} E {args.experts}: {muon_numel / 1e6:.1f} M "
          "matrix elements, "
          f"Newton-Schulz {sum(costs) / 1e9:.1f} GFLOP per step; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    layer = training_step_time(args.hidden, args.intermediate, args.experts, args.top_k, args.tokens, args.repeats)
    step = layer * args.layers
    print(
        f"training step of one layer ({args.tokens} tokens a rank, forward + backward): {layer * 1e3:.1f} ms; of "
        f"the {args.layers} layers: {step * 1e3:.0f} ms"
    )
    print("| DP | AdamW ms (rank) | Muon ms (busiest rank) | Muon / AdamW | Newton-Schulz share of a step |")
    print("|---:|---:|---:|---:|---:|")
    for dp in args.dp:
        cuts, loads = partition_matrices(shapes, dp)
        busiest = max(range(dp), key=lambda r: loads[r])
        mine = owned_shapes(shapes, cuts[busiest], cuts[busiest + 1])
        adamw = adamw_time(-(-(muon_numel + rest) // dp), args.repeats)
        muon = muon_time(mine, args.repeats) + adamw_time(-(-rest // dp), args.repeats)
        print(f"| {dp} | {adamw * 1e3:.2f} | {muon * 1e3:.1f} | {muon / adamw:.1f}x | {muon / (muon + step):.2f} |")


if __name__ == "__main__":
    main()
