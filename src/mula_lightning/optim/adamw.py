"""AdamW as flat-shard math: the one update every optimizer of the package runs for AdamW-trained elements.

Why here: the sharded AdamW of ``epso`` (:mod:`mula_lightning.parallel.sharded_optimizer`), the hierarchical ZeRO
engine, and the AdamW half of :class:`~mula_lightning.optim.muon.MuonAdamW` update flat views of weights, gradients
and moments; the formula (decoupled weight decay, bias correction) exists once, checked against the written-out
reference :func:`adamw_update_reference_`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FUSED_ADAMW_DEVICES", "AdamWPiece", "adamw_update_", "adamw_update_pieces_", "adamw_update_reference_"]


#: device types whose torch build has the one-pass AdamW kernel ``torch._fused_adamw_``
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")


@torch.no_grad()
def adamw_update_(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    runs: Iterable[tuple[int, int, int]],
    param_groups: list[dict[str, Any]],
    step: int,
) -> None:
    """One AdamW step (decoupled weight decay, bias correction) on flat fp32 shards, in place.

    Shared by every optimizer of the package (:class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`, the
    hierarchical ZeRO engine, MuonAdamW's AdamW half), so the update math exists once. ``runs`` are ``(start, end,
    param_group_index)`` ranges of the flat shards (see :class:`~mula_lightning.parallel.flat_buffer.FlatBuffer`);
    ``step`` counts from 1.

    The update goes through torch's fused kernel (``torch._fused_adamw_``, the kernel
    behind ``torch.optim.AdamW(fused=True)``, on CPU, CUDA, XPU and MPS): one pass over the four shards per parameter
    group instead of the six of :func:`adamw_update_reference_`, the same formula (rounded in another order: 1 ulp);
    a device or dtype mix the kernel does not take uses the reference.
    """
    pieces = [(params[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], gi) for lo, hi, gi in runs]
    adamw_update_pieces_(pieces, param_groups, step)


#: one piece of an AdamW update: equal-length 1-D views of weights, gradients and both moments, and the index of the
#: param group whose hyper-parameters apply
AdamWPiece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


@torch.no_grad()
def adamw_update_pieces_(pieces: list[AdamWPiece], param_groups: list[dict[str, Any]], step: int) -> None:
    """:func:`adamw_update_` on pieces that need not be one range of one tensor each (a sharded optimizer's owned
    elements straight in its flat buffers): one fused kernel call per param group over all its pieces."""
    pieces = [piece for piece in pieces if piece[0].numel()]
    if not pieces:
        return
    device = pieces[0][0].device
    fusable = device.type in FUSED_ADAMW_DEVICES and hasattr(torch, "_fused_adamw_")
    fusable = fusable and all(p.dtype == g.dtype == m.dtype == v.dtype for p, g, m, v, _ in pieces)
    if not fusable:
        for p, g, m, v, gi in pieces:
            adamw_update_reference_(p, g, m, v, [(0, p.numel(), gi)], param_groups, step)
        return
    by_group: dict[int, list[AdamWPiece]] = {}
    for piece in pieces:
        by_group.setdefault(piece[4], []).append(piece)
    step_t = torch.tensor(float(step), dtype=torch.float32, device=device)
    for gi, group in by_group.items():
        lr, (b1, b2), eps, wd = _hyper_parameters(param_groups[gi])
        torch._fused_adamw_(
            [piece[0] for piece in group],
            [piece[1] for piece in group],
            [piece[2] for piece in group],
            [piece[3] for piece in group],
            [],
            [step_t] * len(group),
            lr=lr,
            beta1=b1,
            beta2=b2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )


@torch.no_grad()
def adamw_update_reference_(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    runs: Iterable[tuple[int, int, int]],
    param_groups: list[dict[str, Any]],
    step: int,
) -> None:
    """The AdamW step of :func:`adamw_update_` written out, one pass per operation: the slow, obviously right
    reference the fused kernel is tested against, and the path for what the kernel does not take."""
    for lo, hi, gi in runs:
        lr, (b1, b2), eps, wd = _hyper_parameters(param_groups[gi])
        p_s, g_s, m_s, v_s = params[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        p_s.mul_(1 - lr * wd)
        m_s.lerp_(g_s, 1 - b1)
        v_s.mul_(b2).addcmul_(g_s, g_s, value=1 - b2)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        denom = (v_s.sqrt() / math.sqrt(bc2)).add_(eps)
        p_s.addcdiv_(m_s, denom, value=-lr / bc1)


def _hyper_parameters(group: dict[str, Any]) -> tuple[float, tuple[float, float], float, float]:
    """A parameter group's ``(lr, (beta1, beta2), eps, weight_decay)`` (a tensor learning rate as a float)."""
    return float(group["lr"]), tuple(group["betas"]), group["eps"], group["weight_decay"]
