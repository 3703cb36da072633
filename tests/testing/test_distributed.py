"""Tests for ``run_distributed_test``: results, failures, hangs, dead ranks and simulated nodes, with real gloo."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mula_lightning.testing import BACKENDS, DistributedTestError, requires_gpu, run_distributed_test
from mula_lightning.testing.distributed import _Outcome, _wait_for_ranks
from mula_lightning.utils.device import default_device, device_count

pytestmark = pytest.mark.distributed


# Per-rank functions must live at module level: spawned children import them by name.


def _all_reduce_rank_values(rank: int, world_size: int, scale: float) -> dict:
    """Each rank contributes scale * (rank + 1); returns what it saw after an all_reduce."""
    x = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(x)
    return {"rank": rank, "world_size": world_size, "sum": x.item(), "pid": os.getpid()}


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on this rank")
    dist.barrier()  # rank 0 blocks here on its dead peer: the helper must not wait for the full timeout
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def _hard_exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return rank


def _report_env(rank: int, world_size: int) -> dict:
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MULA_NODE_NAME"]
    keys += ["MULA_RANKS_PER_NODE", "MULA_RANKS_PER_GPU", "MASTER_ADDR"]
    env = {k: os.environ.get(k) for k in keys}
    env["dist_rank"] = dist.get_rank()
    env["dist_world"] = dist.get_world_size()
    return env


def _accelerator_all_reduce(rank: int, world_size: int) -> tuple[str, list[float]]:
    device = default_device()
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    return str(device), x.cpu().tolist()


def test_returns_per_rank_values_and_all_reduce_sums() -> None:
    """Results come back in rank order from distinct processes, and a real gloo all_reduce sums 1..N (scaled)."""
    results = run_distributed_test(_all_reduce_rank_values, world_size=2, scale=0.5)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert [r["sum"] for r in results] == [0.5 * (1 + 2)] * 2
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # two children, none of them this process


def test_exception_on_one_rank_surfaces_with_rank_and_traceback() -> None:
    """An exception on rank 1 fails the run quickly with rank 1 named and its traceback (function, message)."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed_test(_raise_on_rank_one, world_size=2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 failed")
    assert "ValueError: deliberate failure on this rank" in message
    assert "Traceback (most recent call last)" in message and "_raise_on_rank_one" in message
    assert 1 in info.value.failures
    assert time.monotonic() - start < 30, "the blocked peer must be killed after a grace period, not the timeout"


def test_hang_times_out_kills_children_and_names_running_ranks() -> None:
    """A rank that never finishes makes the run raise TimeoutError soon after the timeout, naming it, with no child
    process left behind. (Rank 1 may also be named if start-up alone ate the timeout on a loaded machine; the exact
    selection of ranks is proven deterministically below.)"""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] of 2 had not finished"):
        run_distributed_test(_hang_on_rank_zero, world_size=2, timeout=5)
    assert time.monotonic() - start < 20
    # the pooled workers of other tests (mula-pool*) live on by design; no rank of this run may
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("mula-rank")] == []


def test_timeout_names_exactly_the_unfinished_ranks() -> None:
    """Given rank 1 finished and ranks 0 and 2 did not, the timeout error names [0, 2] (no processes involved)."""
    outcomes = [_Outcome("running"), _Outcome("ok", value=1), _Outcome("running")]
    with pytest.raises(TimeoutError, match=r"ranks \[0, 2\] of 3 had not finished"):
        _wait_for_ranks(outcomes, threading.Condition(), timeout=0.05)


def test_failures_are_ordered_by_when_the_ranks_reported() -> None:
    """The root cause (earliest report) is named first even if its watcher thread published it last."""
    outcomes = [
        _Outcome("error", detail="RuntimeError: connection closed by peer", finished_at=1.0, reported_at=20.0),
        _Outcome("error", detail="ValueError: root cause", finished_at=2.0, reported_at=10.0),
    ]
    with pytest.raises(DistributedTestError, match=r"^rank 1 failed \(failed ranks, first failure first: \[1, 0\]\)"):
        _wait_for_ranks(outcomes, threading.Condition(), timeout=5)


def test_rank_killed_without_exception_reports_exit_code() -> None:
    """A rank leaving through os._exit(7) is reported as rank 1 with exit code 7, not as a hang."""
    with pytest.raises(DistributedTestError, match=r"rank 1 failed") as info:
        run_distributed_test(_hard_exit_on_rank_one, world_size=2, timeout=60)
    assert "exited with code 7 without reporting a result" in str(info.value)


def test_simulated_nodes_set_launcher_environment() -> None:
    """With ranks_per_node=2 and ranks_per_gpu=2, four ranks see two nodes with the right local ranks and names."""
    results = run_distributed_test(_report_env, world_size=4, ranks_per_node=2, ranks_per_gpu=2)
    for rank, env in enumerate(results):
        assert env["RANK"] == str(rank) and env["dist_rank"] == rank
        assert env["WORLD_SIZE"] == "4" and env["dist_world"] == 4
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["MULA_NODE_NAME"] == f"node{rank // 2}"
        assert env["MULA_RANKS_PER_NODE"] == "2" and env["MULA_RANKS_PER_GPU"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"


def test_bad_arguments_fail_before_spawning() -> None:
    """A topology that does not divide, or a function spawned children cannot import, is refused with its values."""
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide world_size \(4\)"):
        run_distributed_test(_report_env, world_size=4, ranks_per_node=3)
    with pytest.raises(ValueError, match=r"ranks_per_gpu \(4\) must divide ranks_per_node \(2\)"):
        run_distributed_test(_report_env, world_size=4, ranks_per_node=2, ranks_per_gpu=4)
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed_test(lambda rank, world_size: rank, world_size=2)


def test_backends_always_include_gloo_first() -> None:
    """BACKENDS starts with gloo and lists an accelerator backend only when that accelerator is visible."""
    assert BACKENDS[0] == "gloo"
    assert ("nccl" in BACKENDS) <= torch.cuda.is_available()
    assert ("xccl" in BACKENDS) <= (hasattr(torch, "xpu") and torch.xpu.is_available())


@requires_gpu
def test_accelerator_backend_pins_ranks_to_devices_and_all_reduces() -> None:
    """With a GPU, the accelerator backend (NCCL / XCCL) starts one rank per device, pins rank r to device r, and
    sums across devices."""
    world_size = device_count()
    results = run_distributed_test(_accelerator_all_reduce, world_size=world_size, backend=BACKENDS[-1])
    total = world_size * (world_size + 1) / 2
    for rank, (device, values) in enumerate(results):
        assert device.endswith(f":{rank}") and values == [total] * 4
