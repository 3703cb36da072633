"""Crash-safe file writes shared by every writer (checkpoints, markers, reports, manifests, model-only files).

A reader must see the old file or the whole new one, never a part, even if the process is killed mid-write: write
to a temporary name in the same directory, fsync it, rename it over the target (atomic on POSIX), fsync the
directory so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir"]


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` for a temporary file beside ``path``, fsync it, rename it to ``path``, fsync the directory.

    A failure (or a kill) inside ``write`` leaves ``path`` as it was; the temporary file is removed on errors.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text))
