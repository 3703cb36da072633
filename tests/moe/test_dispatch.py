"""Stages 2 and 3 (token counting, index generation) against a literal transcription of Algorithm 1's kernels."""

from __future__ import annotations

import pytest
import torch

from mula_lightning.moe.dispatch import build_dispatch_plan, count_tokens
from mula_lightning.moe.router import count_per_expert


def algorithm1_stage2_3(indices, n_start, n_end, tbs=8):
    """Algorithm 1 lines 15-72 as written (threads become a loop; ``n_start <= n <= n_end`` inclusive)."""
    T, K = len(indices), len(indices[0])
    NR = n_end - n_start + 1
    TH = -(-T // tbs)  # the last thread block may be partial when T is not a multiple of TBS
    partial_token_counts = [0] * (NR * TH)
    expert_counts = [0] * T
    for tid in range(TH):
        for i in range(tbs):
            t = tid * tbs + i
            if t >= T:
                break
            for k in range(K):
                n = indices[t][k]
                if n_start <= n <= n_end:
                    partial_token_counts[(n - n_start) * TH + tid] += 1
                    expert_counts[t] += 1
    partial_cum = [0]
    for c in partial_token_counts:
        partial_cum.append(partial_cum[-1] + c)
    cum_expert_counts = [0]
    for c in expert_counts:
        cum_expert_counts.append(cum_expert_counts[-1] + c)
    cum_token_counts = [partial_cum[n * TH] for n in range(NR + 1)]

    RT = cum_token_counts[-1]
    input_indices, output_indices, selected = [0] * RT, [0] * RT, [0] * RT
    counter = [[0] * TH for _ in range(NR)]
    for tid in range(TH):
        for i in range(tbs):
            t = tid * tbs + i
            if t >= T:
                break
            o_ind = cum_expert_counts[t]
            for k in range(K):
                n = indices[t][k]
                if n_start <= n <= n_end:
                    ln = n - n_start
                    i_ind = partial_cum[ln * TH + tid] + counter[ln][tid]
                    input_indices[i_ind] = t
                    output_indices[o_ind] = i_ind
                    selected[o_ind] = k
                    counter[ln][tid] += 1
                    o_ind += 1
    token_counts = [cum_token_counts[n + 1] - cum_token_counts[n] for n in range(NR)]
    return token_counts, cum_token_counts, expert_counts, cum_expert_counts, input_indices, output_indices, selected


def random_indices(T, K, E, seed, drop_fraction=0.0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if drop_fraction:
        idx[torch.rand(T, K, generator=gen) < drop_fraction] = -1
    return idx


@pytest.mark.parametrize(
    "T,K,E,n_start,n_end,drop",
    [
        (1, 1, 1, 0, 0, 0.0),
        (37, 2, 8, 0, 7, 0.0),
        (29, 8, 64, 0, 63, 0.0),
        (29, 8, 64, 16, 31, 0.0),  # an EP rank holding experts 16..31
        (45, 2, 8, 6, 7, 0.3),  # the last rank, with capacity drops (-1)
        (13, 3, 6, 2, 2, 0.0),  # a single local expert
    ],
)
def test_plan_matches_algorithm1(T, K, E, n_start, n_end, drop):
    """Every field of the vectorised plan equals the kernels of Algorithm 1 run literally on the same indices,
    for the full expert range and for a local range [n_start, n_end] (inclusive), with and without drops."""
    idx = random_indices(T, K, E, seed=T + E, drop_fraction=drop)
    plan = build_dispatch_plan(idx, E, n_start, n_end)
    expected = algorithm1_stage2_3(idx.tolist(), n_start, n_end)
    got = (
        plan.token_counts,
        plan.cum_token_counts,
        plan.expert_counts,
        plan.cum_expert_counts,
        plan.input_indices,
        plan.output_indices,
        plan.selected_expert_indices,
    )
    for name, g, e in zip(
        [
            "token_counts",
            "cum_token_counts",
            "expert_counts",
            "cum_expert_counts",
            "input_indices",
            "output_indices",
            "selected_expert_indices",
        ],
        got,
        expected,
    ):
        assert g.tolist() == e, name
    # the dense slot map and the row -> slot map agree with the CSR form
    for t in range(T):
        for o in range(int(plan.cum_expert_counts[t]), int(plan.cum_expert_counts[t + 1])):
            k, r = int(plan.selected_expert_indices[o]), int(plan.output_indices[o])
            assert int(plan.slot_row_SK[t, k]) == r and int(plan.row_slot[r]) == t * K + k
    assert int((plan.slot_row_SK >= 0).sum()) == plan.num_rows
    assert plan.offs.dtype == torch.int32 and plan.offs.tolist() == expected[1][1:]


PLAN_FIELDS = ("token_counts", "cum_token_counts", "expert_counts", "cum_expert_counts", "input_indices",
               "output_indices", "selected_expert_indices", "row_slot", "slot_row_SK")  # fmt: skip


def test_all_routed_hint_gives_the_same_plan():
    """The ``all_routed=True`` shortcut (no host sync, no masking over the whole range) and the router's own counts
    passed as ``token_counts`` build the same plan, every field, as working it out from the indices."""
    idx = random_indices(31, 4, 16, seed=0)
    a, b = build_dispatch_plan(idx, 16), build_dispatch_plan(idx, 16, all_routed=True)
    c = build_dispatch_plan(idx, 16, all_routed=True, token_counts=count_per_expert(idx, 16))
    assert a.all_routed and b.all_routed and c.all_routed
    for field in PLAN_FIELDS:
        assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert torch.equal(getattr(a, field), getattr(c, field)), field


def test_given_counts_of_a_range_with_drops_give_the_same_plan():
    """``token_counts`` for a local range with pairs dropped (-1) and pairs of other ranks: the same plan as
    counting."""
    idx = random_indices(41, 3, 12, seed=7, drop_fraction=0.2)
    counted = build_dispatch_plan(idx, 12, 4, 7)
    given = build_dispatch_plan(idx, 12, 4, 7, token_counts=counted.token_counts.clone())
    assert not given.all_routed
    for field in PLAN_FIELDS:
        assert torch.equal(getattr(given, field), getattr(counted, field)), field


@pytest.mark.parametrize("n_start, n_end, drop", [(0, 15, 0.0), (4, 7, 0.0), (8, 15, 0.3)])
def test_a_known_routed_row_count_gives_the_same_plan(n_start, n_end, drop):
    """``num_rows`` (what the all-gather dispatcher learns from its count exchange, so the plan needs no host read)
    builds the same plan as counting, for a local range and with drops; a wrong count fails on the device check."""
    idx = random_indices(37, 4, 16, seed=3, drop_fraction=drop)
    counted = build_dispatch_plan(idx, 16, n_start, n_end)
    told = build_dispatch_plan(idx, 16, n_start, n_end, num_rows=counted.num_rows)
    for field in ("token_counts", "input_indices", "output_indices", "selected_expert_indices", "slot_row_SK", "offs"):
        assert torch.equal(getattr(told, field), getattr(counted, field)), field
    assert told.all_routed == counted.all_routed
    with pytest.raises(RuntimeError, match="num_rows is not the number of pairs routed here"):
        build_dispatch_plan(idx, 16, n_start, n_end, num_rows=counted.num_rows + 1)


@pytest.mark.parametrize("n_start, n_end, drop", [(0, 11, 0.0), (4, 7, 0.2)])
def test_count_tokens_gives_the_plans_counts(n_start, n_end, drop):
    """Stage 2 on its own (``count_tokens``, public) counts what the plan holds: pairs per local expert, local experts
    per token and both prefix sums, for the whole range and a local range with drops."""
    idx = random_indices(41, 3, 12, seed=5, drop_fraction=drop)
    plan = build_dispatch_plan(idx, 12, n_start, n_end)
    _, token_counts, cum_token_counts, expert_counts, cum_expert_counts = count_tokens(idx, n_start, n_end)
    assert torch.equal(token_counts, plan.token_counts) and torch.equal(cum_token_counts, plan.cum_token_counts)
    assert torch.equal(expert_counts, plan.expert_counts) and torch.equal(cum_expert_counts, plan.cum_expert_counts)


def test_bad_range_names_the_values():
    """An expert range outside the layer is rejected with the offending numbers in the message."""
    with pytest.raises(ValueError, match="n_start=4, n_end=9"):
        build_dispatch_plan(random_indices(4, 2, 8, 0), 8, 4, 9)


@pytest.mark.parametrize("shape, num_experts", [((37, 3), 5), ((1, 8), 64), ((0, 2), 4), ((6, 7, 2), 3)])
def test_count_per_expert_counts_like_a_loop(shape, num_experts):
    """The sync-free expert counter gives, for every expert, the number of entries naming it (a Python loop over
    the entries), ignores -1 (capacity drops) and ids past the last expert, and returns int64 on the input's device,
    for int64 and int32 indices of any shape (empty included)."""
    gen = torch.Generator().manual_seed(sum(shape) + num_experts)
    idx = torch.randint(-1, num_experts + 2, shape, generator=gen)
    expected = [sum(1 for v in idx.reshape(-1).tolist() if v == e) for e in range(num_experts)]
    for dtype in (torch.int64, torch.int32):
        got = count_per_expert(idx.to(dtype), num_experts)
        assert got.dtype == torch.int64 and got.shape == (num_experts,)
        assert got.tolist() == expected
