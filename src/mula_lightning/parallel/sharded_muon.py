"""Muon sharded as its Newton-Schulz iteration needs: each matrix owned whole by one rank of its family's group.

Why: Muon's update of a matrix is a function of the whole matrix (its momentum orthogonalised), so the flat,
element-wise shards of :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW` cannot compute it. Two
published answers: Moonlight's distributed Muon (arXiv 2502.16982, Section 2.3) all-gathers each sharded momentum and
every rank orthogonalises every matrix (the iteration repeated on all ranks); Megatron's layer-wise distributed
optimizer gives each matrix to one rank. This is the second: no iteration runs twice, and the bytes moved are a
reduce-scatter's and an all-gather's, as for AdamW.

Layout (:class:`~mula_lightning.optim.muon.MuonAdamW`'s ``use_muon`` groups; the others stay ShardedAdamW's
families): the Muon matrices form their own families, ``muon_non_expert`` and ``muon_expert``, sharded over the same
groups as their AdamW counterparts (``ep_aware``: the stage for non-expert matrices, ``dp`` for expert tensors; the
``mode`` table of :mod:`~mula_lightning.parallel.sharded_optimizer` holds). A family's matrices, in its flat buffer's
layout order, are cut into one contiguous range per rank of its group (:func:`partition_matrices`), each range of
about an equal share of the Newton-Schulz FLOPs, every cut at a matrix boundary: between two parameters, or between
two experts of an expert tensor ``(E_local, A, B)``, each expert's ``A x B`` matrix being a matrix of its own (as
torchtitan's and Megatron's distributed Muon treat experts). So an expert tensor spreads over several owners where
its layer's experts outweigh a share, and the busiest owner carries at most its share plus one matrix. The flat
buffer's shards end at those cuts (:class:`~mula_lightning.parallel.flat_buffer.Bucket` with uneven ``bounds``, no
padding). Gradients are reduced to the owners (:func:`~mula_lightning.parallel.collectives.reduce_to_owners`), the
owner updates the momentum (float32: one state per element, half of AdamW's) and the weights, the weights go back
from the owners (:func:`~mula_lightning.parallel.collectives.gather_from_owners`). An owner iterates all its
matrices of one shape, its experts included, in one batched product.

Contiguous ranges, not a greedy choice per matrix (this module's first form, and Megatron's layer-wise rule): a
parameter viewing the flat buffer must stay contiguous in it, so only a contiguous layout can hand the experts of one
tensor to several owners. The price: one bucket's reduction goes to the few owners of its range, where a per-matrix
greedy spread it over the group (the bytes are the same).

Everything else (hooks, micro-batch accumulation, several synchronised backwards, clipping by the global norm with
each element counted once, skipped steps, checkpoints under logical keys with ``momentum_buffer`` in the parameter's
shape) is ShardedAdamW's, unchanged.

Refused in one line: tensor parallelism and expert tensor parallelism (a rank holds a slice of each matrix; gathering
it for the iteration is not done here, and torchtitan refuses the same), and the ``zero_topo`` engine.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mula_lightning.optim.muon import MUON_DEFAULTS, MuonAdamW, muon_update_, newton_schulz_flops
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.params import local_tensor
from mula_lightning.parallel.sharded_optimizer import (
    FamilyPlan,
    ShardedAdamW,
    family_of,
    family_plans,
    unwrap_optimizer,
)
from mula_lightning.parallel.topology import MoETopology

__all__ = ["ShardedMuon", "partition_matrices", "shard_optimizer"]

#: the families whose matrices Muon trains, after ShardedAdamW's
MUON_FAMILIES = {"muon_non_expert": "non_expert", "muon_expert": "expert"}


def partition_matrices(shapes: Sequence[Sequence[int]], ranks: int, steps: int = 5) -> tuple[list[int], list[float]]:
    """Cut the concatenation of ``shapes`` (each ``(A, B)`` or ``(E, A, B)``: E matrices of ``A x B``) into ``ranks``
    contiguous ranges of balanced Newton-Schulz cost (:func:`~mula_lightning.optim.muon.newton_schulz_flops` of
    ``steps``), every cut at a matrix boundary: cut ``r`` is the boundary nearest to ``r / ranks`` of the total cost
    (ties to the earlier one). Each range's cost is then within one matrix's cost of its share.

    Returns:
        The ``ranks + 1`` element offsets where the ranges begin (and the last ends), and each range's cost.
    """
    ends, costs = [0], [0.0]  # after each matrix: elements and cost so far
    for shape in shapes:
        *batch, rows, cols = shape
        cost = float(newton_schulz_flops((rows, cols), steps))
        for _ in range(math.prod(batch)):
            ends.append(ends[-1] + rows * cols)
            costs.append(costs[-1] + cost)
    marks = [0]  # the boundary (matrix count) each range starts at
    for r in range(1, ranks):
        share = costs[-1] * r / ranks
        j = bisect.bisect_left(costs, share)  # costs[j - 1] < share <= costs[j]
        if j == len(costs) or (j > 0 and share - costs[j - 1] <= costs[j] - share):
            j -= 1
        marks.append(max(j, marks[-1]))
    marks.append(len(costs) - 1)
    return [ends[m] for m in marks], [costs[b] - costs[a] for a, b in zip(marks, marks[1:])]


class ShardedMuon(ShardedAdamW):
    """:class:`~mula_lightning.optim.muon.MuonAdamW` over flat buffers: AdamW's families as ShardedAdamW shards them,
    Muon's matrices owned whole (module docstring). Arguments: ShardedAdamW's; param groups may carry ``use_muon``
    and Muon's hyper-parameters (:data:`~mula_lightning.optim.muon.MUON_DEFAULTS` otherwise).

    Raises:
        ValueError: with ``tp_size`` or ``etp_size`` > 1, naming it.
    """

    SINGLE_DEVICE = MuonAdamW
    GROUP_KEYS = (*ShardedAdamW.GROUP_KEYS, "use_muon", *MUON_DEFAULTS)

    def __init__(
        self,
        model: nn.Module,
        topology: MoETopology,
        mode: str = "ep_aware",
        param_groups: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        for size in ("tp_size", "etp_size"):
            if getattr(topology, size, 1) > 1:
                raise ValueError(
                    f"optimizer 'muon' with {size} ({getattr(topology, size)}) > 1 is not supported: each rank holds "
                    "a slice of a matrix and Newton-Schulz needs the whole one (torchtitan refuses it too); use "
                    "optimizer 'adamw' or a layout without tensor parallelism"
                )
        if param_groups is None:
            from mula_lightning.optim.muon import muon_param_groups

            param_groups = muon_param_groups(model)
        param_groups = [{**MUON_DEFAULTS, "use_muon": False, **g} for g in param_groups]
        super().__init__(model, topology, mode, param_groups, **kwargs)

    def _family_plans(self, mode: str, topology: MoETopology) -> dict[str, FamilyPlan]:
        plans = family_plans(mode, topology)
        for fam, base in MUON_FAMILIES.items():
            plans[fam] = FamilyPlan(fam, *[getattr(plans[base], f) for f in ("shard_group", "shard_size",
                                    "shard_rank", "cross_group", "cross_size", "cross_rank")])  # fmt: skip
        return plans

    def _family_of(self, name: str, param: Any, group: dict[str, Any]) -> str:
        base = family_of(name, param)
        return f"muon_{base}" if group.get("use_muon") else base

    def _cuts(self, fam: str, items: list[tuple[str, nn.Parameter, int]], plan: FamilyPlan) -> list[int] | None:
        if fam not in MUON_FAMILIES or plan.shard_size == 1:
            return None
        ordered = sorted(items, key=lambda item: item[2])  # the buffer's layout order (param group, then given)
        steps = max(self.param_groups[g]["ns_steps"] for _, _, g in ordered)  # the cost model (balance only)
        return partition_matrices([local_tensor(p).shape for _, p, _ in ordered], plan.shard_size, steps)[0]

    def _state_keys(self, fam: str) -> tuple[str, ...]:
        return ("momentum_buffer",) if fam in MUON_FAMILIES else super()._state_keys(fam)

    def _update(self, fam: str, buf: FlatBuffer) -> None:
        if fam not in MUON_FAMILIES:
            return self._adamw_update(fam, buf)
        state = self.shards[fam]
        master, momentum = state.get("master"), state["momentum_buffer"]
        by_group: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        for seg in buf.segments:  # whole matrices: a parameter, or some experts of an expert tensor
            shape = local_tensor(seg.slot.param).shape
            matrix = shape[-2] * shape[-1]
            assert seg.param_start % matrix == 0 and seg.numel % matrix == 0, f"{seg.slot.name}: a matrix cut"
            if seg.numel != seg.slot.numel:
                shape = torch.Size((seg.numel // matrix, *shape[-2:]))
            lo, hi = seg.local_start, seg.local_start + seg.numel
            weights = master[lo:hi] if master is not None else buf.params[seg.buffer_start : seg.buffer_end]
            params, grads, momenta = by_group.setdefault(seg.slot.group_index, ([], [], []))
            params.append(weights.view(shape))
            grads.append(buf.grads[seg.buffer_start : seg.buffer_end].view(shape))
            momenta.append(momentum[lo:hi].view(shape))
        for gi, (params, grads, momenta) in by_group.items():
            muon_update_(params, grads, momenta, self.param_groups[gi])
        if master is not None:  # the half-precision weights from their float32 master
            for lo, hi, at, _ in buf.owned_places():
                buf.params[at : at + hi - lo].copy_(master[lo:hi])
        return None


def shard_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    topology: MoETopology,
    names_by_id: dict[int, str] | None = None,
    **kwargs: Any,
) -> ShardedAdamW:
    """``epso``'s sharded form of a user's optimizer: :class:`ShardedMuon` for a
    :class:`~mula_lightning.optim.muon.MuonAdamW`, :class:`ShardedAdamW` for ``torch.optim.AdamW`` (anything else is
    refused, naming it)."""
    inner = unwrap_optimizer(optimizer)
    cls = ShardedMuon if isinstance(inner, (MuonAdamW, ShardedMuon)) else ShardedAdamW
    return cls.from_optimizer(model, inner, topology, names_by_id, **kwargs)
