"""`mula launch` around real `mula fit` runs (tiny MoE, 3 simulated nodes x 1 rank + 1 buffer, gloo, epso): a node
killed at step 5 and a node producing NaN at step 7 are taken out, the buffer node takes their place, the run resumes
from the newest DualCheckpoint slot, and every step's loss equals an uninterrupted run's, bit for bit (CPU)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mula_lightning.testing.tiny_run import tiny_fit_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def _launch(workdir: Path, data_dir: Path, fault: str | None, hang_timeout: float = 120) -> tuple[int, dict, str]:
    """`mula launch --nnodes 3 --buffer-nodes 1 -- mula fit --config tiny.yaml` in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(tiny_fit_config(data_dir, STEPS, every_n_train_steps=2)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_FAULT", None)
    if fault:
        env["MULA_FAULT"] = fault
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", "--nnodes", "3", "--buffer-nodes", "1"]
    argv += ["--hang-timeout", str(hang_timeout), "--grace", "5", "--report-dir", "launch", "--"]
    argv += ["mula", "fit", "--config", "tiny.yaml"]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=540)
    report = json.loads((workdir / "launch" / "launch_report.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def _losses(workdir: Path) -> list[dict[int, str]]:
    """Per attempt (CSV version folder): optimizer step (1-based) -> train/loss as written (exact text)."""
    out = []
    versions = sorted((workdir / "runs" / "tiny").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        with open(version / "metrics.csv") as fh:
            out.append({int(r["step"]) + 1: r["train/loss"] for r in csv.DictReader(fh) if r.get("train/loss")})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    """The uninterrupted run: the same launch with no fault (one attempt, every step)."""
    workdir = tmp_path_factory.mktemp("launch_reference")
    code, report, output = _launch(workdir, tiny_data, None)
    assert code == 0, output[-3000:]
    assert len(report["attempts"]) == 1 and report["outcome"] == "succeeded"
    (losses,) = _losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.parametrize(
    ("fault", "bad_node", "resumed_from"),
    [
        ("kill@step=5,node=node1", "node1", 4),
        ("nan@step=7,node=node2", "node2", 6),
        ("hang@step=5,node=node1", "node1", 4),
    ],
    ids=["hard-kill", "soft-nan", "hang-sigstop"],
)
def test_failed_node_is_replaced_and_losses_equal_an_uninterrupted_run(
    reference, tiny_data, tmp_path, leftover_processes, fault, bad_node, resumed_from
):
    """The faulty node is taken out (vanished / named by NaNDetector / its rank stopped by SIGSTOP and silent past
    --hang-timeout 10 s, detected within the timeout + 10 s), the buffer node3 takes its place, the relaunch resumes
    from the newest slot (step 4 after the kill and the hang, step 6 after the NaN: the NaN step is never applied),
    the losses of every step, before and after the resume, equal the uninterrupted run's exactly, and no process of
    the launch is left (the stopped one and the ranks blocked in a collective with it included)."""
    hang = fault.startswith("hang")
    code, report, output = _launch(tmp_path, tiny_data, fault, hang_timeout=10 if hang else 120)
    assert code == 0, output[-3000:]
    first, second = report["attempts"]
    assert first["failed_hosts"] == [bad_node], first
    assert bad_node not in second["nodes"] and "node3" in second["nodes"]
    (restart,) = report["restarts"]
    assert restart["resumed_from_step"] == resumed_from, restart
    before, after = _losses(tmp_path)
    assert sorted(after) == list(range(resumed_from + 1, STEPS + 1))
    assert after == {s: reference[s] for s in after}
    assert before == {s: reference[s] for s in before} and max(before) >= resumed_from
    if "nan" in fault:
        assert json.loads((tmp_path / "checkpoints" / "nan" / "nan_report.json").read_text())["step"] == 6
    if hang:
        assert first["outcome"] == "hang", first
        detected = next(e["time"] for e in report["events"] if "failed at step" in e["text"])
        assert detected - first["failure_at"] <= 10 + 10
    assert leftover_processes(report["settings"]["launch_id"]) == []
    print(f"{fault}: time lost {restart['time_lost_s']} s, steps redone {restart['steps_redone']}")


def test_out_of_nodes_after_two_failures_keeps_the_last_checkpoint(tiny_data, tmp_path, leftover_processes):
    """3 active + 1 buffer: node1 dies at step 3, its replacement node3 at step 5 of the relaunch; 2 healthy nodes are
    left for 3 needed: exit code 3 (EXIT_OUT_OF_NODES) with a message naming both, and the newest DualCheckpoint slot
    (step 4, written by the relaunch) is complete and passes its checksums."""
    from mula_lightning.checkpoint.slots import resolve_last, slot_step

    code, report, output = _launch(tmp_path, tiny_data, "kill@step=3,node=node1;kill@step=5,node=node3,attempt=1")
    assert code == 3, output[-3000:]
    assert report["outcome"] == "out_of_nodes" and "3 needed, 2 healthy left of 4" in report["message"]
    assert "node1 (every rank vanished" in report["message"] and "node3 (every rank vanished" in report["message"]
    assert "mula launch: error: out of nodes" in output
    slot = resolve_last(tmp_path / "checkpoints" / "dual", verify_checksums=True)
    assert slot is not None and slot_step(slot) == 4
    assert leftover_processes(report["settings"]["launch_id"]) == []
