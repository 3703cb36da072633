"""One safetensors file, its header parsed once, any box of any tensor read with ``pread`` straight into its tensor.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page a read touches stays in the process's
resident set for as long as the file is open. A store that keeps its files open (reading tens of thousands of
per-expert tensors one by one must not re-parse a header per tensor) then shows the whole part of the checkpoint it
has touched as resident memory: under ``zero_topo`` the setup of a run started from a transformers directory rose
0.57x of the model per rank where the rank keeps 0.25x (``benchmarks/memory.py --init-from``), and monitoring, the
OOM killer and cgroup limits count it. ``os.pread`` copies the bytes asked for into the destination and leaves
nothing mapped.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length ``N``, ``N`` bytes
of JSON (``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the
end of the header), then the tensors' bytes, little-endian, row-major. Every entry is checked against the file when
it is opened: a truncated file or a header that does not add up raises an error naming the file and the key.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["SAFETENSORS_DTYPE_NAMES", "SafetensorsFile"]

#: safetensors' dtype names, as torch dtypes
SAFETENSORS_DTYPE_NAMES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _pread_into(fd: int, buffer: memoryview, offset: int, where: str) -> None:
    """Fill ``buffer`` with the file's bytes from ``offset`` (several reads where the kernel returns fewer)."""
    done = 0
    while done < len(buffer):
        if hasattr(os, "preadv"):  # straight into the buffer
            got = os.preadv(fd, [buffer[done:]], offset + done)
        else:  # platforms without preadv: one copy more
            data = os.pread(fd, len(buffer) - done, offset + done)
            buffer[done : done + len(data)] = data
            got = len(data)
        if got <= 0:
            raise ValueError(
                f"{where}: the file ends at byte {offset + done}, before the {len(buffer)} bytes asked for"
            )
        done += got


class SafetensorsFile:
    """An open safetensors file (a file descriptor, closed by :meth:`close`) and its checked header.

    Attributes:
        entries: ``key -> (safetensors dtype name, shape, first byte in the file)``.
        metadata: the header's ``__metadata__`` (``None`` when absent).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is shorter than its header says, the header is not safetensors JSON, or an entry's
            dtype, shape and byte range disagree (the message names the file and the key).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.entries, self.metadata = self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> tuple[dict[str, tuple[str, tuple[int, ...], int]], Any]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise ValueError(f"{self.path}: cannot read safetensors file (truncated: {size} bytes, header of {length})")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except ValueError as err:
            raise ValueError(f"{self.path}: cannot read safetensors file (header is not JSON: {err})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: cannot read safetensors file (header is not a JSON object)")
        metadata, start, entries = header.pop("__metadata__", None), 8 + length, {}
        for key, entry in header.items():
            try:
                dtype, shape, (begin, end) = (
                    entry["dtype"],
                    tuple(int(s) for s in entry["shape"]),
                    entry["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{self.path}: cannot read safetensors file (entry {key!r}: {entry})") from None
            if dtype not in SAFETENSORS_DTYPE_NAMES:
                raise ValueError(
                    f"{self.path}: {key!r} has dtype {dtype}, not one of {sorted(SAFETENSORS_DTYPE_NAMES)}"
                )
            nbytes = math.prod(shape) * SAFETENSORS_DTYPE_NAMES[dtype].itemsize
            if end - begin != nbytes or begin < 0:
                raise ValueError(
                    f"{self.path}: {key!r} of shape {shape} {dtype} holds bytes [{begin}, {end}), not {nbytes}"
                )
            if start + end > size:
                raise ValueError(
                    f"{self.path}: truncated: {key!r} needs bytes [{start + begin}, {start + end}), the file has {size}"
                )
            entries[key] = (dtype, shape, start + begin)
        return entries, metadata

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, key: str, bounds: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The box ``[lo, hi)`` per dimension of tensor ``key`` (all of it without ``bounds``), a new tensor."""
        dtype, shape, _ = self.entries[key]
        bounds = [(0, s) for s in shape] if bounds is None else bounds
        return self.read_into(
            key, bounds, torch.empty([hi - lo for lo, hi in bounds], dtype=SAFETENSORS_DTYPE_NAMES[dtype])
        )

    def read_into(self, key: str, bounds: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
        """Read the box ``bounds`` of ``key`` into the contiguous CPU tensor ``out`` of its shape and the stored dtype:
        one read per contiguous run of the box (one read for a box of leading rows)."""
        dtype, shape, first = self.entries[key]
        lengths = [hi - lo for lo, hi in bounds]
        if len(bounds) != len(shape) or any(lo < 0 or hi > s or lo > hi for (lo, hi), s in zip(bounds, shape)):
            raise ValueError(f"{self.path}: box {bounds} outside {key!r} of shape {shape}")
        if list(out.shape) != lengths or out.dtype != SAFETENSORS_DTYPE_NAMES[dtype] or not out.is_contiguous():
            raise ValueError(f"{self.path}: {key!r}: target {tuple(out.shape)} {out.dtype} is not the box {lengths}")
        if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
            raise NotImplementedError("reading safetensors files on a big-endian host")
        if out.numel() == 0:
            return out
        itemsize = out.dtype.itemsize
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        split = len(shape) - 1  # dimensions after ``split`` are whole in the box: a run is contiguous
        while split > 0 and lengths[split] == shape[split]:
            split -= 1
        run = (lengths[split] * strides[split] if shape else 1) * itemsize
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
        where = f"{self.path} ({key!r})"
        outer = itertools.product(*(range(lo, hi) for lo, hi in bounds[:split]))
        for n, index in enumerate(outer):
            element = sum(i * s for i, s in zip(index, strides)) + (bounds[split][0] * strides[split] if shape else 0)
            _pread_into(self.fd, buffer[n * run : (n + 1) * run], first + element * itemsize, where)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()
