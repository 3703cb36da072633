"""``mula fit`` with the pipeline example (PP=2 x EP=2 on 4 processes, 1F1B over 4 micro-batches), end to end, against
the same training without pipelining: the Trainer path of ``pipeline_step`` (Lightning's closure, gradient clipping,
the learning-rate schedule, MoEStats, DualCheckpoint) computes the same steps.

The reference is EP=2 on 2 processes with one sequence per micro-batch and 4 accumulated micro-batches: each
optimizer step sees the same 8 sequences (the sampler gives rank r of DP d sequences ``start + r x b ...``), averages
the same per-sequence losses (cross-entropy plus the MoE auxiliary losses of each one-sequence forward) and clips by
the same global norm, so the logged gradient norms and the weights of the step-4 checkpoints (each exported to
transformers, the pipelined one read back in one process) agree to float32 rounding.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mula_lightning.testing.tiny_run import run_mula_cli

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/mula-tiny-moe-pipeline.yaml"
TINY = {"num_layers": 4, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 32,
        "num_experts": 4, "top_k": 2}  # fmt: skip


def _logged(run: Path, key: str) -> list[float]:
    with open(run / "version_0" / "metrics.csv", newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_example_trains_like_the_same_steps_without_pipelining(tiny_data, tmp_path):
    """PP=2 x EP=2 (1F1B, 4 micro-batches of one sequence) and EP=2 with 4 accumulated one-sequence micro-batches,
    4 clipped steps each: equal gradient norms at every step and equal validation losses; their step-4
    DualCheckpoints export to transformers models with equal weights and logits, and the pipelined run's model-only
    checkpoint holds the same weights in bf16."""
    from transformers import AutoModelForCausalLM

    from mula_lightning.checkpoint.export import export_to_hf

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    config = yaml.safe_load((ROOT / CONFIG).read_text())
    for callback in config["trainer"]["callbacks"]:
        if "every_n_train_steps" in callback["init_args"]:
            callback["init_args"]["every_n_train_steps"] = 4
    (tmp_path / CONFIG).write_text(yaml.safe_dump(config))
    common = [
        "fit", "--config", CONFIG, "--data.data_dir", str(tiny_data), "--model.model_overrides", json.dumps(TINY),
        "--model.grad_clip", "0.5", "--model.clip_during_warmup", "true", "--trainer.max_steps", "4",
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2", "--data.val_micro_batch_size", "4",
        "--trainer.log_every_n_steps", "1",
    ]  # fmt: skip
    run_mula_cli(tmp_path, *common, "--data.micro_batch_size", "4")  # as shipped: 4 processes, PP=2 x EP=2, 1F1B
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copytree(tmp_path / "examples", reference / "examples")
    run_mula_cli(
        reference, *common, "--data.micro_batch_size", "1", "--trainer.accumulate_grad_batches", "4",
        "--trainer.devices", "2", "--trainer.strategy.init_args.pp_size", "1",
    )  # fmt: skip
    name = "mula-tiny-moe-pipeline"
    piped, plain = (
        _logged(tmp_path / "runs" / name, "train/grad_norm"),
        _logged(reference / "runs" / name, "train/grad_norm"),
    )
    assert len(piped) == 4 and min(piped) > 0.5  # every step clipped
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(plain), rtol=1e-4, atol=0)
    # validation after step 4 (the reference, counting micro-batches, also validated after steps 1-3): the same
    # 2 x 2 batches of 4, the loss the pipeline's last stage computed
    piped, plain = _logged(tmp_path / "runs" / name, "val/loss"), _logged(reference / "runs" / name, "val/loss")
    assert len(piped) == 1
    torch.testing.assert_close(torch.tensor(piped[-1]), torch.tensor(plain[-1]), rtol=1e-5, atol=0)

    # exported in this process by the function `mula export` runs (the journey's command)
    for cwd in (tmp_path, reference):
        export_to_hf(cwd / "checkpoints" / name / "dual", cwd / "out")
    # the model-only checkpoint of the pipelined run: each stage wrote its layers, bf16
    export_to_hf(tmp_path / "checkpoints" / name / "weights" / "step-00000004", tmp_path / "w")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    b = AutoModelForCausalLM.from_pretrained(reference / "out").eval()
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "w").eval()
    assert a.state_dict().keys() == b.state_dict().keys() == weights.state_dict().keys()
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[key], rtol=1e-4, atol=1e-5, msg=key)
        assert torch.equal(value.to(torch.bfloat16), weights.state_dict()[key].to(torch.bfloat16)), key
    x = torch.randint(0, a.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-4, atol=1e-4)
