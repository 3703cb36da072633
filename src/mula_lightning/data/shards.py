"""Shuffle and shard: gather globally permuted instances into memory-mappable ``.npy`` shards.

After tokenization, unit *i*'s token file holds ``N_i * seq_len`` useful tokens, read here as an ``(N_i, seq_len)``
memory map. :class:`InstanceReader` maps a *global* instance id (units concatenated in input order) to its row;
:func:`write_npy_split` writes one split's ids, in the permuted order, into ``<split>-NNNNN.npy`` files of shape
``(instances, seq_len)``. Rows are gathered in bounded blocks (about 16M tokens), so memory stays flat however
large the dataset, and each shard is written under a temporary name and renamed: a shard under its final name is
complete, and a resumed run skips it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mula_lightning.data.manifest import sha256_file


class InstanceReader:
    """Global instance id -> tokens, reading the per-unit token files as ``(N_i, seq_len)`` memory maps."""

    def __init__(self, work: Path, per_unit: list[int], seq_len: int, dtype: np.dtype) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(per_unit)]).astype(np.int64)
        self.seq_len = seq_len
        self.dtype = dtype
        self.maps = [
            np.memmap(work / f"unit-{i:05d}.bin", dtype=dtype, mode="r", shape=(n * seq_len,)).reshape(n, seq_len)
            if n
            else None
            for i, n in enumerate(per_unit)
        ]

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (global instance ids) as a ``(len(ids), seq_len)`` array, in the order given."""
        out = np.empty((len(ids), self.seq_len), dtype=self.dtype)
        unit = np.searchsorted(self.offsets, ids, side="right") - 1
        for u in np.unique(unit):
            rows = np.nonzero(unit == u)[0]
            out[rows] = self.maps[u][ids[rows] - self.offsets[u]]
        return out


def write_npy_split(out: Path, split: str, ids: np.ndarray, reader: InstanceReader, per_shard: int) -> dict:
    """Write one split's instances, in permuted order, into ``<split>-NNNNN.npy`` shards (skipping finished ones)."""
    shards = []
    for k, start in enumerate(range(0, len(ids), per_shard)):
        chunk = ids[start : start + per_shard]
        path = out / f"{split}-{k:05d}.npy"
        if not path.is_file():  # a shard under its final name was completed (renamed) by an earlier run
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=reader.dtype, shape=(len(chunk), reader.seq_len))
            rows = max(1, (1 << 24) // reader.seq_len)  # gather ~16M tokens at a time
            for s in range(0, len(chunk), rows):
                arr[s : s + rows] = reader.read(chunk[s : s + rows])
            arr.flush()
            del arr
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        shards.append({"file": path.name, "num_instances": len(chunk), "sha256": sha256_file(path)})
    return {"num_instances": len(ids), "shards": shards}
