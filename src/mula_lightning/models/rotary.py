"""Rotary position embedding (RoPE, non-interleaved halves as in Llama / OLMoE / Qwen), applied with one autograd node.

Why: written as tensor ops, ``x * cos + rotate_half(x) * sin`` is a chunk, a negation, a concatenation, two
products and a sum, and autograd records a node for each (with their backward kernels): on CPU the attention's
elementwise work then costs about as much as its projections. :class:`_Rotary` computes the same values with one
product and two in-place multiply-adds into the halves of the output, and its backward is the transposed rotation
(``grad * cos + rotate_half^T(grad * sin)``) in three kernels; no tensor is saved but ``cos`` and ``sin``.

:func:`apply_rotary_reference` is the formula as written, the reference the fused function is tested against
(forward and gradient, float64, random inputs).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_rotary", "apply_rotary_reference"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: the definition (transformers' ``apply_rotary_pos_emb``)."""
    return x * cos + _rotate_half(x) * sin


class _Rotary(torch.autograd.Function):
    """out = x * cos + rotate_half(x) * sin, with rotate_half([x1, x2]) = [-x2, x1] over the last dimension."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d out1 / d x1 = cos1, d out2 / d x1 = sin2; d out1 / d x2 = -sin1, d out2 / d x2 = cos2
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_x = grad * cos
        grad_x[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        grad_x[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return grad_x, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, hd) by position: ``cos`` and ``sin`` of shape (T, hd) (or broadcastable to ``x``).

    The tables are constants (no gradient flows to them); where they require one, the reference formula is used.
    """
    if cos.requires_grad or sin.requires_grad or x.shape[-1] % 2:
        return apply_rotary_reference(x, cos, sin)
    return _Rotary.apply(x, cos, sin)
