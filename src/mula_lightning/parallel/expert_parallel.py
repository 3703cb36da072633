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

__all__ = ["DISPATCHERS", "apply_expert_parallel", "gather_expert_parallel_state_dict"]


def apply_expert_parallel(model: nn.Module, ep_group: Any, dispatcher: str = "allgather") -> nn.Module:
    """Make every MoE block of ``model`` (or ``model`` itself, a bare block) expert parallel over ``ep_group``.

    In place: each block keeps only this rank's experts ``[r*E/EP, (r+1)*E/EP)`` and gets the dispatcher called
    ``dispatcher``. Works on the meta device too. Applying it again over the same group only swaps the
    transport (the experts are already cut).

    Args:
        model: a model containing :class:`FastSparseMoEBlock` modules, or such a block.
        ep_group: the expert-parallel process group.
        dispatcher: ``"allgather"`` (Algorithm 1) or ``"alltoall"``.

    Returns:
        ``model``.

    Raises:
        ValueError: when ``ep_size`` does not divide ``num_experts``, the dispatcher is unknown, a block is a
            :class:`ReferenceMoEBlock`, or a block is already expert parallel over another group.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher ({dispatcher!r}) must be one of {tuple(DISPATCHERS)}")
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, ReferenceMoEBlock):
            raise ValueError(
                f"{where}: expert parallelism needs FastSparseMoEBlock (moe_impl='fast'), not ReferenceMoEBlock"
            )
        if isinstance(module, FastSparseMoEBlock):
            _make_block_expert_parallel(module, ep_group, dispatcher, where)
    return model


def _make_block_expert_parallel(block: FastSparseMoEBlock, ep_group: Any, dispatcher: str, where: str) -> None:
    current = block.dispatcher
    if isinstance(current, ExpertParallelDispatcher):
        if current.ep_group is not ep_group:
            raise ValueError(f"{where} is already expert parallel over another process group ({current!r})")
        if current.name != dispatcher:
            block.dispatcher = make_dispatcher(dispatcher, block.num_experts, ep_group)
        return
    new = make_dispatcher(dispatcher, block.num_experts, ep_group)
    experts = block.experts
    local = (new.n_start, new.n_end + 1)
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


def gather_expert_parallel_state_dict(model: nn.Module, ep_group: Any) -> dict[str, torch.Tensor]:
    """The full (single-device) state dict of an expert-parallel model, on every rank of ``ep_group`` (None: one
    EP rank, nothing to gather).

    Expert tensors are all-gathered along dim 0 over the group (in EP-rank order, i.e. expert order); the
    others are returned as they are. The inverse of :func:`apply_expert_parallel` for saving full weights.
    """
    out = {}
    for name, tensor in model.state_dict().items():
        if ep_group is not None and is_expert_param(name) and dist.get_world_size(ep_group) > 1:
            out[name] = all_gather_into_tensor(tensor.contiguous(), ep_group, level="ep", tag="ep.gather_state")
        else:
            out[name] = tensor
    return out
