"""``mula report`` of a run folder joins the run's versions (issue 76, item 6): a resume continues the curves, a
validation adds its point, a new run from scratch in the same folder starts the join again."""

from pathlib import Path

from mula_lightning.cli import main as mula
from mula_lightning.report import find_run_logs, join_runs, read_columns


def _log(run: Path, version: int, rows: list[dict]) -> None:
    keys = ["epoch", "step", "train/loss", "train/lr", "val/loss"]
    folder = run / f"version_{version}"
    folder.mkdir(parents=True)
    lines = [",".join(keys)] + [",".join(str(row.get(k, "")) for k in keys) for row in rows]
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")


def _train(steps) -> list[dict]:
    return [{"epoch": 0, "step": s, "train/loss": 10.0 - s / 100, "train/lr": 1e-3} for s in steps]


def test_a_resume_and_a_validation_join_the_run_and_a_new_run_starts_again(tmp_path):
    """Versions 0-11 (numbered past 9, so read by number): 0 trains steps 4..199 (logged every 5) and died after
    step 219 had been logged; 1 resumed from step 200 (redoing 200-219) to 299; 2 is a ``mula validate``; the
    joined loss runs 4..299 once, the redone steps from the resume, with the validation's point at the end. A
    version 11 that trains from step 4 again is a new run: the join keeps it alone."""
    run = tmp_path / "runs" / "tiny"
    _log(run, 0, _train(range(4, 220, 5)))
    _log(run, 1, _train(range(204, 300, 5)))
    _log(run, 2, [{"epoch": 0, "step": 299, "val/loss": 4.5}])
    for version in range(3, 11):  # empty versions (a run that failed before logging) are skipped
        _log(run, version, [])
    assert [p.parent.name for p in find_run_logs(run)][:3] == ["version_0", "version_1", "version_2"]
    joined = join_runs([read_columns(p) for p in find_run_logs(run)])
    steps = [s for s, _ in joined["train/loss"]]
    assert steps == list(range(4, 300, 5))
    assert joined["val/loss"] == [(299, 4.5)]
    _log(run, 11, _train(range(4, 50, 5)))
    joined = join_runs([read_columns(p) for p in find_run_logs(run)])
    assert [s for s, _ in joined["train/loss"]] == list(range(4, 50, 5)) and "val/loss" not in joined


def test_mula_report_of_the_run_folder_plots_every_version_and_of_a_version_that_one(tmp_path, capsys):
    """The plots of ``runs/tiny`` go to ``runs/tiny/plots``; a version folder keeps its own ``plots``."""
    run = tmp_path / "runs" / "tiny"
    _log(run, 0, _train(range(4, 100, 5)))
    _log(run, 1, _train(range(104, 200, 5)))
    assert mula(["report", str(run)]) == 0
    assert str(run / "plots" / "loss.png") in capsys.readouterr().out
    assert mula(["report", str(run / "version_1")]) == 0
    assert str(run / "version_1" / "plots" / "loss.png") in capsys.readouterr().out
