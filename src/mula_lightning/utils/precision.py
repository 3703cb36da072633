"""The compute dtype of numerically sensitive steps: at least float32, never lower than the input.

Softmax, normalisation, router logits, losses and weighted sums run in float32 when the model is bf16 / fp16 (as
transformers does), but a float64 model must stay float64: a ``.float()`` there would round every float64 run
to float32 and make float64 parity tests (``mula_lightning.testing.assert_parity``) only as exact as float32.
"""

from __future__ import annotations

import torch

__all__ = ["at_least_float32", "upcast"]


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``float32`` for half-precision dtypes, the dtype itself for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`at_least_float32` of its dtype (no copy when it already is)."""
    return t.to(at_least_float32(t.dtype))
