"""How parallel code names and classifies parameters: logical names (wrapper segments removed) and expert tensors.

A leaf shared by expert parallelism, the sharded optimizers, checkpoints and parallelize(), so none of them depends
on another to know which tensors are experts' or what a parameter is called on a single device.
"""

from __future__ import annotations

__all__ = ["is_expert_param", "logical_name"]

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
