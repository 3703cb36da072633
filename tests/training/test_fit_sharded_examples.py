"""``mula fit`` with the sharded CPU examples, end to end from their YAML: the MoE-parallel-folding one (tensor +
sequence parallel attention folded with expert-parallel MoE layers under ``epso``, 4 processes) and the ``zero_topo``
one (3-level hierarchical ZeRO with EP=2 inside it, 4 processes as 2 nodes x 1 GPU of 2 GCDs). Each trains, writes its
dual and model-only checkpoints from the ranks' shards, and both export to transformers as the same, whole model."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mula_lightning.testing.tiny_run import run_mula_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["mula-tiny-moe-folded", "mula-tiny-moe-zero-topo"]
TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 32,
        "num_experts": 4, "top_k": 2}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_sharded_example_trains_and_exports(tiny_data, tmp_path, name):
    """The YAML as shipped, shrunk to a tiny model and 2 steps: the loss is logged finite at every step, the
    DualCheckpoint slot and the model-only checkpoint of step 2 both export with every expert (not one rank's slice),
    the two exports hold the same weights, and their logits in transformers equal those of the checkpoint read back."""
    from transformers import AutoModelForCausalLM

    from mula_lightning.checkpoint.export import export_to_hf, read_checkpoint

    config_path = f"examples/configs/{name}.yaml"
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    config = yaml.safe_load((ROOT / config_path).read_text())
    for callback in config["trainer"]["callbacks"]:  # both checkpoints at the last of 2 steps
        if "every_n_train_steps" in callback["init_args"]:
            callback["init_args"]["every_n_train_steps"] = 2
    (tmp_path / config_path).write_text(yaml.safe_dump(config))
    run_mula_cli(
        tmp_path, "fit", "--config", config_path, "--data.data_dir", str(tiny_data), "--data.micro_batch_size", "4",
        "--model.model_overrides", json.dumps(TINY), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
    )  # fmt: skip
    with open(tmp_path / "runs" / name / "version_0" / "metrics.csv", newline="") as f:
        losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(losses) == [0, 1] and all(math.isfinite(v) for v in losses.values()), losses

    checkpoints = tmp_path / "checkpoints" / name
    # exported in this process by the function `mula export` runs (the journey's command)
    export_to_hf(checkpoints / "dual", tmp_path / "out" / "dual")
    export_to_hf(checkpoints / "weights" / "step-00000002", tmp_path / "out" / "weights")
    dual = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "dual").eval()
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "weights").eval()
    assert dual.state_dict().keys() == weights.state_dict().keys()
    for key, value in dual.state_dict().items():  # the model-only checkpoint holds the same weights in bf16
        assert torch.equal(value.to(torch.bfloat16), weights.state_dict()[key].to(torch.bfloat16)), key
    model, _ = read_checkpoint(checkpoints / "dual")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == TINY["num_experts"]
    x = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(dual(x).logits, model.eval()(x).logits, rtol=1e-5, atol=1e-5)
