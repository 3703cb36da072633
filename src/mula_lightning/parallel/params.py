"""How parallel code names and classifies parameters: logical names (wrapper segments removed), expert tensors,
tensor-parallel (DTensor) weights and the part of each that this rank holds.

A leaf shared by expert and tensor parallelism, the sharded optimizers, checkpoints and parallelize(), so none of
them depends on another to know which tensors are experts' or what a parameter is called on a single device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "dtensor_local_box",
    "is_dtensor",
    "is_expert_param",
    "is_tensor_parallel",
    "local_tensor",
    "logical_name",
    "set_local_storage",
]

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def logical_name(name: str) -> str:
    """A parameter name without the segments wrappers insert (activation checkpointing, compile), i.e. the
    single-device name that checkpoints and optimizer states are keyed by."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def is_expert_param(name: str) -> bool:
    """Expert weights are the fused tensors under an ``experts`` module (``...mlp.experts.gate_up_proj``)."""
    return ".experts." in f".{name}"


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (without importing it where it is unused)."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements") and hasattr(tensor, "to_local")


def is_tensor_parallel(param: Any) -> bool:
    """A DTensor sharded over its mesh (tensor parallelism's weights); a replicated DTensor (the norms under
    sequence parallelism) holds the whole tensor like a plain one."""
    return is_dtensor(param) and any(p.is_shard() for p in param.placements)


def local_tensor(param: Any) -> torch.Tensor:
    """The part of ``param`` this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    return param._local_tensor if is_dtensor(param) else param


def dtensor_local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offsets in the full tensor) of what this rank holds of a DTensor, as DTensor itself cuts it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offsets)


def set_local_storage(param: Any, view: torch.Tensor) -> None:
    """Make ``param``'s local values live in ``view`` (a flat buffer's slice of the local shape), values kept by the
    caller. A plain parameter takes ``.data``; a DTensor keeps its placements and swaps its local tensor for one
    on ``view`` (DTensor has no ``.data`` of its local shard).

    Either way the parameter keeps a version counter of its own: one shared with the buffer would make the owner's
    in-place writes into the buffer invalidate the tensors autograd saved.
    """
    if is_dtensor(param):
        local = torch.empty(0, dtype=view.dtype, device=view.device)
        local.data = view
        param._local_tensor = local
    else:
        param.data = view
