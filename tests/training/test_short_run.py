"""A short ``mula fit`` leaves everything behind: the final step in the DualCheckpoint and ModelOnlyCheckpoint folders
and in ``metrics.csv`` whatever the intervals, so ``mula report`` plots it; a run that logged nothing is explained."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from mula_lightning import cli as mula_cli
from mula_lightning.checkpoint.slots import resolve_last, slot_step


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _fit(config: dict, tmp_path: Path) -> Path:
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(config))
    assert mula_cli.main(["fit", "--config", str(path)]) == 0
    return tmp_path / "runs" / "tiny" / "version_0"


def test_three_steps_with_long_intervals_leave_checkpoints_and_metrics(tiny_config, tmp_path, capsys):
    """3 steps, logging every 50 and both checkpoint callbacks every 1000: the dual slot and the model-only directory
    hold step 3, metrics.csv has the last step's training loss (row index 2, once), and ``mula report`` plots it."""
    tiny_config["trainer"].update(log_every_n_steps=50, max_steps=3, val_check_interval=None, limit_val_batches=0)
    tiny_config["trainer"]["callbacks"] = [
        {
            "class_path": "mula_lightning.callbacks.DualCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "dual"), "every_n_train_steps": 1000},
        },
        {
            "class_path": "mula_lightning.callbacks.ModelOnlyCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "weights"), "every_n_train_steps": 1000},
        },
    ]
    run = _fit(tiny_config, tmp_path)
    slot = resolve_last(tmp_path / "dual")
    assert slot is not None and slot_step(slot) == 3
    assert (tmp_path / "weights" / "step-00000003" / "model.safetensors").is_file()
    losses = [r for r in _rows(run) if r.get("train/loss")]
    assert [r["step"] for r in losses] == ["2"]
    capsys.readouterr()
    assert mula_cli.main(["report", str(run)]) == 0
    assert "loss.png" in capsys.readouterr().out


def test_the_last_step_is_not_logged_twice(tiny_config, tmp_path):
    """With ``log_every_n_steps`` dividing the steps (1 here), Lightning wrote the last row itself: one row per step,
    the final one not repeated."""
    tiny_config["trainer"].update(log_every_n_steps=1, max_steps=3, val_check_interval=None, limit_val_batches=0)
    steps = [r["step"] for r in _rows(_fit(tiny_config, tmp_path)) if r.get("train/loss")]
    assert steps == ["0", "1", "2"]


def test_report_says_what_is_missing(tmp_path, capsys):
    """A run folder without a CSV log names what it holds and why a CSV may be missing; a CSV without training or
    validation metrics says the run stopped before its first logged step."""
    run = tmp_path / "runs" / "x" / "version_0"
    run.mkdir(parents=True)
    (run / "hparams.yaml").write_text("lr: 1\n")
    assert mula_cli.main(["report", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    assert "holds x/version_0/hparams.yaml but no CSV log" in err and "CSVLogger" in err
    (run / "metrics.csv").write_text("epoch,step,train/items_per_sec\n")
    assert mula_cli.main(["report", str(run)]) == 1
    assert "no training or validation metrics" in capsys.readouterr().err
