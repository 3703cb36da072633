"""The one on-disk format of sharded checkpoints: a DCP directory of logical-key tensors plus a metadata item.

Both sharded strategies (``epso`` and ``zero_topo``) write it, so ``mula export``, the dual-slot protocol and a
resume at another layout read one format:

* tensors: whatever state dicts the caller built with logical keys (model ``state_dict`` keys; optimizer states as
  ``state.<param>.<exp_avg | exp_avg_sq | master>`` shaped like the parameter), saved by
  ``torch.distributed.checkpoint``, which reshards on load (a checkpoint written at DP=2 x EP=2 x TP=2 loads at
  DP=1 x EP=4 or in one process); a tensor saved in another shape with as many elements (optimizer states were 1-D
  vectors before tensor parallelism) is read in the shape it was saved in, into the same memory;
* ``metadata``: one bytes item holding tensors and plain data (loops, callbacks, schedulers, the step, the config),
  written by :func:`~mula_lightning.utils.safe_load.dumps_data` and read back with ``weights_only`` semantics.

Reading never unpickles code: DCP's own ``.metadata`` file goes through
:class:`~mula_lightning.utils.safe_load.SafeFileSystemReader` and every item through the safe load planner; a file
that names anything else raises :class:`~mula_lightning.utils.safe_load.UnsafeCheckpointError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from mula_lightning.checkpoint.checksummed_writes import ChecksummingWriter, active_recorder, zip_crc32_skipped
from mula_lightning.checkpoint.direct_writes import DirectWriter
from mula_lightning.parallel.tensor_pieces import TensorPieces
from mula_lightning.utils.safe_load import SafeFileSystemReader, dcp_load, dumps_data, loads_data

__all__ = ["METADATA_KEY", "NoCopySavePlanner", "as_saved_shape", "load_dcp", "save_dcp", "saved_keys"]

#: the DCP item that holds the non-tensor state
METADATA_KEY = "metadata"


def standalone_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as the contiguous CPU ``tensor`` whose storage is exactly its bytes.

    DCP's file writer copies every tensor whose storage is larger than the tensor (a view of a flat buffer: each
    sharded parameter, optimizer range or ZeRO chunk) and, in torch 2.14, keeps each copy until the rank's file is
    closed: a save then holds a second copy of everything the rank writes. NumPy can describe just the view's bytes,
    and ``torch.from_numpy`` builds a tensor whose storage is that buffer (keeping the original alive): nothing copied.
    Other tensors (non-contiguous, not on the CPU, dtypes NumPy lacks and that cannot be viewed as an integer of the
    same width) are returned as they are.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return torch.from_numpy(tensor.view(torch.int16).numpy()).view(tensor.dtype)
    try:
        return torch.from_numpy(tensor.numpy())
    except (TypeError, RuntimeError):
        return tensor


class NoCopySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, handing the writer :func:`standalone_alias` es of views (no copy held per rank)."""

    def resolve_data(self, write_item):  # noqa: ANN001, ANN201 - DCP's signature
        data = super().resolve_data(write_item)
        return standalone_alias(data.detach()) if isinstance(data, torch.Tensor) else data


def save_dcp(
    path: Path, tensors: dict[str, Any], metadata: dict[str, Any], planner: Any = None, process_group: Any = None
) -> None:
    """Write ``tensors`` (logical-key state dicts) and ``metadata`` (tensors and plain data) as a DCP directory.

    Args:
        path: the directory (created if needed).
        tensors: top-level key -> state dict (or tensor); must not use the key ``"metadata"``.
        metadata: the non-tensor state.
        planner: a DCP save planner (the DP-scattered one spreads replicated writes over nodes); a
            :class:`NoCopySavePlanner` when None.
        process_group: the group DCP's planning collectives run on (default: the default group; an asynchronous
            save passes its checkpoint-only group).

    Inside :func:`~mula_lightning.checkpoint.checksummed_writes.recording_checksums` (a dual-slot save), each file's
    size and checksum are recorded as it is written and ``torch.save``'s zip CRC32s are skipped. Files are written
    with ``O_DIRECT`` where the file system allows (:mod:`~mula_lightning.checkpoint.direct_writes`).
    """
    if METADATA_KEY in tensors:
        raise ValueError(f"{METADATA_KEY!r} is reserved for the checkpoint's metadata; rename that state entry")
    path.mkdir(parents=True, exist_ok=True)
    planner = NoCopySavePlanner() if planner is None else planner
    state = {**tensors, METADATA_KEY: dumps_data(metadata, path)}
    recorder = active_recorder()
    if recorder is None:
        dcp.save(state, storage_writer=DirectWriter(path), planner=planner, process_group=process_group)
        return
    # a slot's write: every file's checksum computed on its way to the file, the zip records' own skipped
    with zip_crc32_skipped():
        writer = ChecksummingWriter(path, recorder)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)


