"""Checkpoint a tensor of which this rank holds arbitrary rectangular pieces, without ever building it whole.

Why: the sharded optimizers and the ZeRO engine own *flat ranges* of their flat buffers, and such a range cuts a
2-D weight (or a 1-D optimizer vector) anywhere. ``DTensor`` describes one even chunk per rank, ``ShardedTensor``
(deprecated, built through a private constructor) wanted the whole job's shard table on every rank. DCP itself only
needs, per object, the list of local chunks (global offsets and sizes), the chunk for a given write/read index, and
the global shape: the ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` protocol that
``DTensor`` implements (present in every torch this project supports). :class:`TensorPieces` implements exactly that
over views of memory the rank already holds, so:

* saving writes each piece straight from the owner's shard (no gather, no full-size copy);
* loading reads each piece straight into the owner's shard (DCP reshards: it reads the overlap of every saved chunk
  with every local piece, whatever layout wrote it);
* the on-disk format is DCP's own (chunks of a logical tensor), the same as ``ShardedTensor`` and ``DTensor`` wrote,
  so checkpoints from before this class load unchanged, and any layout or one process can load these.

:func:`flat_range_boxes` cuts a flat (row-major) range of a tensor into the few boxes DCP can store: leading rows
partial, whole rows, trailing rows partial (at most ``2 * ndim - 1`` boxes), each contiguous in the flat memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["TensorPieces", "flat_range_boxes", "flat_range_pieces", "flat_runs", "map_held"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``, in order.

    Returns ``(flat offset of the box's first element, (offsets, sizes))`` for each box; a box's elements are
    contiguous in the flat tensor, so ``flat[off : off + prod(sizes)].view(sizes)`` is the box.
    """
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape} ({total} elements)")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [(start, ((start,), (stop - start,)))] if shape else [(0, ((), ()))]
    inner = math.prod(shape[1:])
    first, last = start // inner, stop // inner  # rows; ``last`` is partial when stop % inner
    boxes: list[tuple[int, Box]] = []

    def row_part(row: int, lo: int, hi: int) -> None:  # a part of one row: recurse into its dimensions
        for off, (offsets, sizes) in flat_range_boxes(shape[1:], lo, hi):
            boxes.append((row * inner + off, ((row, *offsets), (1, *sizes))))

    if first == last:  # inside one row
        row_part(first, start - first * inner, stop - first * inner)
        return boxes
    if start % inner:
        row_part(first, start % inner, inner)
        first += 1
    if last > first:
        boxes.append((first * inner, ((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]))))
    if stop % inner:
        row_part(last, 0, stop % inner)
    return boxes


