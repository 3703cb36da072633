"""Hierarchical ZeRO group sizes: the dependency rule, the shard nesting and the groups every rank creates."""

import itertools

import pytest

from mula_lightning.parallel.zero.layout import ZeroTopoLayout, shard_positions


def _range(pos, count, n=720720):
    return pos * n // count, (pos + 1) * n // count


def _layouts():
    yield ZeroTopoLayout(8, 4, 2)  # the 2 nodes x 2 GPUs x 2 GCDs
    yield ZeroTopoLayout(16, 8, 2)  # Frontier: 2 nodes of 4 MI250X
    yield ZeroTopoLayout(4, 4, 2, grad_size=2, optimizer_size=4)
    yield ZeroTopoLayout(4, 2, 1, weight_size=1, grad_size=2)
    yield ZeroTopoLayout(8, 4, 2, secondary_size=4)
    for name in ("zero3", "hpz", "zero_topo"):
        yield ZeroTopoLayout.preset(name, 8, 4, 2)
        yield ZeroTopoLayout.preset(name, 32, 8, 2)


@pytest.mark.parametrize("layout", list(_layouts()), ids=str)
def test_optimizer_chunk_in_gradient_chunk_in_weight_chunk(layout):
    """For every rank: optimizer chunk within gradient chunk within weight chunk; in every weight / secondary /
    gradient / optimizer group the positions are a permutation (the group tiles the buffer); the gradient
    all-reduce group shares one gradient chunk; the post-step group's optimizer chunks tile the weight chunk."""
    w, g, o, s = layout.weight_size, layout.grad_size, layout.optimizer_size, layout.secondary_size
    for rank in range(layout.world_size):
        p = layout.positions(rank)
        (wl, wh), (gl, gh), (ol, oh) = _range(p.weight, w), _range(p.grad, g), _range(p.optimizer, o)
        assert wl <= gl < gh <= wh and gl <= ol < oh <= gh, (layout, rank, p)
        for ranks, attr, size in (
            (layout.weight_ranks(rank), "weight", w),
            (layout.secondary_ranks(rank), "secondary", s),
            (layout.grad_ranks(rank), "grad", g),
        ):
            assert sorted(getattr(layout.positions(r), attr) for r in ranks) == list(range(size))
        block = [r for r in range(layout.world_size) if r // o == rank // o]
        assert sorted(layout.positions(r).optimizer for r in block) == list(range(o))
        assert {layout.positions(r).grad for r in layout.grad_cross_ranks(rank)} == {p.grad}
        post = layout.post_step_ranks(rank)
        assert len(post) == o // w
        assert sorted(layout.positions(r).optimizer for r in post) == list(
            range(p.weight * o // w, (p.weight + 1) * o // w)
        )


def test_defaults_are_the_paper_design_and_presets_the_baselines():
    """Defaults: w = ranks per GPU, g = ranks per node, o = world, s = w; ZeRO-3 and hpZ presets as documented."""
    lay = ZeroTopoLayout(8, 4, 2)
    assert (lay.weight_size, lay.grad_size, lay.optimizer_size, lay.secondary_size) == (2, 4, 8, 2)
    assert lay.all_groups()["weight"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.all_groups()["grad_cross"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.all_groups()["post_step"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    z3 = ZeroTopoLayout.preset("zero3", 8, 4, 2)
    assert (z3.weight_size, z3.grad_size, z3.optimizer_size, z3.secondary_size) == (8, 8, 8, 8)
    assert z3.post_step_ranks(3) == [3]  # the optimizer chunk is the weight chunk: nothing to gather
    hpz = ZeroTopoLayout.preset("hpz", 8, 4, 2)
    assert (hpz.weight_size, hpz.secondary_size) == (8, 4)
    assert shard_positions(5, 2, 4, 8, 2).weight == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=8, ranks_per_node=3), r"ranks_per_node \(3\) must divide world_size \(8\)"),
        (dict(world_size=12, ranks_per_node=6, weight_size=2, grad_size=3), r"weight_size \(2\) \| grad_size \(3\)"),
        (dict(world_size=24, ranks_per_node=4, grad_size=8, optimizer_size=12), r"grad_size \(8\) \| optimizer_size"),
        (dict(world_size=12, ranks_per_node=4, grad_size=6, optimizer_size=12), r"grad_size \(6\) must divide"),
        (dict(world_size=8, ranks_per_node=4, secondary_size=8), r"secondary_size \(8\) must be the weight_size"),
        (dict(world_size=8, ranks_per_node=4, ranks_per_gpu=2, weight_size=-2), "must be >= 1"),
    ],
)
def test_bad_sizes_are_refused_with_their_values(kwargs, message):
    """Sizes that do not nest, do not fit the node, or a secondary degree outside {w, P} raise naming the values."""
    with pytest.raises(ValueError, match=message):
        ZeroTopoLayout(**kwargs)


def test_dependency_rule_is_checked_per_level():
    """Exhaustively over power-of-two sizes on 2 nodes x 4 ranks: a layout is accepted exactly when the paper's rule
    N >= N_os >= N_g >= N_w, P >= P_os >= P_g >= P_w holds and the sizes nest; a rule violation names N_x / P_x."""
    with pytest.raises(ValueError, match=r"dependency rule .* P_g=2, P_w=4"):
        ZeroTopoLayout(8, 4, 2, weight_size=4, grad_size=2, optimizer_size=8)
    accepted = 0
    for w, g, o in itertools.product((1, 2, 4, 8), repeat=3):
        split = [(max(x // 4, 1), min(x, 4)) for x in (w, g, o)]
        rule = 2 >= split[2][0] >= split[1][0] >= split[0][0] and 4 >= split[2][1] >= split[1][1] >= split[0][1]
        nests = g % w == 0 and o % g == 0
        try:
            ZeroTopoLayout(8, 4, 2, weight_size=w, grad_size=g, optimizer_size=o)
            ok = True
        except ValueError:
            ok = False
        assert ok == (rule and nests), (w, g, o)
        accepted += ok
    assert accepted == 20
