"""`mula launch` around real `mula fit` runs (tiny MoE, 3 simulated nodes x 1 rank + 1 buffer, gloo, epso): a launch
that runs out of nodes keeps its last checkpoint and the requeued launch resumes from it on its first attempt; a
user's --ckpt_path is kept until the run saved its own slot; the guide's drill is a valid launch. Ranks aborted,
raising, stopped and a node killed in one in-job run: tests/launch/test_drill.py."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mula_lightning.testing.doc_blocks import doc_block
from mula_lightning.testing.drill import attempt_losses
from mula_lightning.testing.tiny_run import tiny_fit_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def _launch(
    workdir: Path, data_dir: Path, fault: str | None, hang_timeout: float = 120, extra: tuple[str, ...] = (),
    max_restarts: int = 3, steps: int = STEPS,
) -> tuple[int, dict, str]:  # fmt: skip
    """`mula launch --nnodes 3 --buffer-nodes 1 -- mula fit --config tiny.yaml [extra]` in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(tiny_fit_config(data_dir, steps, every_n_train_steps=2)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_FAULT", None)
    if fault:
        env["MULA_FAULT"] = fault
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", "--nnodes", "3", "--buffer-nodes", "1"]
    argv += ["--hang-timeout", str(hang_timeout), "--grace", "2", "--report-dir", "launch"]
    argv += ["--max-restarts", str(max_restarts), "--", "mula", "fit", "--config", "tiny.yaml", *extra]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=540)
    report = json.loads((workdir / "launch" / "launch_report.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def _doc_drill() -> tuple[str, list[str]]:
    """The drill of docs/launch.md: its MULA_FAULT and its `mula launch` options (before `--`)."""
    words = shlex.split(doc_block("launch-drill").text.replace("\\\n", " "))
    fault = next((w.split("=", 1)[1] for w in words if w.startswith("MULA_FAULT=")), "")
    return fault, words[words.index("launch") + 1 : words.index("--")]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_data):
    """The uninterrupted run: the same launch with no fault (one attempt, every step); (workdir, losses)."""
    workdir = tmp_path_factory.mktemp("launch_reference")
    code, report, output = _launch(workdir, tiny_data, None)
    assert code == 0, output[-3000:]
    assert len(report["attempts"]) == 1 and report["outcome"] == "succeeded"
    (losses,) = attempt_losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return workdir, losses


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's losses: optimizer step -> train/loss as written."""
    return reference_run[1]


def test_the_guides_drill_parses_as_a_launch_of_mula_fit():
    """docs/launch.md's drill: its MULA_FAULT parses (a node killed at step 5) and its options are `mula launch`'s
    with a buffer node for the node it kills (the kill itself runs in tests/launch/test_drill.py)."""
    from mula_lightning.launch.cli import build_parser
    from mula_lightning.utils.launch_env import parse_faults

    fault, options = _doc_drill()
    (kill,) = parse_faults(fault)
    args = build_parser().parse_args(options)
    assert (kill.kind, kill.step, kill.node) == ("kill", 5, "node1") and args.nnodes == 3 and args.buffer_nodes == 1


def test_out_of_nodes_keeps_the_last_checkpoint_and_the_requeued_launch_resumes_from_it(
    reference, tiny_data, tmp_path, leftover_processes
):
    """3 active + 1 buffer: node1 dies at step 3, its replacement node3 at step 5 of the relaunch; 2 healthy nodes are
    left for 3 needed: exit code 3 (EXIT_OUT_OF_NODES) with a message naming both, and the newest DualCheckpoint slot
    (step 4, written by the relaunch) is complete and passes its checksums. The launch is then started again on the
    same directories, as SLURM's requeue or a resubmission does (with its nodes back): its first attempt resumes from
    that slot (step 4), not from step 0, and every step's loss, before and after, equals the uninterrupted run's."""
    from mula_lightning.checkpoint.slots import resolve_last, slot_step

    code, report, output = _launch(tmp_path, tiny_data, "kill@step=3,node=node1;kill@step=5,node=node3,attempt=1")
    assert code == 3, output[-3000:]
    assert report["outcome"] == "out_of_nodes" and "3 needed, 2 healthy left of 4" in report["message"]
    assert "node1 (every rank vanished" in report["message"] and "node3 (every rank vanished" in report["message"]
    assert "mula launch: error: out of nodes" in output
    slot = resolve_last(tmp_path / "checkpoints" / "dual", verify_checksums=True)
    assert slot is not None and slot_step(slot) == 4
    assert leftover_processes(report["settings"]["launch_id"]) == []

    code, report, output = _launch(tmp_path, tiny_data, None)
    assert code == 0, output[-3000:]
    (attempt,) = report["attempts"]
    assert attempt["resumed_from_step"] == 4 and attempt["command"][-5:-4] == ["last"]
    for losses in attempt_losses(tmp_path):  # the three attempts (the second resumed from the step-2 slot)
        assert losses == {s: reference[s] for s in losses}
    assert sorted(attempt_losses(tmp_path)[-1]) == list(range(5, STEPS + 1))
    assert leftover_processes(report["settings"]["launch_id"]) == []


def test_user_ckpt_path_is_kept_until_the_run_saved_its_own_slot(reference_run, tiny_data, tmp_path):
    """A new run directory started from another run's slot (``--ckpt_path X``, step 8) whose node1 dies at step 9,
    before the run's first save (step 10): the relaunch starts from X again (step 8), not from scratch, and the
    losses of steps 9 and 10 equal the uninterrupted run's."""
    from mula_lightning.checkpoint.slots import SLOT_NAMES, resolve_last, slot_step

    workdir, reference = reference_run
    source = next(
        workdir / "checkpoints" / "dual" / n for n in SLOT_NAMES if slot_step(workdir / "checkpoints" / "dual" / n) == 8
    )
    code, report, output = _launch(
        tmp_path / "new", tiny_data, "kill@step=9,node=node1", extra=("--ckpt_path", str(source / "state.ckpt"))
    )
    assert code == 0, output[-3000:]
    first, second = report["attempts"]
    assert first["resumed_from_step"] == 8 and second["resumed_from_step"] == 8
    assert str(source / "state.ckpt") in second["command"]
    after = attempt_losses(tmp_path / "new")[-1]
    assert after == {9: reference[9], 10: reference[10]}
    assert slot_step(resolve_last(tmp_path / "new" / "checkpoints" / "dual")) == 10
