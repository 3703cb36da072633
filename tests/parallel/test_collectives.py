"""Multi-process tests of the autograd collectives against single-process math, and of their ledger bytes.

Every rank builds every group member's inputs from seeds (distinct per *global* rank, offset by 10 * rank), runs the
collective on its own slice, and compares the forward value and the input gradient with a single-process autograd
computation of the same math over all members. A reduction over the wrong group or in the wrong order changes the
numbers. The ledger records of each run are sent back and compared with the closed-form byte counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from mula_lightning.parallel.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    exchange_split_counts,
    exchange_split_sizes,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
    reduce_scatter_tensor,
)
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import CommLedger
from mula_lightning.testing import run_pooled_test

pytestmark = pytest.mark.distributed

N, H = 3, 2  # rows per rank, columns
F32 = 4  # bytes per fp32 element


def _data(global_rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + global_rank)
    return torch.randn(shape, generator=generator) + 10.0 * global_rank


def _a2a_splits(d: int) -> list[list[int]]:
    """splits[a][b]: rows group rank a sends to group rank b; includes zero-row splits."""
    return [[(a + 2 * b) % 3 for b in range(d)] for a in range(d)]


def _exercise(rank: int, members: list[int], group: dist.ProcessGroup | None) -> list[dict]:
    """Run every collective on ``group`` and check it against the single-process reference; return ledger records."""
    me, d = members.index(rank), len(members)
    with CommLedger() as ledger:
        # forward_allgather_backward_reducescatter: y = cat(x_j); loss = sum_j <y, w_j>
        xs = [_data(m, (N, H), 1).requires_grad_() for m in members]
        ws = [_data(m, (d * N, H), 2) for m in members]
        sum((torch.cat(xs) * w).sum() for w in ws).backward()
        x = xs[me].detach().clone().requires_grad_()
        y = forward_allgather_backward_reducescatter(x, group, tag="ag_rs")
        assert_close(y, torch.cat(xs).detach())
        (y * ws[me]).sum().backward()
        assert_close(x.grad, xs[me].grad)

        # forward_reducescatter_backward_allgather: y_j = sum_k z_k[block j]; loss = sum_j <y_j, v_j>
        zs = [_data(m, (d * N, H), 3).requires_grad_() for m in members]
        vs = [_data(m, (N, H), 4) for m in members]
        blocks = [sum(z[j * N : (j + 1) * N] for z in zs) for j in range(d)]
        sum((b * v).sum() for b, v in zip(blocks, vs)).backward()
        z = zs[me].detach().clone().requires_grad_()
        y = forward_reducescatter_backward_allgather(z, group, level="ep", tag="rs_ag")
        assert_close(y, blocks[me].detach())
        (y * vs[me]).sum().backward()
        assert_close(z.grad, zs[me].grad)

        # forward_allgather on indices: int64 beyond 2**53 must survive bit-exact; no grad.
        idx = torch.tensor([[members[me], 2**62 + members[me]]], dtype=torch.int64)
        gathered = forward_allgather(idx, group, tag="idx")
        assert gathered.tolist() == [[m, 2**62 + m] for m in members] and not gathered.requires_grad

        # Dtypes gloo cannot move (int16, float8) and bool go as raw bytes: still exact.
        for dtype in (torch.int16, torch.bool, torch.float8_e4m3fn):
            parts = [(torch.arange(4) % 2 + m).to(dtype).reshape(2, 2) for m in members]
            assert torch.equal(forward_allgather(parts[me], group, tag="bytes").view(torch.uint8),
                               torch.cat(parts).view(torch.uint8))  # fmt: skip

        # all_to_all_single with variable splits (some zero); backward is the reverse exchange.
        splits = _a2a_splits(d)
        out_splits = [splits[b][me] for b in range(d)]
        assert exchange_split_sizes(splits[me], group, tag="counts") == out_splits
        assert exchange_split_counts(torch.tensor(splits[me]), group, tag="counts") == (splits[me], out_splits)
        ins = [_data(m, (sum(splits[a]), H), 5).requires_grad_() for a, m in enumerate(members)]
        chunks = [torch.split(t, s) for t, s in zip(ins, splits)]
        outs = [torch.cat([chunks[b][a] for b in range(d)]) for a in range(d)]
        us = [_data(m, (o.shape[0], H), 6) for m, o in zip(members, outs)]
        sum((o * u).sum() for o, u in zip(outs, us)).backward()
        a = ins[me].detach().clone().requires_grad_()
        y = all_to_all_single(a, out_splits, splits[me], group, tag="a2a")
        assert_close(y, outs[me].detach())
        (y * us[me]).sum().backward()
        assert_close(a.grad, ins[me].grad)

        # Plain (no-grad) wrappers.
        assert_close(all_gather_into_tensor(xs[me], group, tag="plain_ag"), torch.cat(xs).detach())
        assert_close(reduce_scatter_tensor(zs[me], group, tag="plain_rs"), blocks[me].detach())
        assert_close(all_reduce(xs[me], group, tag="ar"), sum(xs).detach())
    return [record.as_dict() for record in ledger.records]


def _run_world(rank: int, world_size: int) -> list[dict]:
    """Refusals of bad input, then every collective on the whole world."""
    with pytest.raises(TypeError, match="cannot reduce torch.float8_e4m3fn"):
        reduce_scatter_tensor(torch.zeros(2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"dim 0 \(3\) must be divisible by the group size \(2\)"):
        forward_reducescatter_backward_allgather(torch.zeros(3, 1, requires_grad=True))
    return _exercise(rank, list(range(world_size)), None)


def _run_subgroups(rank: int, world_size: int) -> dict:
    """The 4-rank world (2 simulated nodes), then two layouts of 2 groups of 2: within nodes, then across nodes."""
    results = {"world": (list(range(world_size)), _exercise(rank, list(range(world_size)), None))}
    for name, layout in (("pairs", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])):
        groups = [dist.new_group(members) for members in layout]  # every rank creates every group, in order
        index = next(i for i, members in enumerate(layout) if rank in members)
        results[name] = (layout[index], _exercise(rank, layout[index], groups[index]))
    results["discovered"] = HardwareTopology.discover() == HardwareTopology.from_env()
    return results


def _expected_bytes(members: list[int], rank: int) -> dict[tuple[str, str, str | None], int]:
    """Closed-form bytes sent by ``rank`` for each (tag, op, phase) of :func:`_exercise`, ring convention."""
    me, d = members.index(rank), len(members)
    rows = N * H * F32  # one rank's (N, H) fp32 block
    splits = _a2a_splits(d)
    received = [splits[b][me] for b in range(d)]
    bytes_ = {torch.int16: 2, torch.bool: 1, torch.float8_e4m3fn: 1}
    return {
        ("ag_rs", "all_gather", "forward"): (d - 1) * rows,
        ("ag_rs", "reduce_scatter", "backward"): (d - 1) * rows,  # (d-1)/d of the (d*N, H) gradient
        ("rs_ag", "reduce_scatter", "forward"): (d - 1) * rows,
        ("rs_ag", "all_gather", "backward"): (d - 1) * rows,
        ("idx", "all_gather", None): (d - 1) * 2 * 8,
        ("bytes", "all_gather", None): (d - 1) * 4 * sum(bytes_.values()),
        ("counts", "all_to_all", None): 2 * (d - 1) * 8,  # exchange_split_sizes and exchange_split_counts
        ("a2a", "all_to_all", "forward"): (sum(splits[me]) - splits[me][me]) * H * F32,
        ("a2a", "all_to_all", "backward"): (sum(received) - received[me]) * H * F32,
        ("plain_ag", "all_gather", None): (d - 1) * rows,
        ("plain_rs", "reduce_scatter", None): (d - 1) * rows,
        ("ar", "all_reduce", None): 2 * (d - 1) * rows // d,
    }


def _check_ledger(records: list[dict], members: list[int], rank: int, level: str) -> None:
    got: dict[tuple[str, str, str | None], int] = {}
    for record in records:
        assert record["rank"] == rank and list(record["ranks"]) == members
        assert record["level"] == ("ep" if record["tag"] == "rs_ag" else level), record
        key = (record["tag"], record["op"], record["phase"])
        got[key] = got.get(key, 0) + record["bytes_sent"]
    assert got == _expected_bytes(members, rank)


def test_collectives_match_single_process_math_with_two_ranks() -> None:
    """On a world of 2, every collective's values and gradients equal the single-process reference, dtypes gloo
    cannot move are sent exactly as bytes, bad input is refused clearly, and the ledger bytes equal the closed form."""
    results = run_pooled_test(_run_world, world_size=2, timeout=90)
    for rank, records in enumerate(results):
        _check_ledger(records, [0, 1], rank, level="intra_node")


def test_collectives_with_four_ranks_and_subgroups_within_and_across_nodes() -> None:
    """On 4 ranks over 2 simulated nodes: the world group (d = 4, spanning nodes) and 2 groups of 2 laid out within
    nodes, then across nodes, all match the single-process reference with results and gradients staying inside
    each group; the ledger tags pairs 'intra_node' or 'inter_node' and its bytes equal the closed form."""
    results = run_pooled_test(_run_subgroups, world_size=4, ranks_per_node=2, timeout=90)
    for rank, result in enumerate(results):
        assert result["discovered"], "Topology.discover() must agree with the launcher variables"
        for name, level in (("world", "inter_node"), ("pairs", "intra_node"), ("strided", "inter_node")):
            members, records = result[name]
            _check_ledger(records, members, rank, level=level)


def _reduce_scatter_on_gloo(rank: int, world_size: int) -> None:
    from mula_lightning.parallel.collectives import reduce_scatter_single

    n = 6  # elements each rank keeps
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64):
        inputs = []
        for r in range(world_size):  # every rank's input, distinct per rank, from its seed
            g = torch.Generator().manual_seed(100 * r + 7)
            if dtype.is_floating_point:
                inputs.append(torch.randn(world_size * n, generator=g).to(dtype))
            else:
                inputs.append(torch.randint(-100, 100, (world_size * n,), generator=g).to(dtype))
        chunks = torch.stack([x.view(world_size, n)[rank] for x in inputs])  # (ranks, n): what lands here
        expected = chunks.sum(0, dtype=dtype)  # int8 wraps, as the backends' sums do
        for async_op in (False, True):
            out = torch.full((n,), 99, dtype=dtype)
            work = reduce_scatter_single(out, inputs[rank].clone(), group=None, async_op=async_op)
            if async_op:
                assert work.wait() and work.is_completed()
            assert torch.equal(out, expected), (dtype, async_op, out, expected)
    # in place: the output a view of the input's own chunk, as callers may pass
    x = torch.arange(world_size * n, dtype=torch.float64) * (rank + 1)
    out = x.view(world_size, n)[rank]
    reduce_scatter_single(out, x)
    full = sum(torch.arange(world_size * n, dtype=torch.float64) * (r + 1) for r in range(world_size))
    assert torch.equal(out, full.view(world_size, n)[rank])
    # another reduction goes to the backend's own reduce-scatter
    y = torch.full((world_size * n,), float(rank))
    out = torch.empty(n)
    reduce_scatter_single(out, y, op=dist.ReduceOp.MAX)
    assert torch.equal(out, torch.full((n,), float(world_size - 1)))
    with pytest.raises(ValueError, match=rf"input of {world_size * n + 1} torch.float32 elements for an output of {n}"):
        reduce_scatter_single(torch.empty(n), torch.empty(world_size * n + 1))


def _all_gather_in_place_on_gloo(rank: int, world_size: int) -> None:
    from mula_lightning.parallel.collectives import all_gather_reads_own_chunk, all_gather_single

    assert all_gather_reads_own_chunk(None, torch.device("cpu"))
    n = 5
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int8):
        for async_op in (False, True):
            values = [(torch.arange(n) * 3 + 17 * r - 40).to(dtype) for r in range(world_size)]  # distinct per rank
            full = torch.full((world_size * n,), 99, dtype=dtype)
            full[rank * n : (rank + 1) * n] = values[rank]
            work = all_gather_single(full, full[rank * n : (rank + 1) * n], group=None, async_op=async_op)
            if async_op:
                work.wait()
            assert torch.equal(full, torch.cat(values)), (dtype, async_op, full)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_on_gloo_reads_its_input_from_its_own_chunk(world_size: int) -> None:
    """The sharded optimizers gather weights on gloo and NCCL with the input a view of the rank's own chunk of the
    output (no copy): on gloo that gives every rank every rank's distinct values (fp32, fp64, bf16, int8; blocking
    and asynchronous), so a torch release whose gloo binding wrote the output before reading the input fails here."""
    run_pooled_test(_all_gather_in_place_on_gloo, world_size=world_size, timeout=90)


def test_backend_for_device_reads_one_backend_per_device_type() -> None:
    """A group's backend string names the backend of each device type (``"cpu:gloo,cuda:nccl"``) or one for all;
    a device type it does not name has none."""
    from mula_lightning.parallel.collectives import backend_for_device

    assert backend_for_device("gloo", "cpu") == "gloo"
    assert backend_for_device("nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for_device("cpu:gloo,xpu:xccl", "xpu") == "xccl"
    assert backend_for_device("cpu:gloo", "cuda") == ""


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_on_gloo_sums_every_rank_exactly(world_size: int) -> None:
    """On gloo, ``reduce_scatter_single`` (an all-to-all and a local sum there) gives every rank the exact sum of its
    chunk over the ranks (distinct per-rank inputs; fp32, fp64, bf16, wrapping int8, int64; blocking and
    asynchronous; the output a view into the input), other reductions still reach the backend, and an input that
    is not world_size x the output is refused with both sizes."""
    run_pooled_test(_reduce_scatter_on_gloo, world_size=world_size, timeout=90)
