"""Single-process tests for the communication ledger: byte convention, topology levels, capture and summaries."""

from __future__ import annotations

import threading

import pytest
import torch

from mula_lightning.parallel import ledger as ledger_module
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import CommLedger, is_recording, record_collective, ring_bytes_sent


def test_ring_bytes_match_the_ring_algorithm() -> None:
    """Per-rank bytes sent: all-gather (d-1)n, reduce-scatter (d-1)N/d, all-reduce 2(d-1)N/d, all-to-all minus self."""
    assert ring_bytes_sent("all_gather", 4, bytes_in=100) == 300  # output 400 bytes, 3/4 of it arrives from peers
    assert ring_bytes_sent("reduce_scatter", 4, bytes_in=400) == 300
    assert ring_bytes_sent("all_reduce", 4, bytes_in=400) == 600
    assert ring_bytes_sent("all_to_all", 4, bytes_in=400, self_bytes=40) == 360
    assert ring_bytes_sent("all_gather", 1, bytes_in=100) == 0  # a group of one sends nothing
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        ring_bytes_sent("broadcast", 2, 8)


def test_levels_follow_the_narrowest_shared_hardware() -> None:
    """2 nodes x 2 GPUs x 2 GCDs: GCD pairs are 'gcd', GPUs of a node 'intra_node', across nodes 'inter_node'."""
    topo = HardwareTopology.uniform(world_size=8, ranks_per_node=4, ranks_per_gpu=2)
    assert topo.level_of([3]) == "self"
    assert topo.level_of([2, 3]) == "gcd"
    assert topo.level_of([1, 2]) == "intra_node"
    assert topo.level_of([0, 1, 2, 3]) == "intra_node"
    assert topo.level_of([3, 4]) == "inter_node"
    assert topo.level_of(range(8)) == "inter_node"
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide world_size \(8\)"):
        HardwareTopology.uniform(world_size=8, ranks_per_node=3)


def test_topology_from_env_prefers_mula_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """MULA_RANKS_PER_NODE overrides LOCAL_WORLD_SIZE, which overrides 'one node'; MULA_RANKS_PER_GPU sets GCD pairs."""
    for var in ("MULA_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "MULA_RANKS_PER_GPU"):
        monkeypatch.delenv(var, raising=False)
    assert HardwareTopology.from_env(world_size=4).level_of([0, 3]) == "intra_node"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert HardwareTopology.from_env(world_size=4).level_of([1, 2]) == "inter_node"
    monkeypatch.setenv("MULA_RANKS_PER_NODE", "4")
    monkeypatch.setenv("MULA_RANKS_PER_GPU", "2")
    topo = HardwareTopology.from_env(world_size=4)
    assert (topo.level_of([1, 2]), topo.level_of([2, 3])) == ("intra_node", "gcd")


def test_capture_summary_and_explicit_levels() -> None:
    """Records land only while a ledger is active; explicit labels win; summaries add up per (op, level)."""
    topo = HardwareTopology.uniform(world_size=4, ranks_per_node=2)
    outside = CommLedger(topology=topo)
    assert not is_recording()
    with CommLedger(topology=topo) as ledger:
        assert is_recording()
        ledger.add("all_gather", [0, 1], 0, torch.float32, 16, 32, 16)
        ledger.add("all_gather", [0, 2], 0, torch.float32, 16, 32, 16)
        ledger.add("all_gather", [0, 1], 0, torch.bfloat16, 8, 16, 8, phase="backward")
        ledger.add("reduce_scatter", [0, 1, 2, 3], 0, torch.float32, 64, 16, 48, level="ep", tag="moe.out")
    assert not is_recording() and len(outside) == 0
    summary = ledger.summary()
    assert list(summary) == [("all_gather", "intra_node"), ("all_gather", "inter_node"), ("reduce_scatter", "ep")]
    assert (summary[("all_gather", "intra_node")].count, summary[("all_gather", "intra_node")].bytes_sent) == (2, 24)
    assert ledger.total(phase="backward").bytes_in == 8
    assert ledger.select(tag="moe.out")[0].dtype == "torch.float32"
    assert "reduce_scatter  ep" in ledger.format_summary()
    with pytest.raises(ValueError, match=r"unknown record fields \['colour'\]"):
        ledger.select(colour="red")


def test_not_recording_skips_all_bookkeeping() -> None:
    """With no active ledger, record_collective returns before touching torch.distributed (no group exists here)."""
    assert not torch.distributed.is_initialized()
    record_collective("all_gather", None, torch.ones(2), torch.ones(4), 8)  # would raise if it queried the group
    with CommLedger(topology=HardwareTopology.uniform(1, 1)), pytest.raises((RuntimeError, ValueError)):
        record_collective("all_gather", None, torch.ones(2), torch.ones(4), 8)


def test_concurrent_recording_loses_nothing() -> None:
    """Eight threads appending 500 records each (as autograd threads may) leave exactly 4000 records, sums intact."""
    with CommLedger(topology=HardwareTopology.uniform(2, 2)) as ledger:

        def work() -> None:
            for _ in range(500):
                ledger.add("all_to_all", [0, 1], 0, torch.int64, 8, 8, 3)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(ledger) == 4000 and ledger.total().bytes_sent == 12000
    assert ledger_module._ACTIVE == ()
