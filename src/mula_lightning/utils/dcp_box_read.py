"""Read only the bytes a request needs from a stored DCP chunk, not the whole chunk.

Why: torch's ``FileSystemReader`` serves every tensor request by ``torch.load``-ing the whole stored chunk it falls
in and then narrowing it. A checkpoint written by one process stores every tensor whole, so a rank that keeps one
expert of a fused ``(E, ...)`` tensor, or one ZeRO weight chunk, held the whole tensor (25 MB for one expert of the
benchmark's MoE; gigabytes per tensor at scale) to copy its part; a resharded resume (8 -> 4 ranks) reads each stored
chunk once per overlapping target. Here a stored chunk's ``torch.save`` record is opened with
``map_location="meta"``: torch then reads only the record's pickle and gives the tensor's shape, strides and the
offset of its storage inside the record (``_checkpoint_offset``), so the request's box is read as the one byte span
from its first element to its last (exactly the box when it cuts the leading dimension, as expert slices and
row-major flat ranges do) and copied into the target.

A request for a whole stored chunk (a resume in the layout that saved), and a record this cannot address (torch
gives no offset: an older torch; written in the other byte order), are loaded whole and narrowed, as torch does; an
item stored with a transform (compression) goes to torch's own reader. Every data file is opened once per load, its
items read in file order.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import sys
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

__all__ = ["DamagedCheckpointError", "read_box", "read_data_by_box"]


class DamagedCheckpointError(ValueError):
    """A stored item of a DCP data file cannot be read as saved: the file is cut short or damaged. The message
    names the file, the item and the bytes."""


class _Record(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of a seekable binary stream as a stream of their own (one stored
    item of a DCP data file: a ``torch.save`` zip archive), seekable from its start, current position or end."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self.stream, self.offset, self.length, self.position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}, before the start of the item")
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.position)]
        self.stream.seek(self.offset + self.position)
        got = self.stream.readinto(view) if len(view) else 0
        self.position += got
        return got


def _byteorder(record: Any, where: str = "") -> str:
    """The byte order a ``torch.save`` record says it was written in (``little`` when it does not say).

    The member is read from its local header, not with ``ZipFile.read``: that checks the member's CRC32, which a
    record written with torch's ``compute_crc32`` off (a slot's write, see
    :mod:`~mula_lightning.checkpoint.checksummed_writes`) leaves at zero; ``torch.load`` never checks it either.
    """
    record.seek(0)
    with zipfile.ZipFile(record) as archive:
        name = next((n for n in archive.namelist() if n.endswith("/byteorder")), None)
        if name is None:
            return "little"
        info = archive.getinfo(name)
        if info.compress_type != zipfile.ZIP_STORED:  # not written by torch.save: let zipfile decode it
            return archive.read(name).decode()
    record.seek(info.header_offset + 26)
    lengths = record.read(4)
    if len(lengths) == 4:
        name_length, extra_length = struct.unpack("<HH", lengths)
        record.seek(info.header_offset + 30 + name_length + extra_length)
        order = record.read(info.file_size)
        if order in (b"little", b"big"):
            return order.decode()
    raise DamagedCheckpointError(f"{where}: the stored item's byte order record is damaged or cut")


def _load_record(record: Any, map_location: str, where: str) -> Any:
    """``torch.load`` of a stored item (tensors as data only); a cut or damaged record raises
    :class:`DamagedCheckpointError` naming ``where`` (torch's own message does not name the file)."""
    record.seek(0)
    try:
        return torch.load(record, map_location=map_location, weights_only=True)
    except (RuntimeError, ValueError) as err:  # ValueError: an unknown byte order, a bad record
        raise DamagedCheckpointError(
            f"{where}: the stored item cannot be read (truncated or damaged file?): {err}"
        ) from None


def read_box(
    record: Any, offsets: Any, lengths: Any, where: str = "", into: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The box ``[offsets, offsets + lengths)`` of the tensor saved (``torch.save``) in the seekable ``record``,
    reading the record's pickle and the box's byte span only; None when the record cannot be addressed that way.

    With ``into`` (the request's destination), a box that is one contiguous run of the stored bytes (leading-dimension
    slices of a contiguous tensor: a row range, a whole chunk) is read straight into it when it is a contiguous CPU
    tensor of the box's shape and the stored dtype, and ``into`` is returned: no box-sized buffer and no copy.

    Raises:
        DamagedCheckpointError: the record is cut or damaged, or shorter than the span the box needs (a truncated
            file); the message starts with ``where``.
        ValueError: the box lies outside the stored tensor.
    """
    meta = _load_record(record, "meta", where)
    if not isinstance(meta, torch.Tensor):
        return None
    storage_offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if storage_offset is None or _byteorder(record, where) != sys.byteorder:
        return None
    offsets, lengths = list(offsets), list(lengths)
    if len(offsets) != meta.dim() or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, meta.shape)):
        raise ValueError(f"{where}: box offsets {offsets} lengths {lengths} outside the stored {tuple(meta.shape)}")
    strides, itemsize = meta.stride(), meta.dtype.itemsize
    if any(n == 0 for n in lengths):
        return torch.empty(lengths, dtype=meta.dtype)
    first = meta.storage_offset() + sum(o * s for o, s in zip(offsets, strides))
    span = 1 + sum((n - 1) * s for n, s in zip(lengths, strides))
    direct = into is not None and _fits(into, meta.dtype, lengths) and _contiguous_run(lengths, strides)
    buffer = into.view(-1).view(torch.uint8) if direct else torch.empty(span * itemsize, dtype=torch.uint8)
    start = storage_offset + first * itemsize
    record.seek(start)
    view, done = memoryview(buffer.numpy()), 0
    while done < len(view):
        got = record.readinto(view[done:])
        if not got:
            raise DamagedCheckpointError(
                f"{where}: truncated: the box needs bytes [{start}, {start + len(view)}) of its record, "
                f"which ends at byte {start + done}"
            )
        done += got
    return into if direct else buffer.view(meta.dtype).as_strided(lengths, strides)


def _fits(into: torch.Tensor, dtype: torch.dtype, lengths: list[int]) -> bool:
    return into.device.type == "cpu" and into.dtype == dtype and list(into.shape) == lengths and into.is_contiguous()


def _contiguous_run(lengths: list[int], strides: tuple[int, ...]) -> bool:
    """Whether a box of ``lengths`` with the stored ``strides`` is its elements in row-major order, back to back."""
    expected = 1
    for n, stride in zip(reversed(lengths), reversed(strides)):
        if n > 1 and stride != expected:
            return False
        expected *= n
    return True


def _whole_chunk(reader: Any, request: Any) -> bool:
    """Whether ``request`` asks for the whole stored chunk (a resume in the layout that saved): then the chunk is
    read whole, as torch does, with no header pass of its own."""
    metadata = getattr(reader, "load_metadata", None)
    index = request.storage_index
    try:
        sizes = metadata.state_dict_metadata[index.fqn].chunks[index.index].sizes
    except (AttributeError, KeyError, IndexError, TypeError):
        return False
    return list(request.lengths) == list(sizes) and not any(request.storage_offsets)


def _whole_then_narrow(record: Any, offsets: Any, lengths: Any, where: str) -> torch.Tensor:
    """torch's own way: the whole stored chunk, then the box of it."""
    stored = _load_record(record, "cpu", where)
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        stored = stored.narrow(dim, offset, length)
    return stored


def read_data_by_box(reader: Any, plan: Any, planner: Any, fallback: Any) -> Future:
    """``FileSystemReader.read_data`` for ``reader``, serving each tensor request by :func:`read_box` (each data
    file opened once); items stored with transforms (compression) go to ``fallback(plan, planner)``, torch's own
    method."""
    rest, per_file = [], {}
    for request in plan.items:
        stored = reader.storage_data[request.storage_index]
        if getattr(stored, "transform_descriptors", None):
            rest.append(request)
        else:
            per_file.setdefault(stored.relative_path, []).append(request)
    for relative_path, requests in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            for request in sorted(requests, key=lambda r: reader.storage_data[r.storage_index].offset):
                stored = reader.storage_data[request.storage_index]
                record = _Record(stream, stored.offset, stored.length)
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(record.read()))
                    continue
                where = f"{path} (item {request.storage_index.fqn!r} at byte {stored.offset})"
                target = planner.resolve_tensor(request).detach()
                box = None
                if not _whole_chunk(reader, request):
                    box = read_box(record, request.storage_offsets, request.lengths, where, into=target)
                if box is None:
                    box = _whole_then_narrow(record, request.storage_offsets, request.lengths, where)
                if box is not target:
                    if target.size() != box.size():
                        sizes = f"{tuple(box.size())} != its target {tuple(target.size())}"
                        raise ValueError(f"{where}: the request's box {sizes}")
                    target.copy_(box)
                planner.commit_tensor(request, target)
    if rest:
        fallback(dataclasses.replace(plan, items=rest), planner).wait()
    done: Future[None] = Future()
    done.set_result(None)
    return done
