"""A `mula fit` config of the tiny MoE for runs that start processes (launcher tests, restart benchmarks).

Why one definition: the tests that compare a relaunched run with an uninterrupted one and the benchmark that
measures the time lost per restart must train the same model with the same checkpoint cadence; a copy in each would
drift. Small enough for CPU and gloo (2 layers, width 32, 4 experts top-2), with a DualCheckpoint every
``every_n_train_steps`` steps, a NaNDetector, a CSV log flushed every step (a killed attempt keeps its losses) and
``epso`` at EP=1 (any number of ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["TINY_MODEL_OVERRIDES", "run_mula_cli", "tiny_fit_config"]

TINY_MODEL_OVERRIDES = dict(
    num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2
)


def tiny_fit_config(data_dir: str | Path, max_steps: int, every_n_train_steps: int) -> dict[str, Any]:
    """The config dict (as a YAML would hold it); paths are relative to the run's working directory."""
    return {
        "seed_everything": 0,
        "model": {
            "model": "mula-tiny-moe",
            "model_overrides": dict(TINY_MODEL_OVERRIDES),
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 2,
        },
        "data": {"data_dir": str(data_dir), "micro_batch_size": 2},
        "trainer": {
            "accelerator": "cpu",
            "max_steps": max_steps,
            "log_every_n_steps": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": "runs",
            "strategy": {"class_path": "mula_lightning.strategies.EPSOStrategy", "init_args": {"ep_size": 1}},
            "callbacks": [
                {
                    "class_path": "mula_lightning.callbacks.DualCheckpoint",
                    "init_args": {"dirpath": "checkpoints/dual", "every_n_train_steps": every_n_train_steps},
                },
                {"class_path": "mula_lightning.callbacks.NaNDetector", "init_args": {"report_dir": "checkpoints/nan"}},
            ],
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": "runs", "name": "tiny", "flush_logs_every_n_steps": 1},
                }
            ],
        },
        "moe_stats": {"wandb_every_n_steps": 0},
    }


def run_mula_cli(cwd: str | Path, *args: str, timeout: float = 400) -> None:
    """Run ``mula <args>`` in a fresh interpreter in ``cwd`` (this package first on its path, W&B offline, one
    thread); raise an ``AssertionError`` with the end of its output when it does not exit 0."""
    src = str(Path(__file__).resolve().parents[2])  # the directory holding this mula_lightning package
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "mula_lightning.cli", *args]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
