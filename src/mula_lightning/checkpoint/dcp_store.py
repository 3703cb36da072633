"""The model tensors of a sharded (DCP) checkpoint, read one tensor, one slice or one flat range at a time.

Why: starting a run from a full checkpoint (``init_from`` a ``mula fit`` run) used to load the whole model on every
rank that read a tensor, which at 220B parameters is 880 GB of host memory per reader. DCP reads any part of a
logical tensor whatever layout wrote it (it copies the overlap of every stored chunk with every requested box), so a
reader asks only for what it keeps:

* :meth:`DcpStore.read` a whole tensor, or a box of it (an EP rank's expert rows): the box is the single piece of a
  :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` target, so only its bytes are copied;
* :meth:`DcpStore.read_range` elements ``[start, stop)`` of the flattened tensor straight into the caller's buffer
  (a ZeRO weight chunk cuts tensors anywhere): the range is cut into the few boxes DCP can address, each a view of
  the buffer, so nothing is allocated when the dtypes agree.

The checkpoint's metadata is read once per store (:class:`_MetadataOnceReader`), not once per tensor. Tensors are
read as data only (:func:`~mula_lightning.utils.safe_load.dcp_load`). The optimizer states are never touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mula_lightning.checkpoint.export import model_prefix
from mula_lightning.models.upcycle_source import Index, TensorStore, index_bounds
from mula_lightning.parallel.tensor_pieces import TensorPieces, flat_range_pieces
from mula_lightning.utils.safe_load import SafeFileSystemReader, dcp_load

__all__ = ["DcpStore"]


class _MetadataOnceReader(SafeFileSystemReader):
    """A :class:`SafeFileSystemReader` that reads (and checks) the ``.metadata`` file once and keeps it: a store
    loads many small parts of one checkpoint, and the metadata of a big one is megabytes."""

    _metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class DcpStore(TensorStore):
    """The tensors under ``prefix`` of the DCP directory ``path`` (keys without the prefix), read on demand.

    Args:
        path: a DCP directory (one holding ``.metadata``).
        prefix: the key prefix of the model's tensors; default: found from the embedding's key (``"model."`` for a
            checkpoint of ``MulaLM``).

    Raises:
        FileNotFoundError: ``path`` is not a DCP directory.
        KeyError: no model tensors under the prefix.
    """

    def __init__(self, path: str | Path, prefix: str | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self._reader = _MetadataOnceReader(str(self.path))
        items = self._reader.read_metadata().state_dict_metadata
        tensors = {k: md for k, md in items.items() if isinstance(md, TensorStorageMetadata)}
        self.prefix = model_prefix(tensors, self.path) if prefix is None else prefix
        self._meta = {
            k[len(self.prefix) :]: (tuple(md.size), md.properties.dtype)
            for k, md in tensors.items()
            if k.startswith(self.prefix)
        }
        if not self._meta:
            raise KeyError(f"{self.path}: no tensors under the prefix {self.prefix!r}")

    def keys(self) -> set[str]:
        return set(self._meta)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def _load(self, key: str, target: torch.Tensor) -> None:
        dcp_load({self.prefix + key: target}, self.path, strict=True, no_dist=True, reader=self._reader)

    def _read(self, key: str, index: Index) -> torch.Tensor:
        shape, dtype = self._meta[key]
        if index is None:
            out = torch.empty(shape, dtype=dtype)
            self._load(key, out)
            return out
        bounds = index_bounds(index, shape, key)
        out = torch.empty([stop - start for start, stop in bounds], dtype=dtype)
        if out.numel():
            self._load(key, TensorPieces(shape, [(tuple(start for start, _ in bounds), out)]))
        return out

    def read_range(self, key: str, out: torch.Tensor, start: int) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of the flattened tensor ``key``, loaded into the 1-D ``out`` in
        place (through a buffer of the stored dtype only where ``out``'s differs)."""
        shape, dtype = self._meta[key]
        count = out.numel()
        target = out if out.dtype == dtype else torch.empty(count, dtype=dtype, device=out.device)
        pieces = flat_range_pieces(target, shape, start, start + count)
        if count:
            self._load(key, TensorPieces(shape, pieces))
        if target is not out:
            out.copy_(target)
        self.reads.append((key, (count,)))
        self.bytes_read += count * dtype.itemsize
        return out
