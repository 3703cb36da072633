"""Fixtures of the training-path tests: a tiny LightningCLI config over `tiny_data` (tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest

TINY_MODEL = dict(
    num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2
)


@pytest.fixture(scope="session")
def other_tokenizer_data(tmp_path_factory):
    """The same text prepared with another tokenizer (a 384-token BPE): its tokenizer.json must be refused."""
    from mula_lightning.data import prepare

    out = tmp_path_factory.mktemp("training_data_other") / "stdlib"
    prepare(output=str(out), seq_len=32, train_tokenizer=384, max_bytes=100_000, workers=0, progress=False)
    return out


@pytest.fixture
def tiny_config(tiny_data, tmp_path):
    """A `mula fit` config dict (as a YAML would hold it) for one CPU process and a few steps."""
    config = {
        "seed_everything": 0,
        "model": {
            "model": "mula-tiny-moe",
            "model_overrides": copy.deepcopy(TINY_MODEL),
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 2,
        },
        "data": {"data_dir": str(tiny_data), "micro_batch_size": 4},
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 4,
            "log_every_n_steps": 1,
            "val_check_interval": 4,
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny"},
                }
            ],
        },
        "moe_stats": {"wandb_every_n_steps": 0},
        "throughput": {"window_size": 2},
    }
    return config
