"""Model-only checkpoints written by every rank of a sharded run (no gather) against the gathered rank-0 path.

4 processes at epso DP=2 x EP=2 (expert slices, replicated tensors written DP-scattered): the files must be those the
gathering path writes (bf16 weights, config, trainer state, the transformers export), and a checkpoint split into
several files (index) must load back through ``load_model_only`` and ``restore_weights`` exactly.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from mula_lightning.callbacks.model_only_checkpoint import restore_weights, save_weights
from mula_lightning.models import MulaForCausalLM
from mula_lightning.models.checkpoint_io import load_model_only
from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.fabric_run import fabric_after_one_step, tiny_moe_config


def _write(rank, world_size, root):
    from mula_lightning.checkpoint.model_only_sharded import save_model_only_sharded
    from mula_lightning.checkpoint.scattered import DPScatteredSavePlanner
    from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
    from mula_lightning.parallel.state_dict import model_state_dict
    from mula_lightning.strategies import FabricEPSOStrategy

    fabric, model, _ = fabric_after_one_step(FabricEPSOStrategy(ep_size=2), world_size, rank)
    topology = fabric.strategy.topology
    meta = {"step": 1, "epoch": 0}

    def planner():
        return DPScatteredSavePlanner(topology.dp_size, topology.ep_size)

    state = model_state_dict(model.module, topology)
    save_model_only_sharded(state, planner(), tiny_moe_config(), f"{root}/sharded", torch.bfloat16, True, meta)
    save_model_only_sharded(
        state, planner(), tiny_moe_config(), f"{root}/split", None, False, meta, max_shard_bytes=4096
    )
    full = {k: v.clone() for k, v in gather_expert_parallel_state_dict(model.module, topology.ep_group).items()}
    if rank == 0:
        save_weights(full, f"{root}/gathered", tiny_moe_config(), meta, torch.bfloat16, hf_export=True)
    return full


def _files(directory):
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


@pytest.mark.distributed
def test_every_rank_writes_what_the_gathered_path_wrote_and_split_files_load(tmp_path):
    """The sharded save holds the same files as the gathered one, every tensor equal (bf16 weights and the
    transformers export), the same config and trainer state; a save split into several files has an index naming
    every tensor and loads (load_model_only, restore_weights) to the full fp32 weights; no staging left behind."""
    full = run_pooled_test(_write, 4, root=str(tmp_path))[0]
    sharded, gathered = tmp_path / "sharded", tmp_path / "gathered"
    assert _files(sharded) == _files(gathered)
    for rel in _files(gathered):
        if rel.endswith(".safetensors"):
            got, expected = load_file(str(sharded / rel)), load_file(str(gathered / rel))
            assert sorted(got) == sorted(expected), rel
            assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items()), rel
        elif rel.endswith(".json"):
            assert json.loads((sharded / rel).read_text()) == json.loads((gathered / rel).read_text()), rel

    split = tmp_path / "split"
    index = json.loads((split / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (split / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(full)
    loaded = load_model_only(split).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in full.items())
    fresh = MulaForCausalLM(tiny_moe_config())
    assert restore_weights(fresh, split) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in full.items())
