"""Asynchronous dual-slot saves: stage the state to CPU at the step, write and complete the slot in the background.

Why: a synchronous save stops training for as long as storage takes (minutes for a large model on a shared file
system). Here the training thread only does what must happen at the step: agree on the slot and clear it (steps 1-2
of :mod:`mula_lightning.checkpoint.slots`), capture the RNG states, and copy this rank's part of the state into host
memory (pinned when an accelerator is present, so the copy does not wait on pageable memory). A background thread
then runs the rest of the protocol unchanged (steps 3-5: write, fsync, checksum, agree, marker), so the marker is
written only after every rank's files are complete and fsynced, and a SIGKILL at any instant leaves the previous
slot as the newest complete one, exactly as for a synchronous save.

Rules:

* at most one save in flight: the next save (and the end of training) waits for it; the wait is logged with its
  length, on rank 0, since it is training time lost to storage;
* the background collectives (DCP's planning, the agreement, the final barrier) run on a checkpoint-only gloo
  process group created once, so they never interleave with the training's collectives on the default group
  (NCCL or XCCL on accelerators, where a second thread's collectives on the same communicator could deadlock);
* a state that could not be staged on some rank raises :class:`CheckpointWriteError` on every rank from
  :meth:`AsyncSlotSaver.save` itself: the ranks agree that every rank staged its part before any background write
  starts, so no rank enters DCP's collectives while another has given up on them (:func:`staged_and_agreed`);
* a failure of the background write (a full disk, a rank that could not write) raises
  :class:`CheckpointWriteError` from the next wait, on every rank, with no marker written.

Why not ``torch.distributed.checkpoint.async_save`` directly: its stager copies plain tensors and DTensors, not
the pieces of a tensor a sharded rank holds (:class:`~mula_lightning.parallel.tensor_pieces.TensorPieces`), and its
future ends with the DCP write, whereas the slot's fsyncs, checksums, agreement and marker must follow it in the
same background job on the same group. Its executor does what :class:`AsyncSlotSaver` does: ``dcp.save`` in a
thread, on a process group passed to it.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.checkpoint.slots import agreed_preparation, clear_slot, rng_state, write_and_mark
from mula_lightning.parallel.tensor_pieces import map_held
from mula_lightning.utils.dist import is_distributed, rank_world
from mula_lightning.utils.env_flags import env_flag

log = logging.getLogger(__name__)

__all__ = [
    "AsyncSlotSaver",
    "BackgroundSaver",
    "StagingBuffers",
    "stage_to_host",
    "staged_and_agreed",
    "synchronize_staging",
]


def _pinned() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


class StagingBuffers:
    """Host tensors a saver stages into, kept from one of its saves to the next.

    Why: a fresh host buffer is memory the kernel has to find and zero page by page at its first write; staging 860
    MB into fresh tensors took 0.36 s on the development machine, into the same tensors again 0.14 s, and this copy
    is the part of an asynchronous save that the training step waits for. On an accelerator the pinned buffers are
    torch's caching host allocator's anyway. The price is that the rank's staged state stays allocated between saves
    (``MULA_CHECKPOINT_KEEP_STAGING=0`` frees it after each save). A buffer is reused only by the saver that owns it
    and only after its previous save finished (a saver waits for the save in flight before staging the next), and only
    for the same entry of the state (its path of keys and piece) with the same shape, dtype and pinning.
    """

    def __init__(self) -> None:
        self._held: dict[tuple, tuple[torch.Tensor, bool]] = {}  # key -> (buffer, pinned)
        self._seen: set[tuple] = set()
        self._roots = 0

    @staticmethod
    def enabled() -> bool:
        return env_flag("MULA_CHECKPOINT_KEEP_STAGING", True)

    def begin(self) -> None:
        self._seen, self._roots = set(), 0

    def root(self) -> tuple:
        """The key prefix of the next object staged in this save (a stage() may stage several)."""
        self._roots += 1
        return (self._roots,)

    def end(self) -> None:
        """Forget the buffers this save did not use (the state lost entries, or changed shape)."""
        self._held = {key: value for key, value in self._held.items() if key in self._seen}

    def copy(self, key: tuple, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        out, pinned = self._held.get(key, (None, pin))
        self._seen.add(key)
        if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype or pinned != pin:
            out = _fresh_copy(tensor, pin)
            self._held[key] = (out, pin)
            return out
        return out.copy_(tensor.detach(), non_blocking=pin)

    def __len__(self) -> int:
        return len(self._held)


_staging = threading.local()  # the StagingBuffers of the stage() that runs in this thread, if any


def _fresh_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return out.copy_(tensor.detach(), non_blocking=pin)


def _host_copy(tensor: torch.Tensor, pin: bool, key: tuple) -> torch.Tensor:
    buffers: StagingBuffers | None = getattr(_staging, "buffers", None)
    return _fresh_copy(tensor, pin) if buffers is None else buffers.copy(key, tensor, pin)


def stage_to_host(obj: Any, pin: bool | None = None, _key: tuple = ()) -> Any:
    """A copy of ``obj`` that later training cannot change: every tensor copied into host memory (pinned when an
    accelerator is present), :class:`TensorPieces` piece by piece, a DTensor as the pieces of its local shard (its
    offsets in the logical tensor), containers rebuilt, anything else deep-copied. Inside a saver's staging
    (:func:`staged_and_agreed` with buffers) the tensors are that saver's :class:`StagingBuffers`. Call
    :func:`synchronize_staging` before using the copies from another thread when tensors were on an accelerator."""
    pin = _pinned() if pin is None else pin
    if not _key and (buffers := getattr(_staging, "buffers", None)) is not None:
        _key = buffers.root()  # two objects staged in one save never share a buffer
    if isinstance(obj, torch.Tensor):
        pieces = itertools.count()
        return map_held(obj, lambda t: _host_copy(t, pin, (*_key, next(pieces))))
    if isinstance(obj, dict):
        return type(obj)((k, stage_to_host(v, pin, (*_key, k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(stage_to_host(v, pin, (*_key, i)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def synchronize_staging() -> None:
    """Wait for non-blocking copies into pinned memory (a no-op on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.synchronize()


def staged_and_agreed(
    stage: Callable[[], Callable[[Path, Any], None]], buffers: StagingBuffers | None, group: Any, what: Any
) -> Callable[[Path, Any], None]:
    """``stage()`` (the copy to host memory, waited for; into ``buffers`` when given), agreed by every rank of
    ``group`` before any background write starts (:func:`~mula_lightning.checkpoint.slots.agreed_preparation`):
    when it raises on any rank (host memory exhausted, a pinned allocation refused on one node), every rank raises
    :class:`~mula_lightning.checkpoint.slots.CheckpointWriteError` now, naming it, and no write starts. Collective
    over ``group``. ``buffers`` must not be in use by a save still in flight."""

    def staged() -> Callable[[Path, Any], None]:
        previous = getattr(_staging, "buffers", None)
        try:
            if buffers is not None:
                buffers.begin()
            _staging.buffers = buffers
            write = stage()
            synchronize_staging()
            if buffers is not None:
                buffers.end()
            return write
        finally:
            _staging.buffers = previous

    return agreed_preparation(staged, group, what)


class BackgroundSaver:
    """One background write at a time: the thread, the wait (recorded, and logged on rank 0 from 10 ms), the error
    handed to the training thread, and the checkpoint-only gloo group. :class:`AsyncSlotSaver` and
    :class:`~mula_lightning.checkpoint.replace_dir.AsyncReplaceSaver` give it their protocols."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        self._in_flight: Any = None
        self.waits: list[tuple[Any, float]] = []  # (what waited, seconds), for logs and benchmarks
        #: host memory this saver stages into, reused from save to save (None: fresh tensors each time)
        self.staging: StagingBuffers | None = StagingBuffers() if StagingBuffers.enabled() else None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def _checkpoint_group(self) -> Any:
        """The checkpoint-only gloo group (collective the first time: every rank creates it at its first save)."""
        if not is_distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait(self, waiter: Any = None) -> float:
        """Block until the save in flight (if any) is complete; returns the seconds waited and logs them (rank 0).

        Args:
            waiter: what is waiting (a step, a path's name), recorded in :attr:`waits` and named in the log.

        Raises:
            CheckpointWriteError: (or the background's error) when that save failed.
        """
        if self._thread is None:
            return 0.0
        start = time.monotonic()
        self._thread.join()
        waited = time.monotonic() - start
        self._thread, saved = None, self._in_flight
        error, self._error = self._error, None
        if waiter is not None:
            self.waits.append((waiter, waited))
        if rank_world()[0] == 0 and waited >= 0.01:
            log.warning("checkpoint: %s waited %.2f s for the save of %s to finish", self._who(waiter), waited,
                        self._who(saved))  # fmt: skip
        if error is not None:
            raise error
        return waited

    def _who(self, label: Any) -> str:
        return "training" if label is None else str(label)

    def _start(self, label: Any, run: Callable[[], None]) -> None:
        """Run ``run`` in a daemon thread; an exception it raises is raised by the next :meth:`wait`."""

        def guarded() -> None:
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread at the next wait
                self._error = err

        self._in_flight = label
        # a daemon thread: a process that dies or exits mid-save must not wait for storage (the save then stays
        # incomplete, as after a SIGKILL, and what was saved before stays the newest complete checkpoint)
        self._thread = threading.Thread(target=guarded, name=f"mula-checkpoint-{label}", daemon=True)
        self._thread.start()


class AsyncSlotSaver(BackgroundSaver):
    """Runs dual-slot saves with their writes in a background thread, at most one in flight (see the module
    docstring). One per checkpoint directory; every rank calls :meth:`save` and :meth:`wait` alike."""

    def __init__(self) -> None:
        super().__init__()
        self.completed = 0  # slots this saver completed

    def _who(self, label: Any) -> str:
        return "training" if label is None else f"step {label}"

    def save(
        self,
        dirpath: str | Path,
        step: int,
        stage: Callable[[], Callable[[Path, Any], None]],
        layout: dict[str, Any] | None = None,
        signature: dict[str, list[int]] | None = None,
        phase_hook: Callable[[str], None] | None = None,
        run_id: str | None = None,
        on_complete: Callable[[Path], None] | None = None,
    ) -> Path:
        """Start the save of ``step`` into the slot that is not the newest valid one (collective); returns the slot.

        Args:
            stage: called once the slot is cleared, in the training thread; copies this rank's state to host memory
                and returns ``write(path, group)``, which the background thread calls to write it (a collective
                over ``group``, the checkpoint-only group). Every rank's staging is agreed before any write starts.

        Raises:
            CheckpointWriteError: on every rank, when the previous save failed, or when any rank's ``stage`` raised
                (no background write is started; the slot stays without a marker).
            layout, signature, phase_hook, run_id: as for :func:`~mula_lightning.checkpoint.slots.save_slot`.
            on_complete: called with the slot in the background thread once its marker is written.
        """
        self.wait(step)
        hook = phase_hook or (lambda phase: None)
        group = self._checkpoint_group()
        slot = clear_slot(dirpath, hook)
        rng = rng_state()
        write = staged_and_agreed(stage, self.staging, group, f"{slot}: checkpoint of step {step}")

        def run() -> None:
            done = write_and_mark(slot, step, lambda path: write(path, group), rng, layout, signature, hook, run_id,
                                  group)  # fmt: skip
            self.completed += 1
            if on_complete is not None:
                on_complete(done)

        self._start(step, run)
        return slot
