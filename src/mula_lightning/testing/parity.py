"""One rule for comparing a fast or distributed result with its reference: tolerances derived from the data.

A parity test checks *math*, not one CPU's rounding. Two results of the same computation that differ only in the
order of floating-point operations (a reduction split over ranks, another GEMM kernel, AVX2 vs AVX-512) differ by
at most about ``reduction_len x eps(dtype) x scale``, where ``reduction_len`` bounds how many rounded operations
feed one element (the length of the sums along its path), ``eps`` is the unit round-off of the dtype and
``scale`` is the size of the values involved (by default the largest ``|expected|`` of the tensor). A real bug (a
reduction over the wrong group, a missing ``1/DP`` scale, a dropped token) changes elements by a sizeable fraction
of ``scale``, far above this bound, in float64 (eps 2.2e-16) and still in float32 (eps 1.2e-7).

So:

* run both sides in float64 where the path allows it (gloo reduces float64; the MoE experts fall back to one
  ``torch.mm`` per expert): the bound is ~1e-12 relative and a rounding difference between CPUs cannot reach it;
* keep one float32 case per fast path (the grouped GEMM kernels) with the same rule and float32's ``eps``;
* paths that cannot run in float64 (quantized collectives, bf16) state their own documented bounds.

Parameters after AdamW steps need one more factor: Adam divides by ``sqrt(v) + eps``, so an element whose gradient
is near zero turns a rounding ``delta`` of its gradient into an update difference of up to ``lr x delta / eps``
(the derivative of ``m / (sqrt(v) + eps)`` with respect to ``g`` is at most ``1 / eps``). Compare such parameters
with ``scale=`` :func:`adamw_parameter_scale` (plus the parameters' own size): in float64 this is still ~1e-8 while
a real bug moves parameters by ~lr; in float32 it is of order lr, which is why float32 runs compare gradients and
losses, not parameters after Adam steps.

Setting ``MULA_PARITY_LOG=/path/file.jsonl`` appends one JSON line per comparison (test, message, dtype, largest
difference, tolerance), which is how the CPU matrix (``make test-cpus``) reports the worst case of each setting.
"""

from __future__ import annotations

import json
import os

import torch

__all__ = ["adamw_parameter_scale", "assert_parity", "parity_tolerance"]


def adamw_parameter_scale(*, lr: float, grad_bound: float, eps: float) -> float:
    """The ``scale`` of parameters after AdamW steps, per unit of gradient rounding: ``lr x grad_bound / eps``.

    Use with ``reduction_len = steps x`` (one step's gradient reduction length): N steps of AdamW whose gradient
    elements are at most ``grad_bound`` (the clipping norm bounds every element) and carry a rounding of at most
    ``reduction_len x eps(dtype) x grad_bound`` move a parameter by at most ``lr / eps`` times that per step.

    Args:
        lr: the largest learning rate of the steps.
        grad_bound: a bound on the gradient elements (the clipping ``max_norm``, or the largest gradient).
        eps: AdamW's ``eps``.
    """
    return lr * grad_bound / eps


def parity_tolerance(
    expected: torch.Tensor, *, reduction_len: int, dtype: torch.dtype | None = None, scale: float | None = None
) -> float:
    """The absolute tolerance ``reduction_len x eps(dtype) x scale`` for comparing a result with ``expected``.

    Args:
        expected: the reference values.
        reduction_len: a bound on the number of rounded operations that feed one element (for a GEMM chain, the
            sum of the inner dimensions along the path times the number of rows summed into a weight gradient;
            for N optimizer steps, N times the bound of one step's gradient).
        dtype: the dtype the computation ran in (default: ``expected.dtype``); its unit round-off is used.
        scale: the size of the values involved (default: ``max |expected|``).
    """
    if reduction_len < 1:
        raise ValueError(f"reduction_len ({reduction_len}) must be >= 1")
    dtype = expected.dtype if dtype is None else dtype
    if not dtype.is_floating_point:
        return 0.0
    if scale is None:
        scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    return reduction_len * torch.finfo(dtype).eps * float(scale)


def assert_parity(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    reduction_len: int,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
    msg: str = "",
) -> float:
    """Assert ``|actual - expected| <= reduction_len x eps(dtype) x scale`` elementwise; return the largest difference.

    Shapes and dtypes must be equal. The failure message names the tensor (``msg``), the largest difference, the
    tolerance and the rule, so a failure on another CPU says how far outside the bound it was.

    Args:
        actual: the result of the path under test.
        expected: the reference result.
        reduction_len: see :func:`parity_tolerance`.
        dtype: the dtype the computation ran in (default: ``expected.dtype``).
        scale: the size of the values involved (default: ``max |expected|``).
        msg: what is compared, for the failure message.
    """
    actual, expected = actual.detach(), expected.detach()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{msg}: shape/dtype {tuple(actual.shape)} {actual.dtype} != expected {tuple(expected.shape)} "
            f"{expected.dtype}"
        )
    dtype = expected.dtype if dtype is None else dtype
    tol = parity_tolerance(expected, reduction_len=reduction_len, dtype=dtype, scale=scale)
    diff = (actual.double() - expected.double()).abs()
    largest = diff.max().item() if diff.numel() else 0.0
    _log(msg, dtype, largest, tol)
    if not largest <= tol:  # also fails on NaN
        where = int(diff.argmax()) if diff.numel() else 0
        bad = int((diff > tol).sum())
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
        raise AssertionError(
            f"{msg}: {bad} of {diff.numel()} elements differ by more than {tol:.3g} "
            f"(= reduction_len {reduction_len} x eps({dtype}) {eps:.3g} x scale "
            f"{tol / (reduction_len * eps) if tol else 0.0:.3g}); largest difference "
            f"{largest:.3g} at flat index {where} (actual {actual.reshape(-1)[where].item():.8g}, expected "
            f"{expected.reshape(-1)[where].item():.8g})"
        )
    return largest


def _log(msg: str, dtype: torch.dtype, largest: float, tol: float) -> None:
    path = os.environ.get("MULA_PARITY_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]  # set by pytest while a test runs
    record = {"test": test, "msg": msg, "dtype": str(dtype).replace("torch.", ""), "largest": largest, "tol": tol}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
