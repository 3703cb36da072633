"""Sharded state dicts with *logical* keys for ``torch.distributed.checkpoint`` (DCP).

Why logical keys: a checkpoint must load at another DP x EP layout, another sharding mode, or into one process
(and be exportable to transformers), so nothing in it may depend on how the run was laid out.

* Model: the single-device ``state_dict`` keys and shapes. Non-expert tensors are plain (replicated) tensors;
  an expert tensor is a ``DTensor`` on the (dp, ep) mesh, ``[Replicate(), Shard(0)]``: EP rank r holds experts
  ``[r*E/EP, (r+1)*E/EP)`` along dim 0.
* Optimizer: ``state.<param name>.<exp_avg | exp_avg_sq | master>`` as 1-D tensors of the parameter's full
  ``numel`` (a flat-buffer range of a 2-D tensor is not a rectangular chunk, a 1-D range is). Each rank writes
  the ranges it owns, as a ``ShardedTensor`` with one shard per owned range; where a shard is replicated (the
  ``dp`` mode's non-expert states, the ``none`` mode), only the replica with ``cross_rank == 0`` writes it, and
  on load only that replica reads and then broadcasts to the others. ``step`` and the param groups'
  hyper-parameters are plain values.

DCP reshards on load: it reads, for every local shard of the target layout, the overlapping parts of the saved
chunks, so saving at DP=2 x EP=2 and loading at DP=1 x EP=2 (or in one process) just works.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.parallel.params import is_expert_param
from mula_lightning.parallel.sharded_optimizer import ShardedAdamW, family_plans
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.dist import is_distributed

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


def model_state_dict(model: nn.Module, topology: MoETopology) -> dict[str, Any]:
    """Logical-key state dict of an expert-parallel model; expert tensors as DTensors (see module docstring)."""
    out: dict[str, Any] = {}
    sharded = topology.ep_size > 1
    mesh = topology.device_mesh if sharded else None
    for name, tensor in model.state_dict().items():
        if sharded and is_expert_param(name):
            from torch.distributed.tensor import DTensor, Replicate, Shard

            out[name] = DTensor.from_local(tensor, mesh, [Replicate(), Shard(0)], run_check=False)
        else:
            out[name] = tensor
    return out


def _global_offset(name: str, local_numel: int, ep_rank: int, ep_size: int) -> int:
    """Flat offset of a rank's local parameter inside the full parameter (expert slices are dim-0 chunks)."""
    return ep_rank * local_numel if is_expert_param(name) and ep_size > 1 else 0


def sharded_vector(
    local: list[torch.Tensor], shards: list[tuple[int, int, int]], numel: int, device, dtype: torch.dtype
) -> Any:
    """A 1-D ShardedTensor of length ``numel`` from (rank, offset, length) shards; ``local`` are this rank's."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    me = dist.get_rank()
    metas = [ShardMetadata([off], [length], f"rank:{r}/{device}") for r, off, length in shards]
    mine = [m for (r, _, _), m in zip(shards, metas) if r == me]
    props = TensorProperties(dtype=dtype)
    md = ShardedTensorMetadata(metas, torch.Size([numel]), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(t, m) for t, m in zip(local, mine)], md)


def optimizer_state_dict(optimizer: ShardedAdamW) -> dict[str, Any]:
    """Logical-key optimizer state: 1-D per-parameter states written by their owners (see module docstring)."""
    topo = optimizer.topology
    out: dict[str, Any] = {
        "step": optimizer._step,
        # one JSON string: DCP stores it as one object (nested lists of dicts are not restored as such)
        "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]),
    }
    all_plans = [
        family_plans(optimizer.mode, MoETopology(topo.dp_size, topo.ep_size, r)) for r in range(topo.world_size)
    ]
    for fam, buf in optimizer.buffers.items():
        plan = optimizer.plans[fam]
        state = optimizer.shards[fam]
        for slot in buf.slots:
            full_numel = slot.numel * (topo.ep_size if is_expert_param(slot.name) and topo.ep_size > 1 else 1)
            shards = []  # (rank, global offset, length) over every rank that writes part of this parameter
            for r, plans in enumerate(all_plans):
                p = plans[fam]
                if p.cross_rank != 0:
                    continue
                base = _global_offset(slot.name, slot.numel, r % topo.ep_size, topo.ep_size)
                for seg in buf.segments_for(p.shard_rank):
                    if seg.slot.name == slot.name:
                        shards.append((r, base + seg.param_start, seg.numel))
            mine = [seg for seg in buf.segments if seg.slot.name == slot.name] if plan.cross_rank == 0 else []
            for key in _STATE_KEYS:
                if key not in state:
                    continue
                vec = state[key]
                local = [vec[seg.local_start : seg.local_start + seg.numel] for seg in mine]
                if is_distributed():
                    out[f"state.{slot.name}.{key}"] = sharded_vector(local, shards, full_numel, vec.device, vec.dtype)
                else:
                    out[f"state.{slot.name}.{key}"] = torch.cat(local) if local else vec.new_zeros(0)
    return out


def apply_optimizer_state_dict(optimizer: ShardedAdamW, state: dict[str, Any]) -> None:
    """After ``dcp.load`` filled the tensors of :func:`optimizer_state_dict` in place: finish the restore.

    Sets the step and hyper-parameters, writes loaded fp32 masters into the parameters, and broadcasts each
    replicated shard from its ``cross_rank == 0`` replica to the others.
    """
    optimizer._step = int(state["step"])
    for group, saved in zip(optimizer.param_groups, json.loads(state["param_groups"])):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if not is_distributed():
        for fam, buf in optimizer.buffers.items():
            for seg in buf.segments:
                for key in _STATE_KEYS:
                    if key in optimizer.shards[fam]:
                        src = state[f"state.{seg.slot.name}.{key}"]
                        optimizer.shards[fam][key][seg.local_start : seg.local_start + seg.numel].copy_(
                            src[seg.param_start : seg.param_start + seg.numel]
                        )
    topo = optimizer.topology
    for fam, buf in optimizer.buffers.items():
        plan = optimizer.plans[fam]
        if plan.cross_size > 1 and plan.cross_group is not None:
            src = _cross_root(fam, optimizer.mode, topo)
            for vec in optimizer.shards[fam].values():
                dist.broadcast(vec, src=src, group=plan.cross_group)
        if "master" in optimizer.shards[fam]:
            buf.scatter_owned(buf.params, optimizer.shards[fam]["master"].to(buf.dtype))
            optimizer._all_gather(fam, buf)


def _cross_root(fam: str, mode: str, topo: MoETopology) -> int:
    """Global rank of the ``cross_rank == 0`` replica of this rank's shard."""
    if mode == "none":
        return 0 if fam == "non_expert" else topo.ep_rank
    return topo.dp_rank * topo.ep_size  # dp mode, non-expert: ep_rank 0 of the same dp_rank
