"""Sharded state dicts with *logical* keys for ``torch.distributed.checkpoint`` (DCP).

Why logical keys: a checkpoint must load at another DP x EP layout, another sharding mode, or into one process
(and be exportable to transformers), so nothing in it may depend on how the run was laid out.

* Model: the single-device ``state_dict`` keys and shapes. Replicated tensors are plain tensors; an expert tensor is
  a ``DTensor`` on the (dp, ep) mesh, ``[Replicate(), Shard(0)]``: EP rank r holds experts ``[r*E/EP, (r+1)*E/EP)``
  along dim 0; a tensor-parallel weight is the DTensor tensor parallelism made of it (sharded over ``tp``).
* Optimizer: ``state.<param name>.<exp_avg | exp_avg_sq | master>`` shaped like the full parameter. Each rank writes
  the elements it owns (a flat range of its local shard, cut into the few boxes of :func:`flat_range_boxes` and
  placed where its shard sits in the full parameter), as a
  :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` (DCP's chunk format); where a shard is replicated
  (the ``dp`` mode's non-expert states, the ``none`` mode), only the replica with ``cross_rank == 0`` writes it, and
  on load only that replica reads and then broadcasts to the others. ``step`` and the param groups'
  hyper-parameters are plain values. Checkpoints that stored the states as 1-D vectors of the parameter's numel
  (before tensor parallelism) load unchanged: the loader reads each tensor in the shape it was saved in
  (:func:`~mula_lightning.checkpoint.dcp_format.load_dcp`).

DCP reshards on load: it reads, for every local shard of the target layout, the overlapping parts of the saved
chunks, so saving at DP=2 x EP=2 and loading at DP=1 x EP=2 (or in one process) just works.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.parallel.expert_parallel import expert_part_boxes
from mula_lightning.parallel.parallelize import expert_full_shape
from mula_lightning.parallel.params import dtensor_local_box, is_dtensor, is_expert_param, local_tensor
from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
from mula_lightning.parallel.tensor_pieces import TensorPieces, flat_range_pieces
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.dist import is_distributed

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "master")


def model_state_dict(model: nn.Module, topology: MoETopology) -> dict[str, Any]:
    """Logical-key state dict of an expert-parallel model; expert tensors as DTensors (see module docstring)."""
    out: dict[str, Any] = {}
    sharded = topology.ep_size > 1
    mesh = topology.device_mesh if sharded else None
    for name, tensor in model.state_dict().items():
        if is_expert_param(name) and topology.etp_size > 1:  # an expert part: its blocks, placed
            full, blocks = local_boxes(name, tensor, topology)
            whole = (
                flat_range_pieces(tensor.reshape(-1), tuple(tensor.shape), 0, tensor.numel()) if tensor.numel() else []
            )
            out[name] = TensorPieces(full, placed_pieces(whole, tuple(tensor.shape), blocks), dtype=tensor.dtype,
                                     device=tensor.device)  # fmt: skip
        elif sharded and is_expert_param(name):
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placements = [Replicate() if dim == "edp" else Shard(0) for dim in mesh.mesh_dim_names]
            out[name] = DTensor.from_local(tensor, mesh, placements, run_check=False)
        else:
            out[name] = tensor
    return out


def local_boxes(name: str, param: Any, topology: MoETopology) -> tuple[tuple[int, ...], list[tuple[Any, tuple]]]:
    """(full shape, ``[(index into this rank's local tensor, offsets of that block in the full tensor)]``) of a
    parameter: a DTensor's local shard where DTensor puts it, an expert slice along dim 0 (and, with expert tensor
    parallelism, its intermediate part: the gate and up halves of ``gate_up_proj`` are two blocks), or the whole
    tensor."""
    local = tuple(local_tensor(param).shape)
    whole = tuple(slice(None) for _ in local)
    if is_dtensor(param):
        return tuple(param.shape), [(whole, dtensor_local_box(param)[1])]
    if is_expert_param(name) and topology.ep_size * topology.etp_size > 1:
        full = expert_full_shape(name, local, local[0] * topology.ep_size, topology.etp_size)
        rows = topology.ep_rank * local[0]
        blocks = expert_part_boxes(name, local, topology.etp_rank, topology.etp_size)
        return full, [(index, (rows + off[0], *off[1:])) for index, off in blocks]
    return whole_layout(local)


def whole_layout(shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[Any, tuple]]]:
    """The layout of a tensor this rank holds whole (see :func:`local_boxes`)."""
    return tuple(shape), [(tuple(slice(None) for _ in shape), (0,) * len(shape))]


def _contiguous_pieces(offsets: tuple[int, ...], piece: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``piece`` at ``offsets`` as contiguous views (split along its first dimension until each is): DCP writes a
    view's bytes only when it is contiguous."""
    if piece.is_contiguous() or piece.dim() == 0:
        return [(offsets, piece)]
    return [
        p for i in range(piece.shape[0]) for p in _contiguous_pieces((offsets[0] + i, *offsets[1:]), piece[i : i + 1])
    ]


def placed_pieces(
    boxes: list[tuple[tuple[int, ...], torch.Tensor]], local_shape: tuple[int, ...], blocks: list[tuple[Any, tuple]]
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Boxes of a rank's local tensor (``(local offsets, view)``) placed in the full tensor through ``blocks`` (see
    :func:`local_boxes`): each box is cut where blocks meet and moved to its block's place."""
    out = []
    for box_offsets, view in boxes:
        for index, block_offsets in blocks:
            lo_hi = [sl.indices(n)[:2] for sl, n in zip(index, local_shape)]
            cut = []
            for d, (lo, hi) in enumerate(lo_hi):
                a, b = max(lo, box_offsets[d]), min(hi, box_offsets[d] + view.shape[d])
                if a >= b:
                    break
                cut.append((a, b))
            else:
                sub = view[tuple(slice(a - box_offsets[d], b - box_offsets[d]) for d, (a, b) in enumerate(cut))]
                placed = tuple(block_offsets[d] + a - lo_hi[d][0] for d, (a, _) in enumerate(cut))
                out.extend(_contiguous_pieces(placed, sub))
    return out


def state_pieces(
    local: list[tuple[int, torch.Tensor]],
    local_shape: tuple[int, ...],
    layout: tuple[tuple[int, ...], list[tuple[Any, tuple]]],
    like: torch.Tensor,
) -> Any:
    """A parameter-shaped optimizer state of which this rank holds ``local`` ``(flat offset in the local tensor,
    values)`` ranges, its local tensor laid out in the full one as ``layout = (full shape, blocks)``
    (:func:`local_boxes`): a :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` for DCP (an empty one on
    a rank that writes none)."""
    full, blocks = layout
    boxes = [
        b for start, values in local for b in flat_range_pieces(values, local_shape, start, start + values.numel())
    ]
    return TensorPieces(full, placed_pieces(boxes, local_shape, blocks), dtype=like.dtype, device=like.device)


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
            layout = local_boxes(slot.name, slot.param, topo)
            local_shape = tuple(local_tensor(slot.param).shape)
            mine = [seg for seg in buf.segments if seg.slot.name == slot.name] if plan.cross_rank == 0 else []
            for key in _STATE_KEYS:
                if key not in state:
                    continue
                vec = state[key]
                local = [(seg.param_start, vec[seg.local_start : seg.local_start + seg.numel]) for seg in mine]
                if is_distributed():
                    out[f"state.{slot.name}.{key}"] = state_pieces(local, local_shape, layout, vec)
                else:  # one process holds every element: the whole state, in the parameter's shape
                    out[f"state.{slot.name}.{key}"] = torch.cat([t for _, t in local]).view(local_shape)
    return out


def apply_optimizer_state_dict(optimizer: ShardedAdamW, state: dict[str, Any]) -> None:
    """After ``dcp.load`` filled the tensors of :func:`optimizer_state_dict` in place: finish the restore.

    Sets the step and hyper-parameters, broadcasts each replicated shard from its ``cross_rank == 0`` replica to the
    others, and writes loaded fp32 masters into the parameters (all-gathered and waited for before it returns).
    """
    optimizer._step = int(state["step"])
    for group, saved in zip(optimizer.param_groups, json.loads(state["param_groups"])):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if not is_distributed():
        for fam, buf in optimizer.buffers.items():
            for seg in buf.segments:
                for key in _STATE_KEYS:
                    if key in optimizer.shards[fam]:
                        src = state[f"state.{seg.slot.name}.{key}"].reshape(-1)  # any saved shape
                        optimizer.shards[fam][key][seg.local_start : seg.local_start + seg.numel].copy_(
                            src[seg.param_start : seg.param_start + seg.numel]
                        )
    topo = optimizer.topology
    for fam in optimizer.buffers:
        plan = optimizer.plans[fam]
        if plan.cross_size > 1 and plan.cross_group is not None:
            src = _cross_root(fam, optimizer.mode, topo)
            for vec in optimizer.shards[fam].values():
                dist.broadcast(vec, src=src, group=plan.cross_group)
    optimizer.write_master_weights()  # the loaded masters into the parameters, every gather waited for


def _cross_root(fam: str, mode: str, topo: MoETopology) -> int:
    """Global rank of the ``cross_rank == 0`` replica of this rank's shard."""
    if mode == "none":
        return {"non_expert": topo.stage_root, "tensor_parallel": topo.stage_root + topo.tp_rank}.get(
            fam, topo.expert_root
        )
    return topo.stage_root + topo.dp_rank * topo.ep_size  # dp mode, non-expert: ep_rank 0 of the same dp_rank
