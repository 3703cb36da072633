"""examples/fabric_pretrain.py runs as its docstring says: Fabric launches 2 processes (DP=1 x EP=2, epso), the loop
accumulates to the global batch, validates, logs a CSV `mula report` can plot and saves a sharded checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_fabric_example_trains_and_saves(tiny_data, tmp_path):
    """4 optimizer steps of 2 accumulated micro-batches: the log has the training and validation losses and
    tokens/s at the expected steps, the progress lines are printed once at those steps, the straggler monitor reports
    on both ranks every 2 steps, the checkpoint is a DCP directory, and `mula report` renders the loss plot."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "fabric"
    cmd = [sys.executable, str(ROOT / "examples" / "fabric_pretrain.py"), "--data_dir", str(tiny_data)]
    cmd += ["--accelerator", "cpu", "--devices", "2", "--ep_size", "2", "--max_steps", "4", "--micro_batch_size", "2"]
    cmd += ["--global_batch_size", "8", "--warmup_steps", "2", "--val_every", "2", "--log_every", "2"]
    cmd += ["--out_dir", str(out), "--straggler_every", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import csv

    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train_steps = [int(r["step"]) for r in rows if r["train/loss"]]
    val_steps = [int(r["step"]) for r in rows if r["val/loss"]]
    assert train_steps == [2, 4] and val_steps == [2, 4]
    assert all(float(r["train/items_per_sec"]) > 0 for r in rows if r["train/loss"])
    assert (out / "checkpoint" / ".metadata").is_file()
    import json

    reports = [json.loads(line) for line in (out / "stragglers.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world"]) for r in reports] == [(2, 2), (4, 2)] and all(r["step_ms"] > 0 for r in reports)
    # the progress lines of `mula fit` through ProgressMeter: steps 2 and 4 of 4, once for the 2 processes
    printed = [line for line in proc.stdout.splitlines() if line.startswith(("step ", "validation at"))]
    assert [line.split(" | ")[0].split(":")[0] for line in printed] == [
        "step 2/4", "validation at step 2", "step 4/4", "validation at step 4"]  # fmt: skip
    assert all(" | loss " in line and " tok/s (" in line for line in printed if line.startswith("step "))
    from mula_lightning.report import render_report

    assert (out / "plots" / "loss.png") in render_report(out)
