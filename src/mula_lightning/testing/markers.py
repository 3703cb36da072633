"""Pytest markers and backend lists for tests that may run on an accelerator.

``requires_gpu`` skips a test (or, as ``pytestmark = requires_gpu``, a module) unless a CUDA or XPU device is
visible, so the suite passes on CPU-only machines and CI. ``BACKENDS`` lists the collective backends usable here:
gloo always, NCCL with CUDA, XCCL with XPU; parametrize distributed tests over it to cover accelerators when present.
This module needs pytest (the ``dev`` extra), which is why it is separate from ``distributed.py``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mula_lightning.utils.device import accelerator_type

__all__ = ["BACKENDS", "available_backends", "gpu_available", "requires_gpu"]


def gpu_available() -> bool:
    """True when a CUDA or an Intel XPU device is visible."""
    return accelerator_type() != "cpu"


def available_backends() -> list[str]:
    """``["gloo"]`` plus ``"nccl"`` when CUDA is usable and ``"xccl"`` when XPU is (and the backend is built in)."""
    backends = ["gloo"]
    kind = accelerator_type()
    if kind == "cuda" and dist.is_nccl_available():
        backends.append("nccl")
    if kind == "xpu" and getattr(dist, "is_xccl_available", lambda: False)():
        backends.append("xccl")
    return backends


#: Collective backends usable on this machine, gloo first.
BACKENDS: list[str] = available_backends()

#: Skip unless a CUDA or XPU device is visible.
requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA or XPU device")
