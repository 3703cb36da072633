"""Sharded state dicts with *logical* keys for ``torch.distributed.checkpoint`` (DCP).

Why logical keys: a checkpoint must load at another DP x EP layout, another sharding mode, or into one process
(and be exportable to transformers), so nothing in it may depend on how the run was laid out.

* Model: the single-device ``state_dict`` keys and shapes. Non-expert tensors are plain (replicated) tensors;
  an expert tensor is a ``DTensor`` on the (dp, ep) mesh, ``[Replicate(), Shard(0)]``: EP rank r holds experts
  ``[r*E/EP, (r+1)*E/EP)`` along dim 0.
* Optimizer: ``state.<param name>.<exp_avg | exp_avg_sq | master>`` as 1-D tensors of the parameter's full
  ``numel`` (the layout of the optimizer, not of the model, decides where a state's ranges start). Each rank writes
  the ranges it owns, as a :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` (one piece per owned range,
  DCP's chunk format: checkpoints written with ``ShardedTensor`` before load unchanged); where a shard is replicated
  (the ``dp`` mode's non-expert states, the ``none`` mode), only the replica with ``cross_rank == 0`` writes it, and
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
from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
from mula_lightning.parallel.tensor_pieces import TensorPieces
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

            placements = [Replicate() if dim == "edp" else Shard(0) for dim in mesh.mesh_dim_names]
            out[name] = DTensor.from_local(tensor, mesh, placements, run_check=False)
        else:
            out[name] = tensor
    return out


def _global_offset(name: str, local_numel: int, ep_rank: int, ep_size: int) -> int:
    """Flat offset of a rank's local parameter inside the full parameter (expert slices are dim-0 chunks)."""
    return ep_rank * local_numel if is_expert_param(name) and ep_size > 1 else 0


def vector_pieces(local: list[tuple[int, torch.Tensor]], numel: int, like: torch.Tensor) -> Any:
    """A 1-D logical vector of length ``numel`` of which this rank holds ``local`` ``(offset, values)`` ranges: a
    :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` for DCP (an empty one on a rank that writes none)."""
    return TensorPieces((numel,), [((off,), t) for off, t in local], dtype=like.dtype, device=like.device)


def optimizer_state_dict(optimizer: ShardedAdamW) -> dict[str, Any]:
    """Logical-key optimizer state: 1-D per-parameter states written by their owners (see module docstring)."""
    topo = optimizer.topology
    out: dict[str, Any] = {
        "step": optimizer._step,
        # one JSON string: DCP stores it as one object (nested lists of dicts are not restored as such)
        "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]),
    }
    for fam, buf in optimizer.buffers.items():
        plan = optimizer.plans[fam]
        state = optimizer.shards[fam]
        for slot in buf.slots:
            full_numel = slot.numel * (topo.ep_size if is_expert_param(slot.name) and topo.ep_size > 1 else 1)
            base = _global_offset(slot.name, slot.numel, topo.ep_rank, topo.ep_size)
            mine = [seg for seg in buf.segments if seg.slot.name == slot.name] if plan.cross_rank == 0 else []
            for key in _STATE_KEYS:
                if key not in state:
                    continue
                vec = state[key]
                local = [(base + seg.param_start, vec[seg.local_start : seg.local_start + seg.numel]) for seg in mine]
                if is_distributed():
                    out[f"state.{slot.name}.{key}"] = vector_pieces(local, full_numel, vec)
                else:
                    out[f"state.{slot.name}.{key}"] = torch.cat([t for _, t in local]) if local else vec.new_zeros(0)
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