def flat_range_pieces(
    flat: torch.Tensor, shape: Sequence[int], start: int, stop: int
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Views of ``flat`` (which holds elements ``[start, stop)`` of a tensor of ``shape``, in order) as
    ``(global offsets, piece)`` boxes, for :class:`TensorPieces`."""
    if flat.numel() != stop - start:
        raise ValueError(f"{flat.numel()} elements given for the range [{start}, {stop})")
    return [(offsets, flat[off - start : off - start + math.prod(sizes)].view(sizes)) for off, (offsets, sizes) in
            flat_range_boxes(shape, start, stop)]  # fmt: skip


class TensorPieces(torch.Tensor):
    """A logical tensor of ``shape`` of which this rank holds ``pieces`` (``(global offsets, tensor)``), for DCP.

    Only ``torch.distributed.checkpoint`` uses it (see the module docstring): DCP writes every piece (replicas of the
    same piece on other ranks are deduplicated by its planner) and, on load, copies the saved data overlapping each
    piece into it in place. Any other operation raises: it is not a tensor to compute with.

    Args:
        shape: the logical (single-device) shape.
        pieces: disjoint boxes of it held here; may be empty (a rank that holds nothing of this tensor).
        dtype, device: of the pieces (needed when there are none).
    """

    _pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        pieces: list[tuple[tuple[int, ...], torch.Tensor]],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> TensorPieces:
        dtype = pieces[0][1].dtype if pieces else dtype
        device = pieces[0][1].device if pieces else device
        if dtype is None or device is None:
            raise ValueError("TensorPieces without pieces needs its dtype and device")
        shape = torch.Size(shape)
        for offsets, piece in pieces:
            if len(offsets) != len(shape) or piece.dim() != len(shape):
                raise ValueError(
                    f"a piece of {tuple(piece.shape)} at {offsets} does not fit a tensor of {tuple(shape)}"
                )
            if any(o < 0 or o + s > d for o, s, d in zip(offsets, piece.shape, shape)):
                raise ValueError(f"a piece of {tuple(piece.shape)} at {offsets} lies outside {tuple(shape)}")
            if piece.dtype != dtype or piece.device != torch.device(device):
                raise ValueError(f"pieces must share one dtype and device ({dtype}, {device}); got {piece.dtype}")
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        self._pieces = [(tuple(int(o) for o in offsets), piece) for offsets, piece in pieces]
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        raise TypeError(
            f"TensorPieces only carries this rank's pieces of a tensor to torch.distributed.checkpoint; {func} is "
            "not supported on it"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"TensorPieces(shape={tuple(self.shape)}, pieces={[(o, tuple(p.shape)) for o, p in self._pieces]})"

    @property
    def pieces(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(global offsets, tensor)`` of every piece held here (views: writing into them writes the owner's)."""
        return list(self._pieces)

    # ---- the DCP protocol (torch.distributed.checkpoint.planner_helpers / utils look these up by name)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = (
            TensorProperties.create_from_tensor(self._pieces[0][1])
            if self._pieces
            else TensorProperties(dtype=self.dtype)
        )
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for i, (offsets, piece) in enumerate(self._pieces)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=p.shape) for o, p in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._pieces):
            offsets, piece = self._pieces[index.index]
            if torch.Size(offsets) == index.offset:
                return piece
        for offsets, piece in self._pieces:
            if torch.Size(offsets) == index.offset:
                return piece
        raise ValueError(f"{index.fqn}: no piece at {index.offset} on this rank (pieces at {self._pieces_at()})")

    def _pieces_at(self) -> list[tuple[int, ...]]:
        return [o for o, _ in self._pieces]

    def reshaped(self, shape: Sequence[int]) -> TensorPieces:
        """The same held memory as pieces of a logical tensor of another ``shape`` with as many elements (row-major
        order kept): for reading a checkpoint that stored this tensor in another shape (a flat vector) in place.

        Raises:
            ValueError: when ``shape`` has another number of elements.
        """
        shape = torch.Size(shape)
        if shape.numel() != self.shape.numel():
            raise ValueError(f"cannot view a tensor of {tuple(self.shape)} as {tuple(shape)}")
        pieces = []
        for start, run in flat_runs(self.shape, self._pieces):
            pieces.extend(flat_range_pieces(run, shape, start, start + run.numel()))
        return TensorPieces(shape, pieces, dtype=self.dtype, device=self.device)


def flat_runs(
    shape: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]]
) -> list[tuple[int, torch.Tensor]]:
    """Each box of a row-major tensor of ``shape`` as its maximal flat-contiguous runs: ``(flat offset, 1-D view)``.

    A box covers whole trailing dimensions from some dimension on; every index of the dimensions before that one is
    one run (one run in all for a slice along the first dimension).
    """
    shape = tuple(int(d) for d in shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs = []
    for offsets, piece in pieces:
        if not piece.is_contiguous():  # a copy would not be the owner's memory
            raise ValueError(f"a piece of {tuple(piece.shape)} at {offsets} is not contiguous: it has no flat runs")
        k = len(shape)  # dims [k, ndim) of the box are whole
        while k > 0 and piece.shape[k - 1] == shape[k - 1]:
            k -= 1
        outer = max(k - 1, 0)  # dims [0, outer) index the runs; dim outer (partial) and what follows are one run
        for index in itertools.product(*(range(piece.shape[d]) for d in range(outer))):
            start = sum((offsets[d] + index[d]) * strides[d] for d in range(outer))
            start += offsets[outer] * strides[outer] if shape else 0
            runs.append((start, piece[index].reshape(-1)))
    return runs


def map_held(value: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` applied to what this rank holds of a logical tensor, keeping where it sits: each piece of a
    :class:`TensorPieces`, a DTensor's local shard (as the piece at its offsets in the logical tensor), a plain tensor
    whole. For copies of a rank's checkpoint state (staging to host memory, casting) that DCP writes as before."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from mula_lightning.parallel.params import dtensor_local_box

        held = [(dtensor_local_box(value)[1], value.to_local())]
    elif isinstance(value, TensorPieces):
        held = value.pieces
    else:
        return fn(value)
    pieces = [(offsets, fn(piece)) for offsets, piece in held]
    probe = fn(torch.empty(0, dtype=value.dtype, device=value.device)) if not pieces else pieces[0][1]
    return TensorPieces(value.shape, pieces, dtype=probe.dtype, device=probe.device)
