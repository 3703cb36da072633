"""DP-scattered writes and load-once-and-broadcast reads of the epso checkpoints (4 processes, DP=2 x EP=2)."""

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from torch.distributed.checkpoint import filesystem

from mula_lightning.checkpoint.scattered import DPScatteredSavePlanner
from mula_lightning.models import MulaForCausalLM
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.fabric_run import tiny_moe_config
from mula_lightning.utils.safe_load import SafeFileSystemReader

DP, EP = 2, 2


def _save_then_load(rank, world_size, path):
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricEPSOStrategy(ep_size=EP))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(tiny_moe_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    fabric.backward(model(x, labels=x).loss)
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer})
    ep_group = fabric.strategy.topology.ep_group
    saved = {k: v.clone() for k, v in gather_expert_parallel_state_dict(model.module, ep_group).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # whatever this rank does not read must arrive by broadcast

    reads, opens = [], []
    read_data, create_stream = SafeFileSystemReader.read_data, filesystem.FileSystem.create_stream

    def counting_read(self, plan, planner):
        reads.extend(item.dest_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    def counting_open(self, file, mode):
        if "r" in mode and Path(str(file)).suffix == ".distcp":
            opens.append(Path(str(file)).name)
        return create_stream(self, file, mode)

    SafeFileSystemReader.read_data = counting_read  # the reader fabric.load uses
    filesystem.FileSystem.create_stream = counting_open
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    finally:
        SafeFileSystemReader.read_data, filesystem.FileSystem.create_stream = read_data, create_stream
    loaded = gather_expert_parallel_state_dict(model.module, ep_group)
    same = all(torch.equal(loaded[k], v) for k, v in saved.items())
    return {"reads": sorted(set(reads)), "opens": opens, "same": same, "keys": sorted(saved)}


def _writer(storage_path: str) -> int:
    return int(Path(storage_path).name[2:].split("_")[0])  # "__{rank}_{n}.distcp"


@pytest.mark.distributed
def test_dp_scattered_writes_and_one_reader_per_model_shard(tmp_path):
    """Saving at DP=2 x EP=2: the expert slices of EP rank m and the non-expert tensors hashed to shard m are
    written by DP index m % DP (ranks 0 and 3; ranks 1 and 2 write only their optimizer shards). Loading: rank 0
    reads the non-expert weights and its experts, rank 1 only its experts, ranks 2 and 3 no weights at all (they
    get them by broadcast: their NaN-filled weights come back exactly) and every rank reads its optimizer shard; each
    rank opens exactly the files holding what it reads, each once."""
    path = str(tmp_path / "ckpt")
    results = run_pooled_test(_save_then_load, DP * EP, path=path, timeout=240)
    assert all(r["same"] for r in results)

    metadata = dcp.FileSystemReader(path).read_metadata()
    planner = DPScatteredSavePlanner(DP, EP)
    writers: dict[int, set[str]] = {}
    for index, info in metadata.storage_data.items():
        writers.setdefault(_writer(info.relative_path), set()).add(index.fqn)
        if not index.fqn.startswith("model."):
            continue
        sizes = list(metadata.state_dict_metadata[index.fqn].chunks[0].sizes)
        if ".experts." in index.fqn:
            m = index.offset[0] // sizes[0]
            holders = [d * EP + m for d in range(DP)]  # the DP replicas of EP rank m
        else:
            m = zlib.crc32(index.fqn.encode()) % EP
            holders = list(range(DP * EP))
        expected = planner.writer_of(index.fqn, holders, list(index.offset), sizes)
        assert _writer(info.relative_path) == (m % DP) * EP + m == expected, index
    model_writers = {r for r, keys in writers.items() if any(k.startswith("model.") for k in keys)}
    assert model_writers == {0, 3}, writers
    print("\nwrites per rank:", {r: len(keys) for r, keys in sorted(writers.items())})

    model_keys = {f"model.{k}" for k in results[0]["keys"]}
    expert = {k for k in model_keys if ".experts." in k}
    read_model = [set(r["reads"]) & model_keys for r in results]
    assert read_model[0] == model_keys and read_model[1] == expert and read_model[2] == read_model[3] == set()
    assert all(any(k.startswith("optimizer.") for k in r["reads"]) for r in results)
    # files each rank opens, each once: rank 0's (the metadata item every rank reads), its own (its optimizer shard)
    # and the writers of the weights it reads (rank 0: the non-expert tensors of shards 0 and 1, written by ranks 0
    # and 3; rank 1: its experts, written by rank 3); ranks 2 and 3 read no weights
    opens = [sorted(r["opens"]) for r in results]
    assert opens == [
        ["__0_0.distcp", "__3_0.distcp"],
        ["__0_0.distcp", "__1_0.distcp", "__3_0.distcp"],
        ["__0_0.distcp", "__2_0.distcp"],
        ["__0_0.distcp", "__3_0.distcp"],
    ], opens
