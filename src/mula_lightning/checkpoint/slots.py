"""The dual-slot checkpoint protocol: crash-safe writes, agreed completion, and resume from the newest good slot.

Why (Aurora paper, Section 4, "Dual checkpointing"): a job killed while it overwrites its only checkpoint has
nothing left to resume from. Two slots are used alternately, so the slot being written is never the newest
complete one. What makes a slot *complete* is a marker file written last; the protocol orders every write so
that a crash at any instant (SIGKILL included) leaves at least one slot whose marker describes exactly the bytes
on disk:

1. All ranks agree which slot to overwrite: never the newest *valid* one (:func:`choose_slot`: after a resume fell
   back from a damaged newest slot, the older slot is the one to keep, whatever the markers' steps say).
2. Rank 0 removes the slot's marker and fsyncs the slot directory, *then* deletes the old payload. From here on
   the slot reads as incomplete, even after a power loss. A barrier keeps every rank from writing earlier.
3. Every rank writes its part (``write(path)``: a DCP save, ``trainer.save_checkpoint``, ...) and its RNG states
   (``rng_rank{r}.pt``), then fsyncs and checksums (xxh3_64) the files it owns: DCP names them ``__{rank}_*``; other
   files (``.metadata``, a single ``torch.save`` file) belong to rank 0. A DCP write checksums its files as it
   writes them (:mod:`~mula_lightning.checkpoint.checksummed_writes`); other files are read back.
4. Ranks agree that every part succeeded: one all-reduce (MIN) of a success flag. If any rank failed, every rank
   raises :class:`CheckpointWriteError` and no marker is written (the other slot stays the newest complete one). A
   failure inside DCP (a full disk) arrives as DCP's ``CheckpointException``, a ``BaseException``: it is converted
   like any other error.
5. Rank 0 gathers the checksums, fsyncs the slot's directories and writes the marker atomically (temporary file,
   fsync, rename, fsync of the directory). The marker holds the step, the layout, every file's size and checksum,
   the model's signature (logical key -> shape) and the run's lineage id (:func:`slot_lineages`). The ranks then
   learn whether it was written (one gather of rank 0's error, the last barrier): a marker rank 0 could not write
   is a :class:`CheckpointWriteError` on every rank at once, the other slot staying the newest complete one.

Resume (:func:`resolve_last`) checks each slot on every rank (marker readable, every listed file present with
its size; the checksums are split over the ranks so each file is read by one rank only; the model signature, when
given) and all-reduces the verdicts: the newest slot that every rank sees as complete wins. When markers exist
but no slot is valid, :class:`CheckpointIntegrityError` names each slot's problem.

This module has no Lightning dependency, so it serves the Trainer callback, Fabric scripts and plain loops.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from mula_lightning.checkpoint.checksummed_writes import recording_checksums
from mula_lightning.utils.dist import (
    all_gather_object,
    all_true,
    broadcast_object,
    is_distributed,
    rank_world,
)
from mula_lightning.utils.io import atomic_write_text, fsync_dir
from mula_lightning.utils.safe_load import UnsafeCheckpointError, load_torch_file

MARKER_NAME = "COMPLETE.json"
SLOT_NAMES = ("slot_a", "slot_b")
STATE_NAME = "state.ckpt"
RNG_NAME = "rng_rank{rank}.pt"
FORMAT_VERSION = 2  # 2: files checksummed with xxh3_64 (1: crc32; markers of both versions load)
_RANK_FILE = re.compile(r"^(?:__(\d+)_|rng_rank(\d+)\.pt$)")


class CheckpointWriteError(RuntimeError):
    """A rank failed to write its part of a slot; no marker was written, the other slot is untouched."""


class CheckpointIntegrityError(RuntimeError):
    """Checkpoint slots exist but none is complete and valid on every rank (the message names each problem)."""


#: the checksum a marker records for every file (xxHash's XXH3, 64 bits: 10.0 GB/s on the development machine against
#: 2.2 GB/s for zlib's CRC32, which markers written before it hold and which still verifies, see CHECKSUMS)
CHECKSUM = "xxh3_64"


class _Crc32:
    """zlib's CRC32 behind the ``update`` / ``intdigest`` interface of :mod:`xxhash`'s digests."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