def saved_keys(path: Path) -> set[str]:
    """The top-level keys a DCP directory holds (``metadata`` included).

    Raises:
        FileNotFoundError: when ``path`` is not a ``torch.distributed.checkpoint`` directory.
    """
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata file)")
    return {k.split(".")[0] for k in SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata}


def load_dcp(path: Path, targets: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Fill ``targets`` (state dicts shaped like the saved ones, at this run's layout) in place; return the metadata.

    Args:
        path: a :func:`save_dcp` directory.
        targets: top-level key -> state dict to fill; keys the checkpoint lacks are dropped from ``targets`` when
            ``strict`` is False.
        strict: a key of ``targets`` missing from the checkpoint (or a tensor missing inside a state dict) raises.

    Raises:
        FileNotFoundError: ``path`` is not a DCP directory.
        KeyError: with ``strict``, naming the missing keys and those the checkpoint holds.
    """
    saved = saved_keys(path)
    missing = [k for k in targets if k not in saved]
    if missing and strict:
        raise KeyError(f"{path}: the checkpoint has no {missing} (it holds {sorted(saved)})")
    for key in missing:
        del targets[key]
    saved_sizes = {
        fqn: tuple(item.size)
        for fqn, item in SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
        if hasattr(item, "size")
    }
    if strict:
        check_tensors_fit(path, targets, saved_sizes)
    for key, value in targets.items():
        if isinstance(value, dict):
            targets[key] = {k: as_saved_shape(v, saved_sizes.get(f"{key}.{k}")) for k, v in value.items()}
    targets[METADATA_KEY] = b""
    dcp_load(targets, path, strict, no_dist=not (dist.is_available() and dist.is_initialized()))  # one process
    return loads_data(targets.pop(METADATA_KEY), path)


def check_tensors_fit(path: Path, targets: dict[str, Any], saved_sizes: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming the tensors of ``targets`` the checkpoint lacks, and those saved with another number
    of elements, before DCP reads anything: a checkpoint of another model config (layers, experts, widths, vocabulary)
    is named as such instead of by DCP's first missing key.
    """
    absent, differ = [], []
    for key, value in targets.items():
        if not isinstance(value, dict):
            continue
        for name, tensor in value.items():
            if not isinstance(tensor, torch.Tensor):  # plain values (steps, hyper-parameters) are checked by DCP
                continue
            fqn, shape = f"{key}.{name}", tuple(tensor.shape)  # a DTensor's / TensorPieces' logical shape
            if fqn not in saved_sizes:
                absent.append(fqn)
            elif torch.Size(saved_sizes[fqn]).numel() != torch.Size(shape).numel():
                differ.append(f"{fqn} {saved_sizes[fqn]} saved, {shape} here")
    if absent or differ:
        parts = []
        if absent:
            named = ", ".join(absent[:4]) + (", ..." if len(absent) > 4 else "")
            parts.append(f"{len(absent)} tensors of this run are not in it ({named})")
        if differ:
            parts.append(f"{len(differ)} have other shapes ({'; '.join(differ[:4])}{'; ...' * (len(differ) > 4)})")
        raise ValueError(
            f"{path} was written for another model: {' and '.join(parts)}; compare the model config (layers, experts, "
            "widths, vocabulary) with the one that wrote it"
        )


def as_saved_shape(value: Any, saved: tuple[int, ...] | None) -> Any:
    """``value`` (a target tensor of a load) seen in the shape ``saved`` it was saved in, over the same memory, when
    that shape differs and has as many elements (a 1-D optimizer state of older checkpoints); otherwise itself.
    DCP then checks everything else (a different number of elements still fails, naming the tensor)."""
    if saved is None or not isinstance(value, torch.Tensor) or tuple(value.shape) == saved:
        return value
    if torch.Size(saved).numel() != value.numel():
        return value
    if isinstance(value, TensorPieces):
        return value.reshaped(saved)
    if type(value) is torch.Tensor and value.is_contiguous():
        return value.view(saved)
    return value
