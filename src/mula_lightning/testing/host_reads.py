"""Reads of tensor values back to the host, refused or counted: a test's proof that a step's hot path never (or only
so often) waits for the device. On an accelerator every such read drains the queue of launched kernels before Python
continues, so a step that reads a metric, sizes a tensor by its data or branches on a tensor stalls once per read.

* ``no_host_reads()``: within the block ``Tensor.item`` and ``Tensor.tolist`` raise (gradient clipping, say);
* ``counting_host_reads()``: within the block every host read is recorded with the place in the code that asked
  for it (not torch's own frames), so a test can say which reads a training step makes, and how many.

What counts as a host read (:data:`HOST_READS`): a value read (``item``, ``tolist``, ``numpy``, ``bool()`` /
``int()`` / ``float()`` / ``index()`` of a tensor, e.g. an ``if`` on it), and an operation whose output size depends on
the values (``nonzero``, ``argwhere``, ``masked_select``, ``unique``, ``bincount``, boolean-mask indexing,
``repeat_interleave`` of tensor counts without ``output_size``): the device must finish before the host can allocate
the result. On CPU the same calls are free, which is why a test run on CPU has to count them rather than time them.
They are seen through a ``TorchFunctionMode``, i.e. where Python code calls them; a read inside a C++ kernel (none in
this project's code on accelerators, as ``make gpu-check`` checks with CUDA's sync debug mode) is not seen here.
"""

from __future__ import annotations

import collections
import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HOST_READS", "HostReads", "counting_host_reads", "no_host_reads"]

_T = torch.Tensor
#: functions and methods that read a tensor's values back to the host or size their output by them
HOST_READS = frozenset(
    {
        _T.item, _T.tolist, _T.numpy, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
        _T.nonzero, torch.nonzero, torch.argwhere, _T.argwhere, torch.masked_select, _T.masked_select,
        torch.unique, _T.unique, torch.unique_consecutive, _T.unique_consecutive, torch.bincount, _T.bincount,
    }
)  # fmt: skip
_TORCH_DIR = os.path.dirname(torch.__file__)


def _is_read(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in HOST_READS:
        return True
    if func is _T.__getitem__ and len(args) > 1:  # x[mask]: as many rows as the mask has True values
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if func in (torch.repeat_interleave, _T.repeat_interleave):  # tensor counts without output_size
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


class HostReads(TorchFunctionMode):
    """A ``TorchFunctionMode`` that records every host read (see the module docstring) as ``(name, "file:line")`` of
    the innermost caller outside torch, in :attr:`sites` (a ``Counter``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_read(func, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(_TORCH_DIR)]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            self.sites[(getattr(func, "__name__", repr(func)), where)] += 1
        return func(*args, **kwargs)

    def total(self, path_part: str = "") -> int:
        """Reads whose site's path contains ``path_part`` (all of them by default)."""
        return sum(n for (_, where), n in self.sites.items() if path_part in where)


@contextlib.contextmanager
def counting_host_reads() -> Iterator[HostReads]:
    """Record the host reads made inside the block (this thread); yields the :class:`HostReads` to inspect."""
    with HostReads() as reads:
        yield reads


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
