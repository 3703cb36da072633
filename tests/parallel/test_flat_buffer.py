"""FlatBuffer on one process: deferred initial values written range by range equal the eagerly written buffer, and
the owned elements gathered into a preallocated tensor equal the concatenated gather."""

import pytest
import torch
from torch import nn

from mula_lightning.models import MulaConfig
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.parallelize import ParameterInitializer

CONFIG = MulaConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=8)


def _params(real_values):
    """Three meta parameters and one real one (its values given), in one param group and a second."""
    shapes = {"a.weight": (13, 7), "b.norm.weight": (7,), "c.weight": (40, 9)}
    with torch.device("meta"):
        meta = {n: nn.Parameter(torch.empty(s)) for n, s in shapes.items()}
    real = nn.Parameter(real_values.clone())
    items = [("a.weight", meta["a.weight"], 0), ("real", real, 0), ("b.norm.weight", meta["b.norm.weight"], 1)]
    items.append(("c.weight", meta["c.weight"], 1))
    table = {id(p): (CONFIG, n) for n, p in meta.items()}
    return items, table


class _PerParameter:
    """An initializer with ``fill_`` alone (as ``WeightsInitializer``): asked one parameter at a time, in order."""

    def __init__(self, init):
        self.init, self.asked = init, []

    def fill_(self, param, out, start):
        self.asked.append(id(param))
        return self.init.fill_(param, out, start)


@pytest.mark.parametrize("kind", ["ranged", "per parameter", "plain callable"])
def test_deferred_initial_values_equal_the_eager_buffer_in_any_range(kind, monkeypatch):
    """A buffer built with ``defer_initial_values`` writes nothing at construction; ``fill_initial`` of random ranges
    (buckets, padding, a real parameter's slot included; initializer blocks of 16 elements, so ranges cut blocks)
    equals the same elements of a buffer whose initial values were written at construction, padding zero; an
    initializer with ``fill_`` alone is asked for every parameter in layout order; with a plain callable (no
    ``fill_``) the full value is sliced."""
    from mula_lightning.models import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_NUMEL", 16)
    real_values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    items, table = _params(real_values)
    init = ParameterInitializer(table, seed=4)
    eager = FlatBuffer(items, 4, 1, bucket_numel=100, align=3, device="cpu", initial_value=init)
    items, table = _params(real_values)
    init = ParameterInitializer(table, seed=4)
    asked = {"ranged": init, "per parameter": _PerParameter(init), "plain callable": lambda p: init(p)}[kind]
    lazy = FlatBuffer(items, 4, 1, bucket_numel=100, align=3, device="cpu", initial_value=asked,
                      defer_initial_values=True)  # fmt: skip
    assert lazy.numel == eager.numel > sum(p.numel() for _, p, _ in items)  # padding exists
    g = torch.Generator().manual_seed(1)
    ranges = [(0, lazy.numel), (lazy.numel, lazy.numel)]
    ranges += [tuple(sorted(torch.randint(0, lazy.numel + 1, (2,), generator=g).tolist())) for _ in range(10)]
    for start, stop in ranges:
        out = torch.full((stop - start,), float("nan"))
        lazy.fill_initial(out, start)
        assert torch.equal(out, eager.params[start:stop]), (start, stop)
        if kind == "per parameter":
            assert asked.asked == [id(p) for p, _ in zip(lazy.initial_sources, lazy.slots) if p is not None]
            asked.asked.clear()
    assert all(not p.is_meta for p in (s.param for s in lazy.slots))
    with pytest.raises(RuntimeError, match="defer_initial_values=True"):
        eager.fill_initial(torch.empty(3), 0)


def test_a_chunk_draws_every_staged_block_before_any_direct_one(monkeypatch):
    """``ParameterInitializer.fill_many_`` (what a flat buffer's chunk asks for) writes every request's staged blocks
    (those needing a block-sized temporary) before any request's direct ones: into fresh memory the temporaries then
    come and go before the chunk's pages become resident, so a rank's setup peaks at what it keeps."""
    from mula_lightning.parallel import parallelize

    calls = []
    real = parallelize.fill_initial_
    monkeypatch.setattr(parallelize, "fill_initial_", lambda *a, **k: calls.append(k["blocks"]) or real(*a, **k))
    items, table = _params(torch.zeros(5, 3))
    buf = FlatBuffer(items, 1, 0, device="cpu", initial_value=ParameterInitializer(table, seed=4),
                     defer_initial_values=True)  # fmt: skip
    buf.fill_initial(torch.empty(buf.numel), 0)
    assert calls == ["staged"] * 3 + ["direct"] * 3


def test_owned_elements_gathered_into_a_tensor_equal_the_concatenation():
    """``gather_owned_into`` (several buckets, cast to float64 on the way) equals ``gather_owned``."""
    params = [(f"p{i}", nn.Parameter(torch.randn(11, i + 2)), 0) for i in range(5)]
    buf = FlatBuffer(params, 3, 2, bucket_numel=30)
    assert len(buf.buckets) > 1
    out = torch.empty(buf.owned_numel, dtype=torch.float64)
    assert torch.equal(buf.gather_owned_into(buf.params, out), buf.gather_owned(buf.params).double())


@pytest.mark.parametrize("shards,index", [(1, 0), (3, 0), (3, 2), (4, 1)])
def test_owned_places_are_the_owned_elements_where_they_live(shards, index):
    """``owned_places`` cuts the owned runs (two param groups, several buckets) at the owned ranges' seams: in order
    they cover the owned elements exactly once, each place's buffer range holds what the concatenated gather holds at
    its local range, with the run's group; with one shard the places are the runs themselves (one range)."""
    params = [(f"p{i}", nn.Parameter(torch.randn(7, i + 3)), i % 2) for i in range(6)]
    buf = FlatBuffer(params, shards, index, bucket_numel=40)
    assert len(buf.buckets) > 2
    buf.params.copy_(torch.arange(buf.numel, dtype=buf.params.dtype))
    owned = buf.gather_owned(buf.params)
    places = buf.owned_places()
    assert [lo for lo, *_ in places] == [0] + [hi for _, hi, *_ in places[:-1]]
    assert places[-1][1] == buf.owned_numel
    group_at = {}
    for lo, hi, group in buf.runs:
        group_at.update({i: group for i in range(lo, hi)})
    for lo, hi, at, group in places:
        assert torch.equal(buf.params[at : at + hi - lo], owned[lo:hi])
        assert {group_at[i] for i in range(lo, hi)} == {group}
    if shards == 1:
        assert [(lo, hi, group) for lo, hi, _, group in places] == buf.runs
        assert all(at == lo for lo, _, at, _ in places)
