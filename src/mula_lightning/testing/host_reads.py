"""``no_host_reads()``: a context in which reading a tensor's value back to the host (``Tensor.item``,
``Tensor.tolist``) raises, so a test can prove that a step's hot path (gradient clipping, say) never waits for the
device: on an accelerator every such read drains the queue of launched kernels before Python continues."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["no_host_reads"]


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Within the block, ``Tensor.item`` and ``Tensor.tolist`` raise ``AssertionError`` (restored on exit)."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a tensor value was read back to the host inside no_host_reads()")

    saved = torch.Tensor.item, torch.Tensor.tolist
    torch.Tensor.item = torch.Tensor.tolist = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.item, torch.Tensor.tolist = saved  # type: ignore[method-assign]
