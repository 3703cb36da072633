"""Checkpoint directories replaced whole, never overwritten in place, written now or in the background.

A strategy's ``save_checkpoint`` writes a ``torch.distributed.checkpoint`` directory at a path that Lightning often
reuses: ``last.ckpt`` is rewritten at every save. Written in place, a save killed half-way leaves a directory that
mixes the old ``.metadata`` with some new data files: neither checkpoint survives, and the load may not even fail.
Here every save writes ``<path>.partial`` and only once every rank's files are written (DCP's own finish: rank 0
writes ``.metadata`` after gathering each rank's write result, with every file fsynced) rank 0 moves it into place:

1. ``<path>`` (the previous version, if any) is renamed ``<path>.replaced``;
2. ``<path>.partial`` is renamed ``<path>``, the parent directory fsynced;
3. ``<path>.replaced`` is deleted.

A process killed at any instant leaves a complete checkpoint: before step 2 the old ``<path>`` (or, between the two
renames, ``<path>.replaced``, and a complete ``<path>.partial``), after it the new one. :func:`readable_checkpoint`
resolves the path a load should read when the kill fell between the renames (Lightning's ``ckpt_path="last"``
search only sees ``<path>`` itself: that window is two renames long).

:class:`AsyncReplaceSaver` is the same protocol with the write in a background thread (the strategies'
``async_save=True``): the state is staged to host memory in the training thread, written on a checkpoint-only gloo
group, and moved into place once every rank agrees that its write succeeded; at most one save is in flight.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mula_lightning.checkpoint.async_slots import BackgroundSaver, staged_and_agreed
from mula_lightning.checkpoint.checksummed_writes import active_recorder
from mula_lightning.checkpoint.slots import CheckpointWriteError, agreed_preparation
from mula_lightning.utils.dist import all_true, is_distributed, rank_world
from mula_lightning.utils.io import fsync_dir

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"

__all__ = [
    "PARTIAL_SUFFIX",
    "REPLACED_SUFFIX",
    "AsyncReplaceSaver",
    "clear_partial",
    "move_into_place",
    "partial_path",
    "readable_checkpoint",
    "save_replacing",
]


def partial_path(path: Path) -> Path:
    """Where a save of ``path`` is written before it is moved into place."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


def _replaced_path(path: Path) -> Path:
    return path.with_name(path.name + REPLACED_SUFFIX)


def _complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def clear_partial(path: Path, group: Any = None) -> None:
    """Rank 0 deletes what an interrupted save of ``path`` left at ``<path>.partial``; every rank of ``group`` then
    waits for it (collective), so that no rank writes into the directory while it is being deleted."""
    if rank_world()[0] == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(partial_path(path))
    if is_distributed():
        dist.barrier(group=group)


def move_into_place(path: Path) -> None:
    """Rank 0, once every rank's write of ``<path>.partial`` is complete: replace ``path`` by it (steps 1-3 above)."""
    partial, replaced = partial_path(path), _replaced_path(path)
    if not _complete(partial):
        raise CheckpointWriteError(f"{partial}: no .metadata after the write; {path} was left as it was")
    fsync_dir(partial)  # its entries durable before it becomes the checkpoint (DCP fsyncs the files, not the folder)
    if path.exists() or path.is_symlink():
        _remove(replaced)
        path.rename(replaced)
    partial.rename(path)
    fsync_dir(path.parent)
    _remove(replaced)


def readable_checkpoint(path: str | Path) -> Path:
    """The directory a load of ``path`` should read: ``path`` itself, or, when a save was killed between its two
    renames (``path`` missing), the complete new version (``<path>.partial``) or else the previous one
    (``<path>.replaced``), with a warning. Anything else is returned unchanged (the load then names what is missing).
    """
    path = Path(path)
    if path.exists():
        return path
    for candidate in (partial_path(path), _replaced_path(path)):
        if _complete(candidate):
            log.warning("checkpoint: %s is missing (a save was interrupted while replacing it); reading %s",
                        path, candidate)  # fmt: skip
            return candidate
    return path


def _agree_and_move(path: Path, error: BaseException | None, group: Any) -> None:
    """Every rank's write outcome -> one verdict on every rank; rank 0 moves the directory into place on success."""
    if not all_true(error is None, group):
        reason = f"{type(error).__name__}: {error}" if error is not None else "another rank's write failed"
        raise CheckpointWriteError(f"{path}: not saved ({reason}); the previous version, if any, is untouched")
    moved: BaseException | None = None
    if rank_world()[0] == 0:
        try:
            move_into_place(path)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            moved = err
    if not all_true(moved is None, group):
        raise CheckpointWriteError(f"{path}: written but not moved into place on rank 0 ({moved!r})")


def _write_and_move(path: Path, write: Callable[[Path], None], group: Any) -> None:
    """``write(<path>.partial)`` on this rank, then the agreement and the move (raises on every rank on failure)."""
    error: BaseException | None = None
    try:
        write(partial_path(path))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed, then raised on every rank (DCP's
        error = err  # CheckpointException, what a full disk gives, is a BaseException)
    try:
        _agree_and_move(path, error, group)
    except CheckpointWriteError as failure:
        raise failure from error
    if (recorder := active_recorder()) is not None:  # a slot's write: the checksums follow the files
        recorder.moved_tree(partial_path(path), path)


def save_replacing(
    path: str | Path,
    write: Callable[[Path], None] | None = None,
    group: Any = None,
    prepare: Callable[[], Callable[[Path], None]] | None = None,
) -> None:
    """Collective (``group``, default: the default group): ``write(<path>.partial)`` on every rank, then replace
    ``path`` by it. Raises :class:`CheckpointWriteError` on every rank when any rank's write failed.

    With ``prepare`` instead of ``write``: ``prepare()`` collects this rank's part of the state and returns the
    ``write``; every rank's preparation is agreed before any rank writes (a rank that failed to collect its part
    would otherwise wait in the agreement while the others wait in DCP's collectives), and a failure is
    :class:`CheckpointWriteError` on every rank at once."""
    if (write is None) == (prepare is None):
        raise TypeError("save_replacing takes one of write= or prepare=")
    path = Path(path)
    clear_partial(path, group)
    if prepare is not None:
        write = agreed_preparation(prepare, group, path)
    _write_and_move(path, write, group)


class AsyncReplaceSaver(BackgroundSaver):
    """:func:`save_replacing` with the write in a background thread, at most one save in flight (the next save,
    a load or a removal waits for it, and a wait of 10 ms or more is logged). One per strategy; every rank calls
    :meth:`save` and :meth:`wait` alike."""

    def save(self, path: str | Path, stage: Callable[[], Callable[[Path, Any], None]]) -> None:
        """Start the save of ``path`` (collective): wait for the previous one, clear a stale partial, call
        ``stage()`` in this thread (it copies the state to host memory and returns ``write(path, group)``) and agree
        that every rank staged (a staging failure raises :class:`CheckpointWriteError` here, on every rank), then
        write, agree and move into place in the background. A write failure raises at the next :meth:`wait`."""
        path = Path(path)
        self.wait(path.name)
        group = self._checkpoint_group()
        clear_partial(path, group)
        write = staged_and_agreed(stage, self.staging, group, path)  # raises on every rank if any rank failed
        self._start(path.name, lambda: _write_and_move(path, lambda target: write(target, group), group))