#: marker field -> a fresh digest of that algorithm; a marker names its algorithm by its field
CHECKSUMS = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}


def file_checksum(path: Path, algorithm: str = CHECKSUM, chunk: int = 1 << 22) -> int:
    """The ``algorithm`` checksum (a :data:`CHECKSUMS` name) of a file as an int, streamed in 4 MiB chunks read into
    one reused buffer (a fresh 4 MiB object per read would be a new mapping, page-faulted in, for every chunk of a
    checkpoint of hundreds of MB)."""
    digest = CHECKSUMS[algorithm]()
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.intdigest()


def owner_rank(relpath: str) -> int:
    """The rank that writes (and fsyncs) a file of a slot: ``__{r}_*`` (DCP) and ``rng_rank{r}.pt`` are rank r's."""
    match = _RANK_FILE.match(Path(relpath).name)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2))


def _payload_files(slot: Path) -> list[str]:
    files = [p.relative_to(slot).as_posix() for p in slot.rglob("*") if p.is_file()]
    return sorted(f for f in files if f != MARKER_NAME and not Path(f).name.startswith(".COMPLETE"))


def model_signature(state_dict: dict[str, Any]) -> dict[str, list[int]]:
    """Logical key -> full shape (a DTensor's global shape), to tell a checkpoint of another model config apart."""
    return {k: list(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def read_marker(slot: Path) -> dict[str, Any] | None:
    """The marker of a slot, ``None`` if there is none; ``ValueError`` if it is unreadable."""
    path = slot / MARKER_NAME
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        int(marker["step"]), dict(marker["files"])  # noqa: B018 - validates the fields
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: unreadable marker ({err})") from err
    return marker


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch CPU and the accelerator's (all devices).

    Only tensors and plain values, so the file reads back with ``torch.load(weights_only=True)``: NumPy's state
    ``(name, keys, pos, has_gauss, cached_gaussian)`` is stored with its key array as an int64 tensor.
    """
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    for name in ("cuda", "xpu"):
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            state[name] = module.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import numpy as np

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    for name in ("cuda", "xpu"):
        if name in state and getattr(torch, name).is_available():
            getattr(torch, name).set_rng_state_all(state[name])


def load_rng(slot: str | Path) -> bool:
    """Restore this rank's RNG states from a slot; False (nothing changed) when the slot has none for this rank."""
    path = Path(slot) / RNG_NAME.format(rank=rank_world()[0])
    if not path.is_file():
        return False
    set_rng_state(_load_rng_file(path))
    return True


def _load_rng_file(path: Path) -> dict[str, Any]:
    """An RNG file read with ``weights_only=True``; one written before NumPy's keys became a tensor holds a NumPy
    array, whose reconstruction functions (plain data, no code) are allowed for that file only."""
    import numpy as np

    try:
        return load_torch_file(path)
    except UnsafeCheckpointError as err:
        if not err.refused.startswith("numpy"):
            raise
    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    numpy_array = [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(numpy_array):
        return load_torch_file(path)


# dirpath (resolved) -> (slot name, step) this process knows to be the newest valid slot: the one resolve_last
# picked (every rank checked it) or the one its own last save completed. Every rank of a job holds the same entry.
_KNOWN_VALID: dict[str, tuple[str, int]] = {}


def _marker_step(slot: Path) -> int:
    try:
        marker = read_marker(slot)
    except ValueError:
        return -1
    return -1 if marker is None else int(marker["step"])


def _remember_valid(slot: Path, step: int) -> None:
    _KNOWN_VALID[str(slot.parent.resolve())] = (slot.name, int(step))


def newest_valid_slot(dirpath: Path, verify_checksums: bool = True) -> str | None:
    """The name of the newest slot every rank sees as complete and valid, None when there is none (collective).

    The same check as :func:`resolve_last` (sizes on every rank, each checksum read by one rank), without raising.
    """
    views = [check_slot(dirpath / name, None, verify_checksums) for name in SLOT_NAMES]
    gathered = all_gather_object(views)
    best, best_step = None, -1
    for i, name in enumerate(SLOT_NAMES):
        steps = {view[i][0] for view in gathered}
        if None not in steps and len(steps) == 1 and (step := steps.pop()) > best_step:
            best, best_step = name, step
    return best


def choose_slot(dirpath: Path) -> Path:
    """The slot to overwrite next: never the newest *valid* slot (payload checks included); agreed by all ranks.

    Looking at the markers alone is not enough: after a resume fell back from a damaged newest slot to the older
    one, the older one is the only good checkpoint left, and overwriting it (because its marker names the lower step)
    loses everything if the job dies during that save. So the slot to keep is the newest valid one as this process
    knows it (what :func:`resolve_last` resolved, or the slot its own last save completed), used while the markers
    on disk still say the same; otherwise (a fresh process, or markers changed by another job) every rank checks
    the slots (:func:`newest_valid_slot`). Rank 0's view decides and is broadcast.
    """
    keep = None
    if rank_world()[0] == 0:
        known = _KNOWN_VALID.get(str(dirpath.resolve()))
        if known is not None:
            steps = {name: _marker_step(dirpath / name) for name in SLOT_NAMES}
            if steps[known[0]] == known[1] and all(v <= known[1] for v in steps.values()):
                keep = known[0]
    keep = broadcast_object(keep)
    if keep is None:
        keep = newest_valid_slot(dirpath)
    if keep is None:  # nothing valid to protect: a slot without a marker first, else the older step
        steps = {name: _marker_step(dirpath / name) for name in SLOT_NAMES}
        choice = broadcast_object(min(SLOT_NAMES, key=lambda n: (steps[n], n)))
        return dirpath / choice
    return dirpath / next(name for name in SLOT_NAMES if name != keep)


def invalidate_slots(dirpath: str | Path, names: list[str] | tuple[str, ...] = SLOT_NAMES) -> None:
    """Remove the markers of the given slots (collective; rank 0 removes, fsyncs, then every rank continues):
    their payloads can no longer be chosen by a resume. Used when a new run is told to overwrite another's."""
    dirpath = Path(dirpath)
    if rank_world()[0] == 0:
        for name in names:
            (dirpath / name / MARKER_NAME).unlink(missing_ok=True)
            if (dirpath / name).is_dir():
                fsync_dir(dirpath / name)
    _KNOWN_VALID.pop(str(dirpath.resolve()), None)
    if is_distributed():
        dist.barrier()


def save_slot(
    dirpath: str | Path,
    step: int,
    write: Callable[[Path], None] | None = None,
    layout: dict[str, Any] | None = None,
    signature: dict[str, list[int]] | None = None,
    phase_hook: Callable[[str], None] | None = None,
    run_id: str | None = None,
    prepare: Callable[[], Callable[[Path, Any], None]] | None = None,
) -> Path:
    """Write one checkpoint into the slot of ``dirpath`` that is not the newest valid one (the module's protocol).

    Collective: every rank calls it with the same ``step``.

    Args:
        dirpath: the directory holding the two slots.
        step: the training step the state belongs to (the newest step wins on resume).
        write: called on every rank with ``slot / "state.ckpt"``; writes this rank's part (collective writers
            such as DCP or ``trainer.save_checkpoint`` are fine: every rank calls it).
        layout: JSON-able description of the run (world size, strategy, DP x EP) stored in the marker.
        signature: :func:`model_signature` of the model, stored in the marker and checked on resume.
        phase_hook: called with ``"begin"``, ``"cleared"``, ``"written"``, ``"agreed"``, ``"done"``; for fault
            injection in tests (a sleep or a kill between the protocol's steps).
        run_id: the lineage of the run (stored in the marker, see :func:`slot_lineages`).
        prepare: instead of ``write``: called on every rank once the slot is cleared, collects this rank's part of
            the state and returns ``write(path, group)`` that only writes it. Every rank's preparation is agreed
            (:func:`agreed_preparation`) before any rank writes, so a state that cannot be collected on one rank is
            a :class:`CheckpointWriteError` on every rank at once. A bare ``write`` that raises on one rank before
            its own collectives (DCP's planning, a barrier) leaves the other ranks waiting in them: prefer
            ``prepare`` whenever collecting the state can fail.

    Returns:
        The slot directory.

    Raises:
        CheckpointWriteError: on every rank, when any rank failed to prepare or write its part.
        TypeError: with neither or both of ``write`` and ``prepare``.
    """
    if (write is None) == (prepare is None):
        raise TypeError("save_slot takes one of write= or prepare=")
    hook = phase_hook or (lambda phase: None)
    slot = clear_slot(dirpath, hook)
    rng = rng_state()
    if prepare is not None:
        prepared = agreed_preparation(prepare, None, f"{slot}: checkpoint of step {step}")

        def write(path: Path) -> None:
            prepared(path, None)

    return write_and_mark(slot, step, write, rng, layout, signature, hook, run_id)


def agreed_preparation(prepare: Callable[[], Any], group: Any = None, what: Any = "checkpoint") -> Any:
    """``prepare()`` on this rank (collecting or staging its part of the state), then agreement with every rank of
    ``group`` that it succeeded, before any rank starts the collective write; returns what ``prepare`` returned.

    Why: a rank whose preparation fails must not go straight to the protocol's completion agreement while the others
    are inside the write's own collectives (DCP's planning gathers, Lightning's barrier) on the same group: the
    collectives would not match and every rank would block until the backend's timeout (30 minutes with gloo). Here
    the ranks meet once before writing; a failure anywhere is one :class:`CheckpointWriteError` on every rank, at
    once, naming each failing rank's error. Collective over ``group`` (one all-reduce of a flag; an object gather
    only on failure).

    Raises:
        CheckpointWriteError: on every rank, when any rank's ``prepare`` raised.
    """
    error, cause, result = "", None, None
    try:
        result = prepare()
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error, cause = f"{type(err).__name__}: {err}", err
    if all_true(not error, group):
        return result
    reports = all_gather_object((rank_world()[0], error), group)
    failed = "; ".join(f"rank {r}: {e}" for r, e in reports if e)
    raise CheckpointWriteError(
        f"{what}: not written, the state could not be prepared for writing ({failed}); nothing was written and the "
        "previous checkpoint stays the one to resume from"
    ) from cause


def clear_slot(dirpath: str | Path, hook: Callable[[str], None]) -> Path:
    """Steps 1-2 of the protocol (collective, on the default group): agree on the slot to overwrite, make it read
    as incomplete durably, empty it; returns it."""
    rank = rank_world()[0]
    dirpath = Path(dirpath)
    if rank == 0:
        dirpath.mkdir(parents=True, exist_ok=True)
    slot = choose_slot(dirpath)
    hook("begin")
    if rank == 0:
        slot.mkdir(parents=True, exist_ok=True)
        (slot / MARKER_NAME).unlink(missing_ok=True)
        fsync_dir(slot)  # the slot now reads as incomplete, durably, before any byte of it changes
        for entry in slot.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        fsync_dir(slot)
    if is_distributed():
        dist.barrier()
    hook("cleared")
    return slot


def write_and_mark(
    slot: Path,
    step: int,
    write: Callable[[Path], None],
    rng: dict[str, Any],
    layout: dict[str, Any] | None,
    signature: dict[str, list[int]] | None,
    hook: Callable[[str], None],
    run_id: str | None,
    group: Any = None,
) -> Path:
    """Steps 3-5 of the protocol into a cleared ``slot`` (collective over ``group``; the default group when None):
    every rank writes its part and ``rng`` (its RNG states at the step), fsyncs and checksums its files; the ranks
    agree; rank 0 writes the marker. An asynchronous save runs this in a background thread on a checkpoint-only
    group (:mod:`mula_lightning.checkpoint.async_slots`)."""
    rank, world = rank_world()
    sums: dict[str, dict[str, int]] = {}
    error = ""
    try:
        with recording_checksums() as written:  # a DCP write checksums its files as it writes them
            write(slot / STATE_NAME)
        torch.save(rng, slot / RNG_NAME.format(rank=rank))
        for rel in _payload_files(slot):
            if owner_rank(rel) != rank:
                continue
            with open(slot / rel, "rb") as f:
                os.fsync(f.fileno())
            digest = written.checksum(slot / rel)
            digest = file_checksum(slot / rel) if digest is None else digest
            sums[rel] = {"size": (slot / rel).stat().st_size, CHECKSUM: digest}
    except (Exception, CheckpointException) as err:  # reported to every rank below; the previous slot stays valid
        error = f"{type(err).__name__}: {err}"
    hook("written")
    ok = all_true(not error, group)
    reports = all_gather_object((rank, error, sums), group)
    if not ok:
        failed = "; ".join(f"rank {r}: {e}" for r, e, _ in reports if e)
        raise CheckpointWriteError(f"{slot}: checkpoint of step {step} not completed ({failed}); no marker written")
    hook("agreed")
    marker_error = ""
    if rank == 0:
        files = {rel: info for _, _, part in reports for rel, info in part.items()}
        marker = {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "time": time.time(),
            "world_size": world,
            "layout": layout or {},
            "files": files,
            "model": signature,
            "run_id": run_id,
        }
        try:  # written whole or not at all (atomic rename): on failure the other slot stays the newest complete one
            for sub in sorted({(slot / rel).parent for rel in files}, key=lambda p: -len(p.parts)):
                fsync_dir(sub)
            atomic_write_text(slot / MARKER_NAME, json.dumps(marker, indent=1, sort_keys=True))
        except Exception as err:
            marker_error = f"{type(err).__name__}: {err}"
    # every rank learns whether the marker exists (this is the protocol's last barrier): a rank 0 that could not write
    # it must not leave the others waiting for it until the process group's timeout
    marker_error = all_gather_object(marker_error, group)[0]
    if marker_error:
        raise CheckpointWriteError(
            f"{slot}: checkpoint of step {step} not completed (rank 0 could not write {MARKER_NAME}: {marker_error})"
        )
    _remember_valid(slot, step)
    hook("done")
    return slot


def _signature_problem(saved: dict[str, list[int]] | None, expected: dict[str, list[int]] | None) -> str:
    if saved is None or expected is None or saved == expected:
        return ""
    missing = sorted(set(expected) - set(saved))[:3]
    extra = sorted(set(saved) - set(expected))[:3]
    shapes = {k: (saved[k], expected[k]) for k in sorted(set(saved) & set(expected)) if saved[k] != expected[k]}
    return (
        f"saved by another model config: keys missing {missing}, unexpected {extra}, "
        f"shape (saved, expected) {dict(list(shapes.items())[:3])}"
    )


def check_slot(
    slot: Path, signature: dict[str, list[int]] | None = None, verify_checksums: bool = True
) -> tuple[int | None, str]:
    """This rank's view of a slot: ``(step, "")`` when complete and valid, else ``(None, problem)``.

    Checksums are split over the ranks: rank r reads the files whose sorted index is r modulo the world size.
    """
    rank, world = rank_world()
    try:
        marker = read_marker(slot)
    except ValueError as err:
        return None, str(err)
    if marker is None:
        return None, f"{slot}: no {MARKER_NAME} (never completed or being written when the job stopped)"
    problem = _signature_problem(marker.get("model"), signature)
    if problem:
        return None, f"{slot}: {problem}"
    for i, (rel, info) in enumerate(sorted(marker["files"].items())):
        path = slot / rel
        if not path.is_file():
            return None, f"{path}: listed in the marker but missing"
        size = path.stat().st_size
        if size != info["size"]:
            return None, f"{path}: {size} bytes, the marker says {info['size']} (truncated or replaced)"
        if verify_checksums and i % world == rank:
            algorithm = next((name for name in CHECKSUMS if name in info), None)
            if algorithm is None:
                return None, f"{path}: the marker holds no checksum of it (one of {sorted(CHECKSUMS)})"
            digest, recorded = file_checksum(path, algorithm), info[algorithm]
            if digest != recorded:
                return None, f"{path}: {algorithm} {digest:#x}, the marker says {recorded:#x} (corrupt)"
    return int(marker["step"]), ""


def resolve_last(
    dirpath: str | Path, signature: dict[str, list[int]] | None = None, verify_checksums: bool = True
) -> Path | None:
    """The newest slot of ``dirpath`` that every rank sees as complete and valid (collective when distributed).

    Returns:
        The slot directory (its ``state.ckpt`` is the checkpoint), or ``None`` when no slot was ever completed.

    Raises:
        CheckpointIntegrityError: when some slot has a marker but none is valid; the message names each problem.
    """
    dirpath = Path(dirpath)
    views = [check_slot(dirpath / name, signature, verify_checksums) for name in SLOT_NAMES]
    gathered = all_gather_object(views)
    best, best_step, problems, any_marker = None, -1, [], False
    for i, name in enumerate(SLOT_NAMES):
        steps = {view[i][0] for view in gathered}
        reasons = sorted({view[i][1] for view in gathered if view[i][1]})
        any_marker |= (dirpath / name / MARKER_NAME).exists()
        if None in steps or len(steps) != 1:
            problems += reasons or [f"{dirpath / name}: ranks disagree on its step ({sorted(map(str, steps))})"]
            continue
        step = steps.pop()
        if step > best_step:
            best, best_step = dirpath / name, step
    if best is None and any_marker:
        raise CheckpointIntegrityError(f"{dirpath}: no complete, valid checkpoint slot: " + " | ".join(problems))
    if best is not None:
        _remember_valid(best, best_step)
    return best


def slot_lineages(dirpath: str | Path) -> dict[str, tuple[int, str | None]]:
    """``slot name -> (step, run id)`` of every slot with a readable marker (this process only, no checksum).

    The run id is the lineage: every save of one training run (its first attempt and every resume of it) writes
    the same id, so a fresh run can tell another run's checkpoints from its own. Markers written before lineages
    existed have ``None``.
    """
    out = {}
    for name in SLOT_NAMES:
        try:
            marker = read_marker(Path(dirpath) / name)
        except ValueError:
            continue
        if marker is not None:
            out[name] = (int(marker["step"]), marker.get("run_id"))
    return out


def newest_marked_slot(dirpath: str | Path) -> Path | None:
    """The slot of ``dirpath`` whose marker names the highest step, read in this process only (no collective, no
    checksum): for reports and for Lightning's ``ckpt_path="last"`` lookup; :func:`resolve_last` decides a resume.

    Raises:
        ValueError: a damaged marker (propagated from :func:`read_marker` only when no other slot is marked).
    """
    best, best_step = None, -1
    for name in SLOT_NAMES:
        try:
            marker = read_marker(Path(dirpath) / name)
        except ValueError:
            marker = None
        if marker is not None and int(marker["step"]) > best_step:
            best, best_step = Path(dirpath) / name, int(marker["step"])
    return best


def slot_step(slot: str | Path) -> int:
    """The step recorded in a complete slot's marker."""
    marker = read_marker(Path(slot))
    if marker is None:
        raise FileNotFoundError(f"{slot}: no {MARKER_NAME}")
    return int(marker["step"])
