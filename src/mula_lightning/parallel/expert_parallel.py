"""Expert parallelism for FastSparseMoE, switched on in place: cut the experts, swap the token dispatcher.

Legend: E = experts of the layer, EP = expert-parallel ranks.

:func:`apply_expert_parallel` walks a model (or takes a bare :class:`~mula_lightning.moe.block.FastSparseMoEBlock`)
and, for every MoE block, keeps only this rank's experts ``[r*E/EP, (r+1)*E/EP)`` (the expert parameters are cut
to that slice; parameter objects and state-dict keys are unchanged) and sets the block's ``dispatcher`` to an
:class:`~mula_lightning.parallel.token_dispatchers.AllGatherDispatcher` (Algorithm 1) or
:class:`~mula_lightning.parallel.token_dispatchers.AllToAllDispatcher`. The block's forward is the same one
code path as on one device; the communication plans of both transports are in
:mod:`mula_lightning.parallel.token_dispatchers`. :func:`gather_expert_parallel_state_dict` is the inverse for
saving full weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.reference import ReferenceMoEBlock
from mula_lightning.parallel.collectives import all_gather_into_tensor
from mula_lightning.parallel.params import is_expert_param
from mula_lightning.parallel.token_dispatchers import DISPATCHERS, ExpertParallelDispatcher, make_dispatcher
from mula_lightning.parallel.topology import check_divisible

__all__ = ["DISPATCHERS", "apply_expert_parallel", "expert_tensor_parallel_slice", "gather_expert_parallel_state_dict"]


def apply_expert_parallel(
    model: nn.Module, ep_group: Any, dispatcher: str = "allgather", etp_size: int = 1
) -> nn.Module:
    """Make every MoE block of ``model`` (or ``model`` itself, a bare block) expert parallel over ``ep_group``.

    In place: each block keeps only this rank's experts ``[r*E/EP, (r+1)*E/EP)`` and gets the dispatcher called
    ``dispatcher``. Works on the meta device too. Applying it again over the same group only swaps the
    transport (the experts are already cut).

    With expert tensor parallelism (``etp_size > 1``, Megatron's ETP) ``ep_group`` holds EP x ETP ranks, ``etp_size``
    consecutive ones sharing an expert slice, and each keeps part ``t`` of every expert's intermediate dimension:
    rows ``[t*I/ETP, (t+1)*I/ETP)`` of both the gate and the up halves of ``gate_up_proj`` (kept as ``[gate part;
    up part]``, so the SwiGLU stays local) and those columns of ``down_proj``, whose partial outputs the all-gather
    dispatcher's reduce-scatter sums. It pays when experts are wide (few coarse experts, as the Llama-3 upcycling
    paper's 8 of Llama-3 8B's MLP size); fine-grained experts are too thin to split further (why torchtitan dropped
    it): ``etp_size = 1`` there.

    Args:
        model: a model containing :class:`FastSparseMoEBlock` modules, or such a block.
        ep_group: the process group of the ranks that split the experts (EP x ETP ranks).
        dispatcher: ``"allgather"`` (Algorithm 1) or ``"alltoall"`` (not with ``etp_size > 1``).
        etp_size: the expert-tensor-parallel degree; divides the group's size and the experts' intermediate size.

    Returns:
        ``model``.

    Raises:
        ValueError: when ``ep_size`` does not divide ``num_experts`` or ``etp_size`` the intermediate size or the
            group, the dispatcher is unknown (or all-to-all with ``etp_size > 1``), a block is a
            :class:`ReferenceMoEBlock`, or a block is already expert parallel over another group.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher ({dispatcher!r}) must be one of {tuple(DISPATCHERS)}")
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, ReferenceMoEBlock):
            what = "expert tensor parallelism" if etp_size > 1 else "expert parallelism"
            raise ValueError(f"{where}: {what} needs FastSparseMoEBlock (moe_impl='fast'), not ReferenceMoEBlock")
        if isinstance(module, FastSparseMoEBlock):
            _make_block_expert_parallel(module, ep_group, dispatcher, where, etp_size)
    return model


