"""TensorPieces: flat ranges cut into DCP boxes exactly, and DCP saves and loads arbitrary pieces across processes.

The reference is the obvious one: a tensor of distinct values; boxes must name exactly the elements of the range
in order, and what a layout of pieces saves must read back, in one process or into another layout of pieces, as
the full tensor.
"""

import math
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mula_lightning.parallel.tensor_pieces import TensorPieces, flat_range_boxes, flat_range_pieces
from mula_lightning.testing import run_pooled_test

SHAPES = {"w": (5, 7), "e": (3, 4, 6), "v": (29,), "s": ()}


def _full(name: str) -> torch.Tensor:
    shape = SHAPES[name]
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + 1000 * len(name)


def test_boxes_cover_exactly_the_range_in_order():
    """For random shapes of 1 to 4 dimensions and random ranges, the boxes are contiguous flat runs whose union is
    the range, in order, and each box's coordinates name the elements at those flat offsets."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        total = math.prod(shape)
        start = rng.randint(0, total)
        stop = rng.randint(start, total)
        index = torch.arange(total).reshape(shape)
        covered = []
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1
        for off, (offsets, sizes) in boxes:
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert box.flatten().tolist() == list(range(off, off + box.numel()))
            covered += box.flatten().tolist()
        assert covered == list(range(start, stop)), (shape, start, stop)


def test_bad_ranges_and_pieces_are_refused():
    """A range outside the tensor, a piece of the wrong rank or position, and arithmetic on the wrapper raise."""
    with pytest.raises(ValueError, match=r"outside a tensor of shape \(2, 3\)"):
        flat_range_boxes((2, 3), 4, 7)
    with pytest.raises(ValueError, match="lies outside"):
        TensorPieces((2, 3), [((1, 2), torch.zeros(1, 2))])
    with pytest.raises(ValueError, match="does not fit"):
        TensorPieces((2, 3), [((0,), torch.zeros(3))])
    with pytest.raises(TypeError, match="only carries this rank's pieces"):
        TensorPieces((2, 3), flat_range_pieces(torch.zeros(6), (2, 3), 0, 6)).sum()


def _pieces_state(name_ranges: dict[str, list[tuple[int, int]]], fill: bool) -> dict[str, TensorPieces]:
    out = {}
    for name, ranges in name_ranges.items():
        flat = _full(name).flatten()
        held = []
        for lo, hi in ranges:
            values = flat[lo:hi].clone() if fill else torch.full((hi - lo,), float("nan"), dtype=torch.float64)
            held += flat_range_pieces(values, SHAPES[name], lo, hi)
        out[name] = TensorPieces(SHAPES[name], held, dtype=torch.float64, device="cpu")
    return out


def _cuts(total: int, parts: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, total), min(parts - 1, total - 1))) if total > 1 else []
    edges = [0, *points, total]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def _layout(rank: int, world_size: int, seed: int) -> dict[str, list[tuple[int, int]]]:
    """Random flat ranges per rank: rank r takes ranges r, r + world, ...; rank 0 also holds a replica of rank 1's
    first range (written once by DCP's deduplication)."""
    out = {}
    for i, name in enumerate(SHAPES):
        cuts = _cuts(math.prod(SHAPES[name]), 2 * world_size + 1, seed + i)
        mine = cuts[rank::world_size]
        if rank == 0 and world_size > 1 and len(cuts) > 1:
            mine = mine + [cuts[1]]
        out[name] = mine
    return out


def _save_then_load_other_layout(rank, world_size, path):
    dcp.save(_pieces_state(_layout(rank, world_size, 0), fill=True), checkpoint_id=path)
    target = _pieces_state(_layout(rank, world_size, 99), fill=False)
    dcp.load(target, checkpoint_id=path)
    return {n: [(o, p.clone()) for o, p in t.pieces] for n, t in target.items()}


@pytest.mark.distributed
def test_pieces_save_and_load_across_layouts_and_into_one_process(tmp_path):
    """3 processes write random flat ranges of a 2-D, a 3-D, a 1-D and a 0-D tensor (one range replicated); they read
    them back into another random layout, and one process reads the full tensors: every element is the saved one."""
    path = str(tmp_path / "ckpt")
    for rank, state in enumerate(run_pooled_test(_save_then_load_other_layout, 3, path=path)):
        for name, pieces in state.items():
            full = _full(name)
            for offsets, piece in pieces:
                expected = full[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))]
                assert torch.equal(piece, expected), (rank, name, offsets)
    plain = {name: torch.zeros(SHAPES[name], dtype=torch.float64) for name in SHAPES}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for name, tensor in plain.items():
        assert torch.equal(tensor, _full(name)), name
