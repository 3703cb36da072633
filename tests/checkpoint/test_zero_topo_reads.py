"""What each rank of zero_topo writes and reads: its own pieces, nothing gathered, each file opened once.

4 processes in the ZeRO-3 layout (weights, gradients and optimizer states sharded over every rank, no replica): a
save writes every rank's primary chunk and optimizer ranges into its own file; a load at the same layout makes each
rank open exactly two files (its own, and rank 0's, which holds the metadata item every rank reads) and restore the
state exactly (parameters filled with NaN before the load come back equal).
"""

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.fabric_run import fabric_after_one_step


def _save_then_load(rank, world_size, path):
    from mula_lightning.parallel.zero.state_dict import full_model_state_dict
    from mula_lightning.strategies import FabricZeroTopoStrategy

    strategy = FabricZeroTopoStrategy(weight_size=4, grad_size=4, optimizer_size=4, block_size=16)
    fabric, model, optimizer = fabric_after_one_step(strategy, world_size, rank)
    engine = fabric.strategy.engine
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = full_model_state_dict(engine, model.module)
    # the state elements of each unit's optimizer chunk (bucket padding is not state and is not saved)
    owned = [(u, s.local_start, s.numel) for u in engine.units for s in u.buf.segments]
    moments = [u.exp_avg[start : start + n].clone() for u, start, n in owned]
    for u, start, n in owned:
        u.exp_avg[start : start + n].fill_(float("nan"))
    for u in engine.units:
        u.primary.fill_(float("nan"))
    opens = []
    create_stream = filesystem.FileSystem.create_stream

    def counting_open(self, file, mode):
        if "r" in mode and Path(str(file)).suffix == ".distcp":
            opens.append(Path(str(file)).name)
        return create_stream(self, file, mode)

    filesystem.FileSystem.create_stream = counting_open
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    finally:
        filesystem.FileSystem.create_stream = create_stream
    loaded = full_model_state_dict(engine, model.module)
    same = all(torch.equal(loaded[k], v) for k, v in saved.items())
    same_moments = all(torch.equal(u.exp_avg[start : start + n], m) for (u, start, n), m in zip(owned, moments))
    return {"opens": sorted(opens), "same": same and same_moments}


@pytest.mark.distributed
def test_each_rank_reads_its_own_pieces_and_opens_two_files(tmp_path):
    """ZeRO-3 over 4 ranks: after a save, weights and moments overwritten with NaN come back exactly from a load in
    which rank r opens only ``__r_0.distcp`` (its primary chunk and optimizer ranges) and ``__0_0.distcp`` (the
    metadata item), each once: one reader per shard, no rank reading another's weights."""
    path = str(tmp_path / "ckpt")
    results = run_pooled_test(_save_then_load, 4, path=path)
    assert all(r["same"] for r in results)
    opens = [r["opens"] for r in results]
    assert opens == [sorted({"__0_0.distcp", f"__{r}_0.distcp"}) for r in range(4)], opens


def test_replicas_are_written_once_spread_over_their_holders():
    """The zero_topo planner's deduplication: an item every rank holds goes to rank 0, an item one rank holds stays
    there, and the pieces two replicas hold (the 3-level layout's weight pairs) are written once each, by both
    holders in turn across many pieces."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from mula_lightning.checkpoint.scattered import SpreadReplicasSavePlanner

    def item(fqn, offset=None):
        return WriteItem(index=MetadataIndex(fqn, offset), type=WriteItemType.BYTE_IO)

    shared = [item("optimizer.step"), item("metadata")]
    pieces = [item(f"model.w{i}", torch.Size([i * 8])) for i in range(40)]  # held by ranks 1 and 3
    own = [item(f"model.r{r}", torch.Size([0])) for r in range(4)]
    plans = [SavePlan(shared + [own[r]] + (pieces if r in (1, 3) else [])) for r in range(4)]
    kept = SpreadReplicasSavePlanner()._dedup_save_plans(plans)
    written = {r: {i.index.fqn for i in plan.items} for r, plan in enumerate(kept)}
    assert {"optimizer.step", "metadata"} <= written[0] and all("metadata" not in written[r] for r in (1, 2, 3))
    assert all(f"model.r{r}" in written[r] for r in range(4))
    by_1 = {f for f in written[1] if f.startswith("model.w")}
    by_3 = {f for f in written[3] if f.startswith("model.w")}
    assert not by_1 & by_3 and len(by_1 | by_3) == 40 and min(len(by_1), len(by_3)) >= 10
