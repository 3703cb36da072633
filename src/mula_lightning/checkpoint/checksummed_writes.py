"""Checksums computed while a checkpoint is written, so completing a slot does not read its files back.

Why: the dual-slot protocol (:mod:`mula_lightning.checkpoint.slots`) records every file's size and checksum
(xxh3_64) in the slot's marker. Read back after the write, that is a second pass over every byte a rank saved (a copy
out of the page cache and the checksum); and the files DCP writes already carry a checksum nobody checks:
``torch.save`` puts a CRC32 in each zip record (miniz's, about twice the cost of zlib's), which ``torch.load`` never
verifies. Measured for one rank of the MoE of ``benchmarks/memory.py`` under ``epso`` (430 MB): the zip CRC32 0.29 s
of CPU, the read-back 0.16 s, of about 1.1 s that a save costs. On a node whose cores all train (the 2-core CI
machine; a CPU cluster) an asynchronous save takes that CPU from training.

While :func:`recording_checksums` is active in a thread, :func:`~mula_lightning.checkpoint.dcp_format.save_dcp` writes
through :class:`ChecksummingWriter`: every byte DCP hands a data file goes into an xxh3_64 digest on its way to the
file, and the file's size and checksum land in the recorder when the file is closed (``.metadata`` under its final
name); for the duration of that write, ``torch.save`` skips its own zip CRC32 (:func:`zip_crc32_skipped`), since the
slot's checksum covers every byte. The slot takes a recorded checksum only where the file on disk still has the
recorded size; any other file is read back as before.

The checksum is xxHash's XXH3 (64 bits) rather than zlib's CRC32: 10.0 GB/s against 2.2 GB/s on the development
machine (zlib's CRC32 took 0.39 s of the 2.6 s of CPU of an 860 MB save there), and a resume verifies a slot's files
that much faster. Both release the GIL, so a background write's hashing never stops the training thread.

The zip records' CRC32 is switched off through torch's serialization config (``compute_crc32``), whose settings are
thread-local: a ``torch.save`` in another thread meanwhile keeps its CRC32s. ``torch.load`` reads records without one
as any other (it does not check the field).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from mula_lightning.checkpoint.direct_writes import DirectFileSystem, DirectWriter

__all__ = ["ChecksumRecorder", "ChecksummingWriter", "active_recorder", "recording_checksums", "zip_crc32_skipped"]

_local = threading.local()


class ChecksumRecorder:
    """Absolute path -> ``(size, xxh3_64)`` of the files written while it was active (thread-safe)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def record(self, path: str | Path, size: int, digest: int) -> None:
        with self._lock:
            self._files[os.path.abspath(path)] = (size, digest)

    def moved(self, old: str | Path, new: str | Path) -> None:
        with self._lock:
            if (entry := self._files.pop(os.path.abspath(old), None)) is not None:
                self._files[os.path.abspath(new)] = entry

    def moved_tree(self, old: str | Path, new: str | Path) -> None:
        """Re-key every file recorded under the directory ``old`` to the same place under ``new`` (renamed)."""
        old_prefix, new_dir = os.path.abspath(old) + os.sep, os.path.abspath(new)
        with self._lock:
            for key in [k for k in self._files if k.startswith(old_prefix)]:
                self._files[os.path.join(new_dir, key[len(old_prefix) :])] = self._files.pop(key)

    def checksum(self, path: str | Path) -> int | None:
        """The recorded xxh3_64 of ``path``, or None when it was not recorded or the file's size is no longer the one
        written (then the caller reads it back)."""
        with self._lock:
            entry = self._files.get(os.path.abspath(path))
        if entry is None:
            return None
        try:
            return entry[1] if os.stat(path).st_size == entry[0] else None
        except OSError:
            return None

    def __len__(self) -> int:
        return len(self._files)


@contextmanager
def recording_checksums() -> Iterator[ChecksumRecorder]:
    """Record the size and xxh3_64 of every file :func:`save_dcp` writes from this thread until the block ends."""
    previous = getattr(_local, "recorder", None)
    recorder = _local.recorder = ChecksumRecorder()
    try:
        yield recorder
    finally:
        _local.recorder = previous


def active_recorder() -> ChecksumRecorder | None:
    """The recorder of the innermost :func:`recording_checksums` of this thread, if any."""
    return getattr(_local, "recorder", None)


def _zip_config() -> Any:
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - torch without the switch: records keep their CRC32
        return None
    return config.save if hasattr(config.save, "compute_crc32") else None


@contextmanager
def zip_crc32_skipped() -> Iterator[None]:
    """``torch.save`` in this thread writes its zip records without CRC32 inside the block (torch's serialization
    config is thread-local: other threads keep theirs); the setting is restored when the block ends."""
    save = _zip_config()
    if save is None:
        yield
        return
    previous = save.compute_crc32
    save.compute_crc32 = False
    try:
        yield
    finally:
        save.compute_crc32 = previous


class _ChecksummingStream:
    """A binary write stream that passes every byte to ``stream`` and folds it into an xxh3_64 digest on the way."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.digest = xxhash.xxh3_64()
        self.size = 0
        self.sequential = True  # no seek: the bytes written are the file, in order

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._stream.seek(*args)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        written = self._stream.write(view)
        written = len(view) if written is None else written
        self.size += written
        return written

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, seekable, ...
        return getattr(self._stream, name)


class _ChecksummingFileSystem(DirectFileSystem):
    def __init__(self, recorder: ChecksumRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            checked = _ChecksummingStream(stream) if mode == "wb" else None
            yield stream if checked is None else checked
        if checked is not None and checked.sequential:  # after a seek the digest is not the file's: read back
            self.recorder.record(path, checked.size, checked.digest.intdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.recorder.moved(path, new_path)


class ChecksummingWriter(DirectWriter):
    """DCP's ``FileSystemWriter`` whose files' sizes and xxh3_64 digests go to ``recorder`` as they are written
    (through :class:`~mula_lightning.checkpoint.direct_writes.DirectFileSystem`: not into the page cache)."""

    def __init__(self, path: str | os.PathLike, recorder: ChecksumRecorder, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem(recorder)
