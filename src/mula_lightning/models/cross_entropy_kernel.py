"""The loss part of the fused LM head + cross-entropy as one Triton kernel: per row, the log-sum-exp, the loss and the
gradient ``(softmax - one_hot) x scale`` written over the logits in their own dtype.

Why: after the head's GEMM the torch path upcasts a chunk's logits to float32 and runs ``log_softmax``, a gather,
``exp_``, a scatter and a multiplication over it (several passes over a chunk-sized float32 buffer; 28 of 98 ms of
an H100 training step in its profile, BENCHMARKS.md). Here one program per row reads the row twice in the logits'
dtype (an online max / sum-of-exponentials pass, then the gradient pass) and writes the gradient in place, in the
dtype the head's backward GEMMs take: no float32 copy of the logits exists. The arithmetic is float32 throughout, as
in the torch path, and the gradient is rounded once, where the torch path casts it before its GEMMs.

Imports Triton (:mod:`mula_lightning.models.linear_cross_entropy` imports this module only when the kernel is asked
for). The kernel uses Triton's built-in operations only, so that on CPU tensors it runs under Triton's interpreter
without ``TRITON_INTERPRET`` having been set before Triton was imported (how the tests check it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns of a row per iteration
# the combine functions ``tl.max`` / ``tl.sum`` reduce with, named so that ``tl.reduce`` runs them: the interpreter
# maps these to numpy's reductions, whereas ``tl.max`` / ``tl.sum`` themselves are library functions written in Triton
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def cross_entropy_rows(
    logits_ptr, targets_ptr, losses_ptr, scale_ptr, n_cols, stride, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    """Row ``program_id``: ``losses = logsumexp(x) - x[target]`` (0 if ignored); with ``WRITE_GRAD``, ``x`` becomes
    ``(softmax(x) - one_hot(target)) * scale`` (0 on an ignored row). A target outside ``[0, n_cols)`` other than
    ``ignore_index`` gives a NaN loss and a NaN gradient row (never another column's logit)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    target = tl.load(targets_ptr + row)
    running_max = tl.full((), float("-inf"), dtype=tl.float32)
    running_sum = tl.full((), 0.0, dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        cols = c0 + tl.arange(0, BLOCK_COLS)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.reduce(x, 0, _MAX))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.reduce(tl.exp(x - new_max), 0, _SUM)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= n_cols))
    safe = tl.where(valid & (target >= 0) & (target < n_cols), target, 0)
    picked = tl.load(base + safe).to(tl.float32)
    loss = tl.where(valid, lse - picked, 0.0)
    tl.store(losses_ptr + row, tl.where(out_of_range, float("nan"), loss))
    if WRITE_GRAD:
        factor = tl.where(valid, tl.load(scale_ptr).to(tl.float32), 0.0)
        factor = tl.where(out_of_range, float("nan"), factor)
        for c0 in range(0, n_cols, BLOCK_COLS):
            cols = c0 + tl.arange(0, BLOCK_COLS)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            grad = tl.where(cols == safe, p - 1.0, p) * factor
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernel(interpreted: bool) -> Any:
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(cross_entropy_rows)
    return triton.jit(cross_entropy_rows)


def cross_entropy_rows_(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor | None
) -> torch.Tensor:
    """Per-row losses (float32) of ``logits`` (rows, V), contiguous rows; with ``grad_scale`` (a 0-d tensor) the
    logits are overwritten by their gradient ``(softmax - one_hot) * grad_scale`` (0 on rows whose target is
    ``ignore_index``).

    A target outside ``[0, V)`` that is not ``ignore_index`` (``-1`` padding, a tokenizer larger than the model's
    vocabulary) makes its row's loss and gradient NaN, where torch's cross-entropy raises: checking on the host would
    read the targets back every step (a device synchronisation, and impossible inside a CUDA graph), so the wrong
    label shows as a non-finite loss, which :class:`~mula_lightning.callbacks.NaNDetector` reports, never as a
    finite wrong one."""
    rows, cols = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("cross_entropy_rows_ needs rows of contiguous columns")
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return losses
    scale = grad_scale if grad_scale is not None else losses  # an unused pointer when no gradient is written
    _kernel(logits.device.type == "cpu")[(rows,)](
        logits, targets, losses, scale, cols, logits.stride(0), ignore_index,
        WRITE_GRAD=grad_scale is not None, BLOCK_COLS=min(BLOCK, triton.next_power_of_2(cols)),
    )  # fmt: skip
    return losses
