"""Bytes each rank sends per token per MoE layer, all-gather vs all-to-all dispatch, from the communication ledger.

Run: ``.venv/bin/python benchmarks/ep_dispatch.py`` (CPU, gloo; 2, 4 and 8 processes).

For every Mula MoE preset (its hidden size H, experts E and top-k K; the expert width does not change the traffic,
so it is shrunk to keep memory small) and EP = 2, 4, 8, one forward + backward of an expert-parallel FastSparseMoE
block runs under a :class:`~mula_lightning.parallel.ledger.CommLedger`; the table prints the bytes sent per rank per
token (fp32 activations, b = 4 bytes) next to the closed form:

* all-gather (Aurora, Algorithm 1): forward gathers x (H*b), weights (4K) and indices (8K) from EP-1 peers and
  reduce-scatters the output (H*b); backward reduce-scatters the x and weight gradients and gathers the output
  gradient: ``(EP-1) * (4*H*b + 8K + 8K)``;
* all-to-all: only (token, k) pairs whose expert lives elsewhere travel: r = K*(EP-1)/EP of them per token under
  uniform routing (forced uniform routing makes it exact): x out and y back in both passes plus the expert id:
  ``r * (4*H*b + 8)``.

Token-count exchanges (a few bytes per layer, not per token) are left out of both columns.
"""

from __future__ import annotations

import torch

from mula_lightning.models import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock
from mula_lightning.parallel import apply_expert_parallel
from mula_lightning.parallel.ledger import CommLedger
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import run_distributed_test

PRESETS = ("mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b")
TOKENS = 360  # per rank: S*K is a multiple of E for every preset, so uniform routing is exact
COUNT_TAGS = ("moe.token_count", "moe.a2a.counts")


def _config(name: str) -> MulaConfig:
    return MulaConfig.from_name(name, intermediate_size=8, forced_uniform_routing=True)


def _measure(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    topo = build_topology(world_size)
    out = {}
    for name in PRESETS:
        cfg = _config(name)
        for dispatcher in ("allgather", "alltoall"):
            torch.manual_seed(0)
            block = apply_expert_parallel(FastSparseMoEBlock(cfg), topo.ep_group, dispatcher)
            for p in block.parameters():
                torch.nn.init.normal_(p, std=0.02)
            x = torch.randn(1, TOKENS, cfg.hidden_size, requires_grad=True)
            with CommLedger() as ledger:
                out_x, aux = block.forward_with_aux(x)
                (out_x.square().sum() + aux.aux_loss).backward()
            sent = sum(r.bytes_sent for r in ledger.records if r.tag not in COUNT_TAGS)
            out[(name, dispatcher)] = sent / TOKENS
    return out


def formula(dispatcher: str, ep: int, hidden: int, top_k: int, b: int = 4) -> float:
    if dispatcher == "allgather":
        return (ep - 1) * (4 * hidden * b + 8 * top_k + 8 * top_k)
    return top_k * (ep - 1) / ep * (4 * hidden * b + 8)


def main() -> None:
    print(f"torch {torch.__version__}, gloo on CPU, fp32 activations, {TOKENS} tokens per rank, forward + backward")
    header = (
        f"| {'preset':<15} | {'H':>5} | {'E':>4} | {'K':>2} | {'EP':>3} | {'dispatcher':<10} | "
        f"{'KiB/token (ledger)':>18} | {'formula':>9} | {'a2a / ag':>8} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for ep in (2, 4, 8):
        measured = run_distributed_test(_measure, ep, timeout=900)[0]
        for name in PRESETS:
            cfg = _config(name)
            ag = measured[(name, "allgather")]
            for dispatcher in ("allgather", "alltoall"):
                got = measured[(name, dispatcher)]
                expected = formula(dispatcher, ep, cfg.hidden_size, cfg.top_k)
                ratio = f"{got / ag:.2f}" if dispatcher == "alltoall" else ""
                print(
                    f"| {name:<15} | {cfg.hidden_size:>5} | {cfg.num_experts:>4} | {cfg.top_k:>2} | {ep:>3} | "
                    f"{dispatcher:<10} | {got / 1024:>18.2f} | {expected / 1024:>9.2f} | {ratio:>8} |"
                )


if __name__ == "__main__":
    main()
