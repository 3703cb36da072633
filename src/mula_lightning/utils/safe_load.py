"""Checkpoints are data, not code: readers that build tensors and plain values and refuse everything else.

Unpickling runs whatever a file names (a ``__reduce__`` returning ``os.system`` executes a shell command), so no
file a user can pass (``mula export``, ``--ckpt_path``, DualCheckpoint slots, DCP directories) is unpickled by the
standard unpickler here:

* ``torch.load(weights_only=True)`` for torch files (``.ckpt``, RNG states): :func:`load_torch_file`;
* :func:`dumps_data` / :func:`loads_data` for the metadata blob a sharded checkpoint carries (the Trainer's loops,
  callbacks, schedulers, step): ``torch.save`` bytes read back with ``weights_only=True``; a blob of the previous
  format (``pickle.dumps``) is read by an allow-list unpickler that builds only plain values
  (:func:`restricted_loads`), and one that needs anything else is refused with the command that converts it once;
* :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` for ``torch.distributed.checkpoint``: torch's own reader
  unpickles the ``.metadata`` file and every non-tensor item with the standard unpickler; these build only DCP's
  metadata classes, torch sizes, dtypes and layouts, and plain values.

A refused file raises :class:`UnsafeCheckpointError`, whose message names the file and the type it refused; the
``mula`` commands print it as one line and exit with a non-zero code. Nothing in the file runs, nothing is written.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from mula_lightning.utils.dcp_box_read import DamagedCheckpointError, read_data_by_box
from mula_lightning.utils.plain_data import check_plain_data, to_plain_data

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "dcp_load",
    "dumps_data",
    "load_full_dcp",
    "load_torch_file",
    "loads_data",
    "pickle_globals",
    "restricted_loads",
]

CONVERT_HINT = "if you trust the file, convert it once with `mula checkpoint convert --trust OLD NEW`"

# Globals a plain-data pickle may name: containers and scalars, and torch's dtype / size / layout / device values.
_PLAIN = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytearray"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}
# The classes of a DCP ``.metadata`` file (dataclasses and enums of torch.distributed.checkpoint).
_DCP_METADATA = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain data; it was refused, not run.

    Attributes:
        path: the file.
        refused: the refused type, as ``module.name``.
    """

    def __init__(self, path: str | Path, refused: str, hint: str = "") -> None:
        self.path, self.refused = str(path), refused
        super().__init__(
            f"{path}: refused to load {refused!r}: a checkpoint may hold tensors and plain data only"
            + (f"; {hint}" if hint else "")
        )


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, allowed: set[tuple[str, str]], source: str, hint: str) -> None:
        super().__init__(file)
        self.allowed, self.source, self.hint = allowed, source, hint

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.source, f"{module}.{name}", self.hint)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self.source, f"persistent id {type(pid).__name__}", self.hint)


def restricted_loads(data: bytes, source: str | Path, extra: set[tuple[str, str]] | None = None, hint: str = "") -> Any:
    """Unpickle ``data`` building only plain values (and the ``extra`` allowed classes); refuse anything else.

    Args:
        data: the pickle stream.
        source: the file it came from, for the error message.
        extra: more ``(module, name)`` globals to allow (e.g. DCP's metadata classes).
        hint: what to do when refused, appended to the message.

    Raises:
        UnsafeCheckpointError: naming ``source`` and the first refused global.
    """
    allowed = _PLAIN | (extra or set())
    try:
        return _AllowListUnpickler(io.BytesIO(data), allowed, str(source), hint).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or corrupt stream
        raise ValueError(f"{source}: unreadable ({type(err).__name__}: {err})") from err


def pickle_globals(data: bytes) -> list[str]:
    """Every global (``module.name``) a pickle stream names, read with ``pickletools`` without running anything.

    For ``mula checkpoint convert --trust``: the user is shown exactly what the file would import and call, and the
    allow-list unpickler is then given exactly that list.
    """
    import pickletools

    found: list[str] = []
    strings: list[Any] = []  # values pushed by string opcodes (STACK_GLOBAL takes the last two)
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, name = str(arg).split(" ", 1)
            found.append(f"{module}.{name}")
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(int(arg)))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.append(f"{strings[-2]}.{strings[-1]}")
    return sorted(set(found))


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _refused_from(err: Exception) -> str:
    """The global torch's weights-only unpickler refused, from its message (it does not expose it otherwise)."""
    text = str(err)
    match = _GLOBAL_RE.search(text)
    if match:
        return match.group(1)
    match = re.search(r"Unsupported operand (\d+)", text)
    return f"pickle operand {match.group(1)}" if match else text.strip().splitlines()[0][:200]


