"""examples/fabric_pretrain.py runs as its docstring says: Fabric launches 2 processes (DP=1 x EP=2, epso), the loop
accumulates to the global batch, validates, logs a CSV `mula report` can plot, saves crash-safe slots and a sharded
checkpoint; under `mula launch --in-job` (docs/launch.md, "Fabric scripts") a killed rank is restarted in-job, the
survivor keeps its process and every loss equals the straight run's."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mula_lightning.testing.doc_blocks import doc_block
from mula_lightning.testing.drill import launch_processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fabric_pretrain.py"
STEPS = 6
#: the tiny scale of both runs: 2 accumulated micro-batches of 2 per rank and step, a slot every 2 steps
TINY = ["--accelerator", "cpu", "--max_steps", str(STEPS), "--micro_batch_size", "2", "--global_batch_size", "8",
        "--warmup_steps", "2", "--val_every", "3", "--log_every", "1", "--straggler_every", "2",
        "--save_every", "2"]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"  # both runs: the same kernels' summation order
    env.pop("MULA_FAULT", None)
    return env


def _losses(out: Path) -> list[dict[int, str]]:
    """Per start of the script (``version_N``): step -> train/loss as written."""
    versions = sorted(out.glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    found = []
    for version in versions:
        with open(version / "metrics.csv", newline="") as fh:
            found.append({int(r["step"]): r["train/loss"] for r in csv.DictReader(fh) if r["train/loss"]})
    return found


@pytest.fixture(scope="module")
def straight_run(tiny_data, tmp_path_factory):
    """The example as its docstring launches it (Fabric starts 2 processes): (out_dir, completed process)."""
    workdir = tmp_path_factory.mktemp("fabric")
    out = workdir / "fabric"
    cmd = [sys.executable, str(EXAMPLE), "--data_dir", str(tiny_data), "--devices", "2", "--ep_size", "2", *TINY]
    proc = subprocess.run([*cmd, "--out_dir", str(out)], cwd=workdir, env=_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.distributed
def test_fabric_example_trains_and_saves(straight_run):
    """6 optimizer steps of 2 accumulated micro-batches: the log has the training loss and tokens/s of every step and
    the validation loss every 3, the progress lines are printed once at those steps, the straggler monitor reports
    on both ranks every 2 steps, the newest dual slot holds step 6, the last checkpoint is a DCP directory, and
    `mula report` renders the loss plot."""
    from mula_lightning.checkpoint.slots import resolve_last, slot_step
    from mula_lightning.report import render_report

    out, proc = straight_run
    with open(out / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(1, STEPS + 1))
    assert [int(r["step"]) for r in rows if r["val/loss"]] == [3, 6]
    assert all(float(r["train/items_per_sec"]) > 0 for r in rows if r["train/loss"])
    assert (out / "checkpoint" / ".metadata").is_file() and slot_step(resolve_last(out / "dual")) == STEPS
    reports = [json.loads(line) for line in (out / "stragglers.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world"]) for r in reports] == [(2, 2), (4, 2), (6, 2)]
    assert all(r["step_ms"] > 0 for r in reports)
    # the progress lines of `mula fit` through ProgressMeter: every step of 6, once for the 2 processes
    printed = [line.split(" | ")[0].split(":")[0] for line in proc.stdout.splitlines()
               if line.startswith(("step ", "validation at"))]  # fmt: skip
    assert printed == ["step 1/6", "step 2/6", "step 3/6", "validation at step 3", "step 4/6", "step 5/6",
                       "step 6/6", "validation at step 6"]  # fmt: skip
    assert (out / "version_0" / "plots" / "loss.png") in render_report(out)


def test_the_examples_entry_point_is_the_guides_wrapper():
    """docs/launch.md's Fabric entry point (run_loop_in_job around jsonargparse's CLI) is the example's own."""
    assert doc_block("launch-fabric-entry").text.strip() in EXAMPLE.read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_under_mula_launch_in_job_a_killed_rank_restarts_alone_and_the_losses_stay_bit_equal(
    straight_run, tiny_data, tmp_path, backend
):
    """docs/launch.md's Fabric launch (2 nodes x 1 rank, 1 buffer node; rank 1's node killed at step 4), at the tiny
    scale: the example's heartbeats let the launcher restart rank 1 in-job on the buffer node while rank 0 keeps its
    process; both resume from the slot of step 2 (the launch report's cost split says so) and every loss of both
    attempts, steps 3 and 4 done twice, equals the straight run's bit for bit; the run ends at step 6 and nothing of
    the launch is left running. Under ``--backend slurm`` too (tests/launch/fake_srun.py: tasks get SLURM's variables
    only): the ranks run through the task shim, Fabric reads SLURMEnvironment, rank 1 starts again in a one-task
    ``srun --overlap`` step on the buffer node and rejoins the store the launcher hosts. Locally a NaN follows in the
    restarted attempt (rank 0's gradients at step 5): the example's NonFiniteCheck stops both ranks before the
    update, names rank 0 on node0 in its report, and the full relaunch resumes from the slot of step 4, bit-equal."""
    words = shlex.split(doc_block("launch-in-job-fabric").text.replace("\\\n", " "))
    fault = next(w.split("=", 1)[1] for w in words if w.startswith("MULA_FAULT="))
    cut = words.index("--")
    own, command = words[words.index("launch") + 1 : cut], words[cut + 1 :]
    assert command[:2] == ["python", "../examples/fabric_pretrain.py"]
    command = [sys.executable, str(EXAMPLE), *command[2:], *TINY, "--out_dir", str(tmp_path / "fabric")]
    command[command.index("--data_dir") + 1] = str(tiny_data)
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", *own, "--hang-timeout", "60", "--grace", "2"]
    nan = backend == "local"  # a NaN in attempt 1 too (once: a relaunch's cost)
    env = {**_env(), "MULA_FAULT": fault + (";nan@step=5,rank=0,attempt=1" if nan else "")}
    if backend == "slurm":
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("srun", "scontrol"):
            (bin_dir / tool).write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT}/tests/launch/fake_{tool}.py "$@"\n')
            (bin_dir / tool).chmod(0o755)
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_SRUN_LOG=str(tmp_path / "srun.log"))
        argv += ["--backend", "slurm", "--nodes", "node0,node1,node2", "--heartbeat-host", "127.0.0.1"]
    proc = subprocess.run([*argv, "--", *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
    first, second = report["attempts"][:2]
    assert (second["started_by"], second["replaced_ranks"], second["nodes"]) == ("in-job", [1], ["node0", "node2"])
    assert second["pids"][0] == first["pids"][0] and second["pids"][1] != first["pids"][1]
    restart = report["restarts"][0]
    assert restart["path"] == "in-job" and restart["resumed_from_step"] == 2
    assert all(v is not None and v >= 0 for v in restart["cost_s"].values()), restart
    (reference,) = _losses(straight_run[0])
    before, after, *relaunched = _losses(tmp_path / "fabric")
    assert sorted(before) == [1, 2, 3] and before[3] == after[3]  # killed before step 4's forward
    if nan:
        texts = " ".join(e["text"] for e in report["events"])
        assert [a["started_by"] for a in report["attempts"]] == ["launch", "in-job", "relaunch"]
        assert "no in-job restart (a NaN ends every rank" in texts and report["restarts"][1]["resumed_from_step"] == 4
        nan_report = json.loads((tmp_path / "fabric" / "nan" / "nan_report.json").read_text())
        # rank 1 sees it too: rank 0's NaN reaches its experts' gradients through the all-to-all (one EP group)
        assert nan_report["step"] == 4 and nan_report["ranks"][0]["host"] == "node0" and 0 in nan_report["bad_ranks"]
        assert sorted(after) == [3, 4] and [sorted(r) for r in relaunched] == [[5, 6]]  # step 5 never applied
        assert {**before, **after, **relaunched[0]} == reference
    else:
        assert sorted(after) == [3, 4, 5, 6] and relaunched == [] and {**before, **after} == reference
    assert launch_processes(report["settings"]["launch_id"]) == []
    if backend == "slurm":
        steps = [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
        assert [s[:5] for s in steps if "--overlap" in s and "--rank" in s] == [
            ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node2"]
        ]
