"""A shortened `make demo` end to end: prepare -> 4-process DP2xEP2 epso training via Lightning's own launcher ->
validation -> plots, with every file it promises on disk and both numbers of the bar printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
#: what the demo used to print that nobody could act on: Lightning's product tips and its pytree deprecation, W&B's
#: deprecated anonymous setting and a git root looked for before the run folder existed, DCP's warning on every
#: single-process load, Lightning's weights_only default on each save
KNOWN_NOISE = ("💡 Tip", "LeafSpec", "anonymous setting", "git root", "assuming the intent is to load", "weights_only")
#: warning lines the demo may print (each a user can act on); none today
EXPECTED_WARNINGS: tuple[str, ...] = ()


@pytest.mark.distributed
@pytest.mark.slow
def test_short_demo_end_to_end(tmp_path):
    """`python -m mula_lightning.demo` with 6 steps on 200 kB: exit code 0, the newest DualCheckpoint slot (a DCP
    directory) and a model-only checkpoint at step 6, the CSV log, the 4 plots, an offline W&B run, a progress line
    per step and the validation results printed once, and the unigram entropy, validation loss and checkpoint paths
    printed; none of the known noise, and no warning line that is not
    listed as expected."""
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "WANDB_MODE": "offline"}
    args = ["--output", str(out), "--steps", "6", "--val-every", "3", "--max-bytes", "200000", "--seq-len", "32"]
    args += ["--vocab", "512", "--min-gap=-100"]
    proc = subprocess.run(
        [sys.executable, "-m", "mula_lightning.demo", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entropy = float(re.search(r"unigram entropy\s*: ([\d.]+)", proc.stdout)[1])
    val_loss = float(re.search(r"validation loss\s*: ([\d.]+)", proc.stdout)[1])
    assert 3.0 < entropy < 6.3 and 0.0 < val_loss < 7.0  # ln(512) = 6.24 bounds the entropy
    run = out / "runs" / "demo" / "version_0"
    assert (out / "data-200000B-seq32-bpe512" / "manifest.json").is_file()
    assert (run / "metrics.csv").is_file()
    from mula_lightning.checkpoint.slots import resolve_last, slot_step

    ckpt = resolve_last(out / "checkpoints" / "dual")  # DualCheckpoint every 3 steps: the newest slot holds step 6
    assert slot_step(ckpt) == 6 and (ckpt / "state.ckpt" / ".metadata").is_file()  # epso writes DCP directories
    assert (out / "checkpoints" / "weights" / "step-00000006" / "model.safetensors").is_file()
    for name in ("loss.png", "lr.png", "throughput.png", "expert_load.png"):
        assert (run / "plots" / name).is_file(), name
    assert list((out / "runs" / "wandb").glob("offline-run-*"))
    assert str(ckpt) in proc.stdout and str(run / "plots" / "loss.png") in proc.stdout
    # progress while it trains (the output is no terminal: lines), once for the 4 processes, every step (the demo
    # logs every steps // 6 = 1), and the validation results when they come
    lines = proc.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == [f"step {s}/6" for s in range(1, 7)]
    assert [line.split(":")[0] for line in lines if line.startswith("validation at")] == [
        "validation at step 3",
        "validation at step 6",
    ]
    output = proc.stdout + proc.stderr
    for noise in KNOWN_NOISE:
        assert noise not in output, noise
    warned = [line for line in output.splitlines() if re.search(r"warn|deprecat", line, re.IGNORECASE)]
    assert all(any(expected in line for expected in EXPECTED_WARNINGS) for line in warned), warned