def load_torch_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain data; anything else raises a named error.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        UnsafeCheckpointError: when the file names a type other than tensors and plain data.
        ValueError: when it is not a torch file at all (a text file, a truncated file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # a bare pickle (or torch's pre-1.6 format): only the allow-list unpickler may read it
        return restricted_loads(path.read_bytes(), path)
    if head != b"PK":
        raise ValueError(f"{path}: not a torch checkpoint (neither torch.save's zip format nor a pickle)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "weights_only" in str(err) or "GLOBAL" in str(err) or "Unsupported" in str(err):
            raise UnsafeCheckpointError(path, _refused_from(err)) from None
        raise ValueError(f"{path}: not a readable torch checkpoint ({err})") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: {err})") from None


def dumps_data(obj: Any, source: str | Path = "") -> bytes:
    """``obj`` (tensors and plain data) as ``torch.save`` bytes, readable by :func:`loads_data` without code.

    ``obj`` is normalised first (:func:`~mula_lightning.utils.plain_data.to_plain_data`: configs as dicts, paths as
    str, NumPy scalars as numbers, enums by value) and the bytes are read back with ``weights_only=True`` before they
    are returned, so a value the reader would refuse fails here, at the save, naming its key.

    Raises:
        UnloadableCheckpointValue: naming the first entry the safe reader refuses.
    """
    obj = to_plain_data(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - find and name the entry
        check_plain_data(obj, str(source))
        raise
    return data


def loads_data(data: bytes, source: str | Path) -> Any:
    """Read :func:`dumps_data` bytes with ``weights_only=True``; a legacy ``pickle.dumps`` blob with plain values only.

    Raises:
        UnsafeCheckpointError: naming ``source`` and the refused type (with the conversion command for a legacy blob
            that holds more than plain values).
    """
    if data[:2] == b"PK":  # torch.save's zip format
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(source, _refused_from(err)) from None
    return restricted_loads(data, source, hint=f"it was written by an earlier mula_lightning; {CONVERT_HINT}")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by the allow-list unpickler (DCP's classes, torch sizes and
    dtypes, plain values) instead of ``pickle.load``, and whose tensor requests read only their box's bytes of a
    stored chunk (:mod:`~mula_lightning.utils.dcp_box_read`), not the whole chunk."""

    def set_up_storage_reader(self, metadata: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)
        self.load_metadata = metadata  # the stored chunks' sizes: a request for a whole chunk is read as torch does

    def read_data(self, plan: Any, planner: Any) -> Any:
        return read_data_by_box(self, plan, planner, fallback=super().read_data)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path}: not a torch.distributed.checkpoint directory (no {path})") from None
        metadata = restricted_loads(data, path, extra=_DCP_METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items are read with ``weights_only=True`` (torch's own planner reads
    them with the standard unpickler); a legacy ``pickle.dumps`` blob inside goes through :func:`loads_data` later."""

    def __init__(self, *args: Any, source: str | Path = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = str(source)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{self.source} (item {fqn!r})", _refused_from(err)) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def dcp_load(
    targets: dict[str, Any], path: str | Path, strict: bool = True, no_dist: bool = False, reader: Any = None
) -> None:
    """``torch.distributed.checkpoint.load`` of ``targets`` from ``path`` with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`; a refused item raises :class:`UnsafeCheckpointError` itself, a cut or damaged data
    file :class:`~mula_lightning.utils.dcp_box_read.DamagedCheckpointError` (DCP wraps the errors of its ranks in a
    ``CheckpointException``).

    Args:
        targets: the state dict to fill in place (non-tensor entries are replaced by what was stored).
        path: the DCP directory.
        strict: every target must be in the checkpoint (``False``: load what is there).
        no_dist: load in this process only, even when a process group exists.
        reader: a :class:`SafeFileSystemReader` of ``path`` to use (one that keeps the metadata it read, for many
            small loads from one checkpoint); default: a new one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    planner = SafeLoadPlanner(allow_partial_load=not strict, source=path)
    try:
        with warnings.catch_warnings():  # torch warns on every single-process load, the ones asked for too
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(targets, storage_reader=reader or SafeFileSystemReader(str(path)), planner=planner,
                     no_dist=no_dist)  # fmt: skip
    except CheckpointException as err:
        for failure in err.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, (UnsafeCheckpointError, DamagedCheckpointError)):
                raise exc from None
        raise


def load_full_dcp(path: str | Path, skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """Every tensor of a DCP directory, full (DCP reassembles the shards), under its flattened key, and the
    ``metadata`` entry read as data (``None`` when there is none). In this process only; for export and conversion.

    Args:
        path: the DCP directory.
        skip: key prefixes not to read (e.g. ``("optimizer",)`` to leave the optimizer states on disk).

    Returns:
        ``(tensors, metadata)``; ``metadata`` is the raw stored entry (bytes for mula_lightning checkpoints).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    targets: dict[str, Any] = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in items.items()
        if isinstance(md, TensorStorageMetadata) and not k.startswith(skip)
    }
    if "metadata" in items:
        targets["metadata"] = b""
    dcp_load(targets, path, strict=False, no_dist=True)
    raw = targets.pop("metadata", None)
    return {k: v for k, v in targets.items() if isinstance(v, torch.Tensor)}, raw
