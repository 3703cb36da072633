"""``mula fit`` with the MoE-parallel-folding example (tensor + sequence parallel attention folded with expert
parallel MoE layers on 4 processes), end to end: it trains, its dual and model-only checkpoints are written from the
ranks' shards, and both export to transformers as the same model."""

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
CONFIG = "examples/configs/mula-tiny-moe-folded.yaml"
TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 32,
        "num_experts": 4, "top_k": 2}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_folded_example_trains_and_exports(tiny_data, tmp_path):
    """The folded YAML as shipped (TP=2 + SP, EP=4 on 4 processes), shrunk to a tiny model and 4 steps: the loss is
    logged finite at every step, the DualCheckpoint slot and the model-only checkpoint of step 4 both export, and the
    two exports hold the same weights, whose logits in transformers equal those of the checkpoint read back."""
    from transformers import AutoModelForCausalLM

    from mula_lightning.checkpoint.export import export_to_hf, read_checkpoint

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    config = yaml.safe_load((ROOT / CONFIG).read_text())
    for callback in config["trainer"]["callbacks"]:  # both checkpoints at the last of 4 steps
        if "every_n_train_steps" in callback["init_args"]:
            callback["init_args"]["every_n_train_steps"] = 4
    (tmp_path / CONFIG).write_text(yaml.safe_dump(config))
    run_mula_cli(
        tmp_path, "fit", "--config", CONFIG, "--data.data_dir", str(tiny_data), "--data.micro_batch_size", "4",
        "--model.model_overrides", json.dumps(TINY), "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
        "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
    )  # fmt: skip
    with open(tmp_path / "runs" / "mula-tiny-moe-folded" / "version_0" / "metrics.csv", newline="") as f:
        losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(losses) == [0, 1, 2, 3] and all(math.isfinite(v) for v in losses.values()), losses

    checkpoints = tmp_path / "checkpoints" / "mula-tiny-moe-folded"
    # exported in this process by the function `mula export` runs (the command itself is the README journey's)
    export_to_hf(checkpoints / "dual", tmp_path / "out" / "dual")
    export_to_hf(checkpoints / "weights" / "step-00000004", tmp_path / "out" / "weights")
    dual = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "dual").eval()
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "weights").eval()
    assert dual.state_dict().keys() == weights.state_dict().keys()
    for name, value in dual.state_dict().items():  # the model-only checkpoint holds the same weights in bf16
        assert torch.equal(value.to(torch.bfloat16), weights.state_dict()[name].to(torch.bfloat16)), name
    model, _ = read_checkpoint(checkpoints / "dual")
    x = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(dual(x).logits, model.eval()(x).logits, rtol=1e-5, atol=1e-5)
