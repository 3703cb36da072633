"""EPSO vs SO vs replicated AdamW: optimizer-state bytes per rank and shard-update time, side by side.

Run: ``.venv/bin/python benchmarks/optimizer.py`` (CPU, gloo; 4 processes DP=2 x EP=2, then 8 processes
DP=2 x EP=4, then the tensor-parallel layouts folded with EP: 4 processes TP=2 x DP=2 | EP=2 x EDP=2 and 8 processes
TP=2 x DP=4 | EP=4 x EDP=2). Add ``--total 24e6`` to change the model size (elements of the full model).

The model is synthetic on purpose: a non-expert family of P_ne elements (replicated on every rank) and an expert
family of P_e elements (split over EP), in the proportions of Mula-20B-A2B (non-expert share f = 3.7%) and at
f = 0.25, scaled so that one update takes milliseconds. For each mode the benchmark prints

* optimizer-state bytes per rank, measured (``ShardedAdamW.state_bytes``) and from the closed form
  (8 bytes of AdamW moments per owned element, padding included; fp32 parameters, so no master copy):
  none: P_ne + P_e/EP; dp (SO): P_ne/DP + P_e/(DP*EP); ep_aware (EPSO): P_ne/(DP*EP) + P_e/(DP*EP);
  with TP the non-expert family splits into tensor-parallel weights P_tp (99% of it here: attention, embeddings)
  and replicated ones P_rep (norms, routers): none: P_rep + P_tp/TP + P_e/EP; ep_aware: P_rep/W + P_tp/W + P_e/W,
  each family sharded over exactly its replicas (W = world; ``dp`` mode is the DP x EP baseline, not run with TP);
* the time of the shard update alone (the AdamW arithmetic on the owned elements, between barriers; the
  slowest rank, best of the repetitions: the least-disturbed run, as ``timeit`` recommends), and the EPSO
  speed-up over SO next to the prediction
  1 + (EP - 1) * f.

The ranks take turns (barrier, one rank updates, barrier): on a CPU with fewer cores than ranks, concurrent updates
would measure core sharing, not the work each rank owns; in turns, each rank's update runs as it would on its own
device. The ratios are the point; absolute times are those of one CPU core.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.models import MulaConfig
from mula_lightning.parallel.sharded_optimizer import MODES, ShardedAdamW
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import run_distributed_test


def non_expert_share(name: str) -> float:
    """f = non-expert parameters / all parameters of a preset."""
    c = MulaConfig.from_name(name)
    experts = c.num_layers * c.num_experts * 3 * c.hidden_size * c.intermediate_size
    return 1 - experts / c.num_params()


class Synthetic(nn.Module):
    """One replicated tensor, this rank's slice of one expert tensor and, with a ``tp_mesh``, this rank's shard of
    one tensor-parallel weight of ``p_tp`` elements (a DTensor; names as the optimizer classifies)."""

    def __init__(self, p_ne: int, p_e_local: int, p_tp: int = 0, tp_mesh: object = None) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.randn(p_ne) * 0.02)
        self.mlp = nn.Module()
        self.mlp.experts = nn.Module()
        self.mlp.experts.weight = nn.Parameter(torch.randn(p_e_local) * 0.02)
        if p_tp:
            from torch.distributed.tensor import Shard, distribute_tensor

            self.attn = nn.Module()
            self.attn.weight = nn.Parameter(distribute_tensor(torch.randn(p_tp) * 0.02, tp_mesh, [Shard(0)]))


def _modes(tp: int) -> tuple[str, ...]:
    return tuple(m for m in MODES if tp == 1 or m != "dp")


def _measure(rank: int, world_size: int, ep: int, p_ne: int, p_e: int, reps: int, tp: int = 1, p_tp: int = 0) -> dict:
    torch.set_num_threads(1)
    topo = build_topology(ep, tp)
    optimizers = {}
    for mode in _modes(tp):
        model = Synthetic(p_ne, p_e // ep, p_tp, topo.tp_mesh)
        opt = ShardedAdamW(model, topo, mode, bucket_numel=None, lr=1e-4)
        for buf in opt.buffers.values():
            buf.grads.normal_()
        opt._step = 1  # as inside step(): the update uses the bias corrections of step 1
        optimizers[mode] = opt
    modes = _modes(tp)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for rep in range(reps + 1):  # repetition 0 warms up (first touch of the moment buffers) and is dropped
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # interleaved, rotating order
        for mode in order:
            opt = optimizers[mode]
            elapsed = torch.zeros(1)
            for turn in range(world_size):  # one rank at a time: each gets a core, as each would get a device
                dist.barrier()
                if rank == turn:
                    start = time.perf_counter()
                    for fam, buf in opt.buffers.items():
                        opt._adamw_update(fam, buf)
                    elapsed[0] = time.perf_counter() - start
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
            if rep:
                times[mode].append(elapsed.item())
    return {mode: (optimizers[mode].state_bytes(), min(times[mode])) for mode in modes}


def closed_form_bytes(mode: str, p_ne: int, p_e: int, dp: int, ep: int, tp: int = 1, p_tp: int = 0) -> int:
    """8 bytes of AdamW moments per owned element (each family padded to a multiple of its shard group); ``dp`` is
    the experts' data-parallel degree (world / ep); the tensor-parallel family is replicated over world / tp."""

    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    world = dp * ep
    p_e_local, p_tp_local = p_e // ep, p_tp // tp
    owned = {
        "none": p_ne + p_e_local + p_tp_local,
        "dp": ceil(p_ne, dp) * 1 + ceil(p_e_local, dp),
        "ep_aware": ceil(p_ne, world) + ceil(p_e_local, dp) + (ceil(p_tp_local, world // tp) if p_tp else 0),
    }[mode]
    return 8 * owned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", type=float, default=24e6, help="elements of the full synthetic model")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    total = int(args.total)
    cases = [("Mula-20B-A2B proportions", non_expert_share("mula-20b-a2b")), ("f = 0.25", 0.25)]
    print(f"torch {torch.__version__}, gloo on CPU, {total / 1e6:.0f}M elements, best of {args.reps} repetitions")
    header = (
        f"| {'layout':<13} | {'model':<34} | {'mode':<8} | {'state MiB/rank':>14} | {'closed form':>11} | "
        f"{'update ms':>9} | {'EPSO vs SO':>10} | {'predicted':>9} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for world, ep, tp in ((4, 2, 1), (8, 4, 1), (4, 2, 2), (8, 4, 2)):
        dp = world // ep
        layout = f"DP={dp} x EP={ep}" if tp == 1 else f"TP={tp} | EP={ep}"
        for label, f in cases:
            p_non_expert = int(total * f)
            p_e = (total - p_non_expert) // ep * ep
            # with TP the non-expert family is mostly tensor-parallel weights; norms and routers stay replicated
            p_tp = (p_non_expert * 99 // 100) // tp * tp if tp > 1 else 0
            p_ne = p_non_expert - p_tp
            results = run_distributed_test(
                _measure, world, ep=ep, p_ne=p_ne, p_e=p_e, reps=args.reps, tp=tp, p_tp=p_tp, timeout=600
            )[0]
            for mode in _modes(tp):
                nbytes, seconds = results[mode]
                expected = closed_form_bytes(mode, p_ne, p_e, dp, ep, tp, p_tp)
                mark = "=" if nbytes == expected else "!="
                compare = mode == "ep_aware" and tp == 1
                speed = f"{results['dp'][1] / seconds:.2f}x" if compare else ""
                pred = f"{1 + (ep - 1) * f:.2f}x" if compare else ""
                print(
                    f"| {layout:<13} | {label + f' (f={f:.3f})':<34} | {mode:<8} | {nbytes / 2**20:>14.2f} | "
                    f"{mark} {expected / 2**20:>9.2f} | {seconds * 1e3:>9.2f} | {speed:>10} | {pred:>9} |"
                )


if __name__ == "__main__":
    main()
