"""ModelOnlyCheckpoint under ``zero_topo``: the engine frees every parameter's storage between steps (the values live
in its shards), so the callback must gather through the engine, never read ``module.state_dict()`` (that read freed
memory: a SIGSEGV, or safetensors refusing the storage-less tensors). 2 processes, the recipes' reliability
callbacks together."""

import pytest
import torch
from lightning.pytorch import Trainer
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader

from mula_lightning.callbacks import DualCheckpoint, ModelOnlyCheckpoint, NaNDetector
from mula_lightning.checkpoint.slots import SLOT_NAMES, read_marker
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.lightning_module import MetaCausalLM

STEPS = 3


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _run(rank, world_size, root):
    from mula_lightning.strategies import ZeroTopoStrategy

    data = [torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(8)]
    callbacks = [
        NaNDetector(f"{root}/nan"),
        DualCheckpoint(f"{root}/dual", every_n_train_steps=1),
        ModelOnlyCheckpoint(f"{root}/weights", every_n_train_steps=1, dtype=None),
    ]
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=ZeroTopoStrategy(block_size=16), max_steps=STEPS,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(MetaCausalLM(_config()), DataLoader(torch.stack(data), batch_size=None))


@pytest.mark.distributed
def test_model_only_checkpoints_under_zero_topo_hold_the_full_weights(tmp_path):
    """Every step's model-only checkpoint under zero_topo (2 ranks) holds the full, trained weights: at the last
    step exactly the DualCheckpoint's model tensors (a separate gather path: DCP shards), and not the initial ones."""
    run_pooled_test(_run, 2, root=str(tmp_path), timeout=240)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"step-{s:08d}" for s in range(1, STEPS + 1)]
    newest = max(SLOT_NAMES, key=lambda n: read_marker(tmp_path / "dual" / n)["step"])
    assert read_marker(tmp_path / "dual" / newest)["step"] == STEPS
    dcp_to_torch_save(tmp_path / "dual" / newest / "state.ckpt", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    weights = load_file(str(tmp_path / "weights" / f"step-{STEPS:08d}" / "model.safetensors"))
    assert set(weights) == {k.removeprefix("model.") for k in full}
    assert all(torch.equal(weights[k], full[f"model.{k}"]) for k in weights)
    initial = init_weights(MulaForCausalLM(_config()), seed=0).state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert not torch.equal(weights["lm_head.weight"], initial["lm_head.weight"])
    first = load_file(str(tmp_path / "weights" / "step-00000001" / "model.safetensors"))
    assert not torch.equal(first["lm_head.weight"], weights["lm_head.weight"])
