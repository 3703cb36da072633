"""The pool of distributed workers behind ``run_distributed_test(..., pool=True)``: results as from fresh ranks, each
test starting from a fresh process's state, and a test that raises, hangs or kills its worker failing with the
rank's traceback, exit code or the time-out while the next test runs on a fresh group."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from mula_lightning.testing import DistributedTestError, run_distributed_test


def _sum_and_pid(rank: int, world_size: int, scale: float) -> tuple[list[float], int]:
    x = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(x)
    return x.tolist(), os.getpid()


def _dirty(rank: int, world_size: int) -> int:
    """Leaves state behind: an environment variable, float64 as the default dtype, grad mode off, a used RNG."""
    os.environ["MULA_POOL_LEFTOVER"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.rand(rank + 5)
    return os.getpid()


def _state(rank: int, world_size: int) -> tuple[str | None, str, bool, list[float], int]:
    draw = torch.rand(2)
    gathered = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(gathered, draw)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    leftover = os.environ.get("MULA_POOL_LEFTOVER")
    return leftover, str(torch.get_default_dtype()), torch.is_grad_enabled(), same, os.getpid()


def _raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits for a peer that never comes
    return rank


def _hangs(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(3600)
    return rank


def _dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return rank


def _pids(world_size: int) -> set[int]:
    return {pid for _, pid in run_distributed_test(_sum_and_pid, world_size, pool=True, scale=1.0)}


def test_pool_returns_what_fresh_ranks_return_and_reuses_its_processes():
    """The same all-reduce on the pool and on fresh processes gives the same values; two pooled runs use the same
    worker processes (nothing started per test)."""
    fresh = run_distributed_test(_sum_and_pid, 2, scale=2.0)
    pooled = run_distributed_test(_sum_and_pid, 2, pool=True, scale=2.0)
    assert [v for v, _ in pooled] == [v for v, _ in fresh] == [[6.0, 6.0, 6.0]] * 2
    assert {pid for _, pid in pooled} == _pids(2)


def test_every_pooled_test_starts_from_a_fresh_process_state():
    """A test that sets an environment variable, float64, no-grad and draws from the RNG leaves none of it for the
    next one, which finds equal RNG states on every rank, as fresh ranks would have."""
    dirty_pids = run_distributed_test(_dirty, 2, pool=True)
    states = run_distributed_test(_state, 2, pool=True)
    for leftover, dtype, grad, same, _ in states:
        assert (leftover, dtype, grad, same) == (None, "torch.float32", True, True)
    assert [pid for *_, pid in states] == dirty_pids  # the same workers ran both


def _many_groups(rank: int, world_size: int) -> tuple[int, int]:
    from mula_lightning.testing.pool import MAX_WORKER_THREADS

    for _ in range(MAX_WORKER_THREADS // 3 + 1):  # a gloo group keeps about three threads
        dist.new_group([0, 1])
    return len(os.listdir("/proc/self/task")), os.getpid()


def _threads(rank: int, world_size: int) -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), os.getpid()


def test_a_worker_grown_past_its_thread_limit_is_replaced():
    """A test that leaves enough process groups behind to pass ``MAX_WORKER_THREADS`` (each gloo group keeps a TCP
    loop waking every 10 ms: idle workers had come to spend a fifth of a core each) is followed by fresh workers with
    few threads; the test itself succeeds."""
    from mula_lightning.testing.pool import MAX_WORKER_THREADS

    grown = run_distributed_test(_many_groups, 2, pool=True)
    assert all(threads > MAX_WORKER_THREADS for threads, _ in grown)
    fresh = run_distributed_test(_threads, 2, pool=True)
    assert {pid for _, pid in fresh}.isdisjoint(pid for _, pid in grown)
    assert all(threads < MAX_WORKER_THREADS // 2 for threads, _ in fresh)


@pytest.mark.parametrize(
    ("fn", "expected", "match"),
    [
        (_raises, DistributedTestError, r"(?s)rank 1 failed.*ValueError: rank one refuses"),
        (_hangs, TimeoutError, r"timed out after 3 s: ranks \[0\]"),
        (_dies, DistributedTestError, r"(?s)rank 1 failed.*exited with code 7 without reporting a result"),
    ],
    ids=["raises", "hangs", "dies"],
)
def test_a_failing_test_reports_like_fresh_ranks_and_the_next_runs_on_a_fresh_group(fn, expected, match):
    """A rank that raises (with its traceback), a rank that hangs (the time-out) and a rank that exits without a
    result (its exit code) fail the test as on fresh ranks; the group is replaced, so the next test passes on new
    processes."""
    before = _pids(2)
    with pytest.raises(expected, match=match) as info:
        run_distributed_test(fn, 2, pool=True, timeout=3.0)
    if expected is DistributedTestError and fn is _raises:
        assert "Traceback" in info.value.failures[1] and "_raises" in info.value.failures[1]
    after = _pids(2)
    assert not before & after


def test_a_death_is_named_before_the_lost_connections_it_causes():
    """The failure order both runners report: a rank that died comes before a peer's earlier-reported "connection
    reset" (the death caused it; the parent sees a death only when its wait wakes), but not before an unrelated
    error reported earlier; without a death, errors keep their time order."""
    from mula_lightning.testing.processes import first_failure_first

    reset = "RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"
    assert first_failure_first({0: ("error", reset, 1.0), 1: ("died", "exited with code 7", 2.0)}) == [1, 0]
    assert first_failure_first({0: ("error", "ValueError: bad", 1.0), 1: ("died", "exited with code 7", 2.0)}) == [0, 1]
    assert first_failure_first({0: ("error", reset, 1.0), 1: ("error", "ValueError: bad", 2.0)}) == [0, 1]
    three = {2: ("error", reset, 0.5), 0: ("died", "killed", 3.0), 1: ("error", "x", 1.0)}
    assert first_failure_first(three) == [1, 0, 2]