def expert_tensor_parallel_slice(
    gate_up: torch.Tensor, down: torch.Tensor, etp_rank: int, etp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part ``etp_rank`` of ``etp_size`` of experts' intermediate dimension: ``gate_up`` (N, 2I, H) -> (N, 2I/ETP, H)
    as ``[gate part; up part]``, ``down`` (N, H, I) -> (N, H, I/ETP)."""
    check_divisible(down.shape[-1], etp_size, "the experts' intermediate size", "etp_size")
    return expert_part("gate_up_proj", gate_up, etp_rank, etp_size), expert_part("down_proj", down, etp_rank, etp_size)


def expert_part(name: str, tensor: torch.Tensor, etp_rank: int, etp_size: int) -> torch.Tensor:
    """Part ``etp_rank`` of ``etp_size`` of one fused expert tensor named ``name`` (``...gate_up_proj``: rows of
    both halves of dim 1; ``...down_proj``: columns of dim 2); the tensor itself when ``etp_size`` is 1."""
    if etp_size == 1:
        return tensor
    if name.endswith("down_proj"):
        part = tensor.shape[2] // etp_size
        return tensor[:, :, etp_rank * part : (etp_rank + 1) * part]
    intermediate = tensor.shape[1] // 2
    part = intermediate // etp_size
    lo, hi = etp_rank * part, (etp_rank + 1) * part
    return torch.cat([tensor[:, lo:hi], tensor[:, intermediate + lo : intermediate + hi]], dim=1)


def expert_part_boxes(name: str, local_shape: tuple[int, ...], etp_rank: int, etp_size: int) -> list[tuple]:
    """Where this rank's part of an expert tensor sits in the EP slice it comes from: ``(local index, offsets in the
    slice)`` for each contiguous block of the part (its gate and up halves for ``gate_up_proj``)."""
    whole = tuple(slice(None) for _ in local_shape)
    if etp_size == 1:
        return [(whole, (0,) * len(local_shape))]
    if name.endswith("down_proj"):
        return [(whole, (0, 0, etp_rank * local_shape[2]))]
    part = local_shape[1] // 2
    intermediate = part * etp_size
    return [
        ((slice(None), slice(0, part), slice(None)), (0, etp_rank * part, 0)),
        ((slice(None), slice(part, 2 * part), slice(None)), (0, intermediate + etp_rank * part, 0)),
    ]


def _make_block_expert_parallel(
    block: FastSparseMoEBlock, ep_group: Any, dispatcher: str, where: str, etp_size: int = 1
) -> None:
    current = block.dispatcher
    if isinstance(current, ExpertParallelDispatcher):
        if current.ep_group is not ep_group or current.etp_size != etp_size:
            raise ValueError(f"{where} is already expert parallel over another process group ({current!r})")
        if current.name != dispatcher:
            block.dispatcher = make_dispatcher(dispatcher, block.num_experts, ep_group, etp_size)
        return
    new = make_dispatcher(dispatcher, block.num_experts, ep_group, etp_size)
    experts = block.experts
    local = (new.n_start, new.n_end + 1)
    if etp_size > 1:
        if experts.gate_up_proj.shape[0] != block.num_experts:
            raise ValueError(f"{where}: expert tensor parallelism cuts the full layer's experts; they are already cut")
        gate_up, down = expert_tensor_parallel_slice(
            experts.gate_up_proj.data[local[0] : local[1]], experts.down_proj.data[local[0] : local[1]],
            new.etp_rank, etp_size,
        )  # fmt: skip
        experts.gate_up_proj.data, experts.down_proj.data = gate_up.clone(), down.clone()
        experts.num_experts = new.num_local_experts
        block.dispatcher = new
        return
    for param in (experts.gate_up_proj, experts.down_proj):
        if param.shape[0] == block.num_experts:  # the full layer: keep this rank's slice
            param.data = param.data[local[0] : local[1]].clone()
        elif param.shape[0] != new.num_local_experts or tuple(getattr(experts, "expert_range", local)) != local:
            # an already-local slice (online upcycling builds one per rank) must be this rank's own slice
            raise ValueError(
                f"{where}: expert tensors hold {param.shape[0]} experts "
                f"(range {getattr(experts, 'expert_range', 'unknown')}); expected all {block.num_experts} or this "
                f"EP rank's {new.num_local_experts} experts {list(local)}"
            )
    experts.num_experts = new.num_local_experts
    block.dispatcher = new


def gather_expert_parallel_state_dict(model: nn.Module, ep_group: Any, etp_size: int = 1) -> dict[str, torch.Tensor]:
    """The full (single-device) state dict of an expert-parallel model, on every rank of ``ep_group`` (None: one
    EP rank, nothing to gather).

    Expert tensors are all-gathered along dim 0 over the group (in EP-rank order, i.e. expert order); with
    ``etp_size > 1`` the intermediate parts of each expert slice are joined back (gate parts, then up parts, of
    ``gate_up_proj``; columns of ``down_proj``). The others are returned as they are. The inverse of
    :func:`apply_expert_parallel` for saving full weights.
    """
    out = {}
    for name, tensor in model.state_dict().items():
        if ep_group is not None and is_expert_param(name) and dist.get_world_size(ep_group) > 1:
            full = all_gather_into_tensor(tensor.contiguous(), ep_group, level="ep", tag="ep.gather_state")
            out[name] = _join_intermediate(name, full.chunk(dist.get_world_size(ep_group)), etp_size)
        else:
            out[name] = tensor
    return out


def _join_intermediate(name: str, parts: tuple[torch.Tensor, ...], etp_size: int) -> torch.Tensor:
    """Group-rank-ordered local expert tensors back into the full one (inverse of the ETP and EP cuts)."""
    if etp_size == 1:
        return torch.cat(parts)
    slices = []
    for first in range(0, len(parts), etp_size):  # one EP rank's etp_size parts
        mine = parts[first : first + etp_size]
        if name.endswith("down_proj"):
            slices.append(torch.cat(mine, dim=2))
        else:
            half = mine[0].shape[1] // 2
            slices.append(torch.cat([p[:, :half] for p in mine] + [p[:, half:] for p in mine], dim=1))
    return torch.cat(slices)
