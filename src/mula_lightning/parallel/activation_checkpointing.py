"""Activation checkpointing: whole decoder layers, or the parts the Aurora paper recomputes (selective).

``activation_checkpointing`` takes:

* ``False`` (or ``None``, ``[]``): store every activation;
* ``"full"`` (or ``True``): recompute each decoder layer in backward, storing only its input;
* a list of parts, each recomputed in backward from its input: ``"norm"`` (every RMSNorm: the layers' two, the
  final one and the q/k norms), ``"attention"`` (the attention block), ``"moe"`` (the expert block: router,
  dispatch, experts, combine), ``"mlp"`` (a dense layer's SwiGLU MLP). The paper's 100B run checkpoints the expert
  blocks, its 220B run norms, attention and expert blocks.

Recomputation never routes differently: each checkpointed region runs its forward inside
:func:`~mula_lightning.moe.router.routing_replay`, so the routers' decisions (chosen experts, capacity drops) of the
forward are taken back by the recomputation instead of being chosen again; the dispatch plan is a function of them.
The MoE outputs read by monitoring and losses (aux losses, tokens per expert) are those of the forward; the
recomputation's copies feed nothing, so nothing is counted twice.

Checkpointing patches ``forward`` (``forward_with_aux`` for MoE blocks) on the module instance: parameter names,
state dicts and checkpoints are unchanged. It uses torch's non-reentrant checkpoint, which restores the RNG state
for the recomputation (Mixtral's router jitter draws the same noise).
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mula_lightning.models.transformer import MulaAttention, MulaDecoderLayer, MulaMLP, MulaModel, RMSNorm
from mula_lightning.moe.router import RoutingReplay, routing_replay

PARTS = ("norm", "attention", "moe", "mlp")

__all__ = [
    "PARTS",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpointed_parts",
    "is_checkpointed",
    "parse_activation_checkpointing",
]


def parse_activation_checkpointing(value: Any) -> str | tuple[str, ...] | None:
    """``"full"``, a tuple of :data:`PARTS`, or None (no checkpointing) for a strategy's ``activation_checkpointing``.

    Raises:
        ValueError: naming the values that are not ``"full"``, a boolean or parts from :data:`PARTS`.
    """
    if value is None or value is False:
        return None
    if value is True or value == "full":
        return "full"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable):
        raise ValueError(f"activation_checkpointing must be 'full', False or a list of {list(PARTS)}, got {value!r}")
    parts = list(value)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(
            f"activation_checkpointing parts {unknown} are unknown; use 'full', False, or a list of {list(PARTS)}"
        )
    return tuple(p for p in PARTS if p in parts) or None


def _is_moe_block(module: nn.Module) -> bool:
    return hasattr(module, "forward_with_aux") and hasattr(module, "gate")


def _checkpointed_call(module: nn.Module, *args: Any, _mula_method: str, **kwargs: Any) -> Any:
    run = getattr(type(module), _mula_method).__get__(module)  # the class's method: a deep copy rebinds correctly
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    replay = RoutingReplay()

    def forward(*a: Any, **k: Any) -> Any:
        with routing_replay(replay):
            return run(*a, **k)

    # the generator's state is saved for the recomputation only where the region draws random numbers (router
    # jitter): the layers have no dropout, and a CUDA graph capture cannot read the state (cuda_graphs.py)
    draws = any(float(getattr(m, "jitter_noise", 0.0) or 0.0) > 0 for m in module.modules())
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=draws, **kwargs)


def checkpoint_module(module: nn.Module, method: str = "forward") -> nn.Module:
    """Make ``module.<method>`` recompute itself in backward (routers replaying their decisions); in place.

    The instance gets a bound method of that name (``copy.deepcopy`` rebinds it to the copy); the set
    ``module._mula_checkpointed`` names the methods so patched."""
    done = module.__dict__.setdefault("_mula_checkpointed", set())
    if method not in done:
        setattr(module, method, types.MethodType(partial(_checkpointed_call, _mula_method=method), module))
        done.add(method)
    return module


def is_checkpointed(module: nn.Module, method: str = "forward") -> bool:
    """Whether ``module.<method>`` recomputes in backward."""
    return method in module.__dict__.get("_mula_checkpointed", ())


def _targets(layer: MulaDecoderLayer, parts: tuple[str, ...]) -> list[tuple[nn.Module, str]]:
    out: list[tuple[nn.Module, str]] = []
    if "attention" in parts:
        out.append((layer.self_attn, "forward"))
    if "moe" in parts and _is_moe_block(layer.mlp):
        out.append((layer.mlp, "forward_with_aux"))
    if "mlp" in parts and isinstance(layer.mlp, MulaMLP):
        out.append((layer.mlp, "forward"))
    if "norm" in parts:
        norms: Iterable[nn.Module] = (layer.input_layernorm, layer.post_attention_layernorm)
        if "attention" not in parts:  # inside a checkpointed attention the q/k norms are recomputed anyway
            norms = [*norms, *(m for m in layer.self_attn.modules() if isinstance(m, RMSNorm))]
        out.extend((norm, "forward") for norm in norms)
    return out


def apply_activation_checkpointing(model: nn.Module, what: Any = "full") -> nn.Module:
    """Checkpoint ``model``'s decoder layers (``"full"``) or the listed parts of each (see the module docstring),
    in place; returns ``model``.

    Raises:
        ValueError: naming an unknown option (see :func:`parse_activation_checkpointing`).
    """
    parsed = parse_activation_checkpointing(what)
    if parsed is None:
        return model
    layers = [m for m in model.modules() if isinstance(m, MulaDecoderLayer)]
    for layer in layers:
        targets: list[tuple[nn.Module, str]] = [(layer, "forward")] if parsed == "full" else _targets(layer, parsed)
        for module, method in targets:
            checkpoint_module(module, method)
    if parsed != "full" and "norm" in parsed:
        for module in model.modules():
            if isinstance(module, MulaModel) and module.norm is not None:  # a pipeline stage before the last has none
                checkpoint_module(module.norm)
    return model


def checkpointed_parts(model: nn.Module) -> dict[str, int]:
    """How many modules of each kind recompute in backward (for tests and logs)."""
    kinds = {"layer": MulaDecoderLayer, "attention": MulaAttention, "norm": RMSNorm, "mlp": MulaMLP}
    out = dict.fromkeys([*kinds, "moe"], 0)
    for module in model.modules():
        for name, cls in kinds.items():
            if isinstance(module, cls) and is_checkpointed(module):
                out[name] += 1
        if _is_moe_block(module) and is_checkpointed(module, "forward_with_aux"):
            out["moe"] += 1
    return out
