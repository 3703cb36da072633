"""The folded rank layout: sizes validated before any group exists, each dimension's ranks in closed form, and the
DeviceMesh groups built from it holding exactly those ranks (checked by a collective over each, 8 gloo processes)."""

import pytest
import torch
import torch.distributed as dist

from mula_lightning.parallel.mesh import DENSE_DIMS, MOE_DIMS, ParallelDims, build_parallel_mesh
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import run_pooled_test

LAYOUTS = [
    dict(ep=2),  # today's DP x EP
    dict(tp=2, ep=4),  # attention tp 2 x dp 4, MoE ep 4 x edp 2: ep borrows from dp and tp
    dict(tp=2, ep=2, etp=2),
    dict(pp=2, tp=2, ep=2),
    dict(pp=2, cp=2, ep=4),
]


def _expected_ranks(world, sizes, dims, name, rank):
    """The group of ``rank`` along ``name``, enumerated by brute force from the row-major formula."""
    strides, s = {}, 1
    for d in reversed(dims):
        strides[d] = s
        s *= sizes[d]
    coord = {d: (rank // strides[d]) % sizes[d] for d in dims}
    out = []
    for r in range(world):
        c = {d: (r // strides[d]) % sizes[d] for d in dims}
        if all(c[d] == coord[d] for d in dims if d != name):
            out.append(r)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_dimension_of_both_sides_covers_the_stage_in_closed_form(layout):
    """dp x cp x tp and edp x ep x etp each multiply to a stage's ranks; each rank's group along each dimension is
    the brute-force enumeration of the row-major layout, and the groups of one dimension partition the world."""
    dims = ParallelDims(8, **layout)
    assert dims.dp * dims.cp * dims.tp == dims.edp * dims.ep * dims.etp == dims.stage_size
    for side in (DENSE_DIMS, MOE_DIMS):
        sizes = {d: getattr(dims, d) for d in side}
        for name in side:
            seen = set()
            for rank in range(8):
                ranks = dims.ranks(name, rank)
                assert ranks == _expected_ranks(8, sizes, side, name, rank)
                assert len(ranks) == sizes[name] and dims.coordinate(name, rank) == ranks.index(rank)
                seen.add(tuple(ranks))
            assert sorted(r for g in seen for r in g) == list(range(8))


@pytest.mark.parametrize(
    "layout,fragment",
    [
        (dict(pp=3), r"pp \(3\) must divide the world size \(8\)"),
        (dict(tp=3), r"cp x tp \(1 x 3 = 3\) must divide the ranks of a pipeline stage \(8 = world size 8 / pp 1\)"),
        (dict(pp=2, ep=8), r"ep x etp \(8 x 1 = 8\) must divide the ranks of a pipeline stage \(4 = world size 8"),
        (dict(ep=2, etp=3), r"ep x etp \(2 x 3 = 6\)"),
        (dict(tp=0), r"positive integers, got tp=0"),
    ],
)
def test_sizes_that_do_not_divide_are_named(layout, fragment):
    """Each bad layout raises one ValueError naming the sizes, before any process group is touched."""
    with pytest.raises(ValueError, match=fragment):
        ParallelDims(8, **layout)


def _groups(rank, world_size, layout):
    dims = ParallelDims(world_size, **layout)
    mesh = build_parallel_mesh(dims)
    out = {}
    for name in DENSE_DIMS + MOE_DIMS:
        group = mesh.group(name)
        if group is None:
            out[name] = None
            continue
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        out[name] = (sorted(dist.get_process_group_ranks(group)), total.item(), mesh.coordinate(name))
    return out


@pytest.mark.distributed
def test_device_mesh_groups_hold_the_closed_form_ranks():
    """8 processes, every layout above: each dimension larger than 1 has a group whose ranks (and a sum of rank ids
    all-reduced over it) equal the closed form; a size-1 dimension has no group."""
    for layout in LAYOUTS:
        dims = ParallelDims(8, **layout)
        for rank, groups in enumerate(run_pooled_test(_groups, 8, layout=layout, timeout=240)):
            for name, got in groups.items():
                if getattr(dims, name) == 1:
                    assert got is None, (layout, name)
                    continue
                expected = dims.ranks(name, rank)
                assert got == (expected, float(sum(expected)), expected.index(rank)), (layout, name, rank)


def _topology(rank, world_size, ep):
    topo = build_topology(ep)
    return dist.get_process_group_ranks(topo.ep_group), dist.get_process_group_ranks(topo.dp_group)


@pytest.mark.distributed
def test_dp_x_ep_topology_is_the_moe_side_of_the_mesh():
    """build_topology's EP and DP groups are the mesh's ``ep`` and ``edp`` groups: EP consecutive ranks, DP strided."""
    for rank, (ep_ranks, dp_ranks) in enumerate(run_pooled_test(_topology, 4, ep=2)):
        assert ep_ranks == [rank // 2 * 2, rank // 2 * 2 + 1] and dp_ranks == [rank % 2, rank % 2 + 2]
