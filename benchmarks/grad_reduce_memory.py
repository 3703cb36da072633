"""Host memory of ``epso``'s gradient reduction in bfloat16: the cast copies a backward keeps in flight.

``reduce_dtype=bfloat16`` reduces each bucket from a bf16 copy of its float32 gradients; a launched collective holds
its input until it is waited for. Launching every bucket's copy before the step waits (as before the bound) kept a
bf16 copy of every gradient: half the float32 gradient buffer more, the opposite of what a smaller reduction dtype
is for. :data:`~mula_lightning.parallel.sharded_optimizer.COPIES_IN_FLIGHT` bounds them.

Run: ``.venv/bin/python benchmarks/grad_reduce_memory.py [--world 4] [--model moe] [--bucket-numel 1000000]``.
Each rank samples its resident memory (``/proc/self/statm``) during one step's backward and optimizer step (after a
first step, so that the moments exist); the table gives the largest rise over the ranks for a float32 reduction,
bf16 with every copy in flight (the old behaviour, ``COPIES_IN_FLIGHT`` unbounded), and bf16 bounded, beside the
float32 gradient buffer's size. On gloo the emulated reduce-scatter also keeps a receive buffer of each bucket in
flight (bf16 as well); NCCL and oneCCL reduce in place.
"""

from __future__ import annotations

import argparse

from memory import MODELS, PhaseSampler, fixed_mmap_threshold


def _rank(rank: int, world_size: int, model: str, reduce: str, bound: int | None, bucket_numel: int) -> dict:
    import torch
    from lightning.fabric import Fabric

    import mula_lightning.parallel.sharded_optimizer as sharded
    from mula_lightning.models import MulaConfig, MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy

    fixed_mmap_threshold()
    torch.set_num_threads(1)
    if bound is not None:
        sharded.COPIES_IN_FLIGHT = bound
    config = MulaConfig(**MODELS[model])
    strategy = FabricEPSOStrategy(ep_size=2 if config.is_moe else 1, bucket_numel=bucket_numel,
                                  reduce_dtype=getattr(torch, reduce))  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        net = MulaForCausalLM(config)
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    x = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        loss = net(x, labels=x).loss
        with PhaseSampler() as sampler:
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    buffers = sum(b.grads.numel() * b.grads.element_size() for b in inner.buffers.values())
    buckets = sum(len(b.buckets) for b in inner.buffers.values())
    return {"rise": sampler.rise, "buffers": buffers, "buckets": buckets}


def main() -> None:
    from mula_lightning.testing import run_distributed_test

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="moe")
    parser.add_argument("--bucket-numel", type=int, default=1_000_000)
    args = parser.parse_args()
    cases = [
        ("float32", 10**9, "float32, every copy in flight"),
        ("float32", None, "float32, bounded (this change)"),
        ("bfloat16", 10**9, "bf16, every copy in flight"),
        ("bfloat16", None, "bf16, bounded (this change)"),
    ]
    print(f"world {args.world}, {args.model}, bf16-true, buckets of {args.bucket_numel:,} elements; MB = 1e6 bytes")
    print(f"{'reduction':<30}{'buckets':>8}{'grad buffer MB':>16}{'backward+step rise MB':>23}")
    for reduce, bound, name in cases:
        ranks = run_distributed_test(_rank, args.world, model=args.model, reduce=reduce, bound=bound,
                                     bucket_numel=args.bucket_numel, timeout=600)  # fmt: skip
        rise = max(r["rise"] for r in ranks)
        print(f"{name:<30}{ranks[0]['buckets']:>8}{ranks[0]['buffers'] / 1e6:>16.1f}{rise / 1e6:>23.1f}")


if __name__ == "__main__":
    main()
