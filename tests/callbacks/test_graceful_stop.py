"""A run stopped from outside saves, says where it resumes and exits non-zero (issue 76, item 1), and its model
summary counts the whole model (item 7).

The end-to-end test sends SIGTERM to rank 0 of a real 2-process ``mula fit`` (what ``kill PID`` does; the other rank
is not signalled) while it trains, and checks the exit status (143, not 0), the one line, the checkpoint of the step
it stopped after, and that ``--ckpt_path last`` resumes from that step. The unit tests pin the parts: the agreement
over ranks, the second Ctrl-C, and Lightning's ``SIGTERMException`` before the loop read as a stop, not a success.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from mula_lightning.checkpoint.slots import newest_marked_slot, slot_step
from mula_lightning.models import MulaConfig
from mula_lightning.testing import run_distributed_test
from mula_lightning.testing.tiny_run import TINY_MODEL_OVERRIDES, tiny_fit_config
from mula_lightning.utils.stop_request import StopRequest, signal_exit_code

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_DEBUG", None)
    return env


def _vocab(data_dir: Path) -> int:
    from mula_lightning.data.manifest import DataManifest

    return DataManifest.load(data_dir).resolve_vocab_size(None)


def _logged_steps(run_dir: Path) -> list[int]:
    rows = []
    for csv in sorted(run_dir.glob("version_*/metrics.csv")):
        lines = csv.read_text().splitlines()
        if not lines:
            continue
        header = lines[0].split(",")
        if "train/loss" not in header:
            continue
        cells = [r.split(",") for r in lines[1:] if r]
        rows += [int(c[header.index("step")]) for c in cells if c[header.index("train/loss")]]
    return rows


@pytest.mark.slow
def test_sigterm_to_rank_0_saves_every_rank_at_one_step_and_exits_143(tiny_data, tmp_path):
    """SIGTERM to rank 0 alone, mid-run: both ranks stop after the same step, the DualCheckpoint holds that step, the
    exit status is 143 and stderr says which step and how to resume; ``--ckpt_path last`` then says what it resumes
    from, keeps the checkpoint's learning-rate horizon (400) under a new max_steps, and trains on from that step."""
    config = tiny_fit_config(tiny_data, 400, every_n_train_steps=1000)
    config["trainer"]["devices"] = 2
    config["trainer"]["strategy"]["init_args"]["ep_size"] = 2  # each rank holds 2 of the 4 experts
    config["trainer"]["enable_model_summary"] = True
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "mula_lightning.cli", "fit", "--config", "fit.yaml"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(step >= 2 for step in _logged_steps(tmp_path / "runs" / "tiny")):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    # issue 76, item 7: the summary counts the whole model, not rank 0's 2 experts of 4
    whole = MulaConfig.from_name("mula-tiny-moe", **TINY_MODEL_OVERRIDES, vocab_size=_vocab(tiny_data)).num_params()
    total = [line for line in (out + err).splitlines() if "Total params" in line]
    assert len(total) == 1 and get_human_readable_count(whole) in total[0], (total, whole)
    slot = newest_marked_slot(tmp_path / "checkpoints" / "dual")
    assert slot is not None, err[-3000:]
    stopped = slot_step(slot)
    assert 3 <= stopped < 400
    line = [x for x in err.splitlines() if x.startswith("mula: SIGTERM received")]
    assert len(line) == 1, err[-3000:]  # rank 0 alone prints it
    assert f"stopped after step {stopped}, saved " in line[0] and "--ckpt_path last" in line[0], line
    assert line[0].endswith("exit code 143"), line
    assert max(_logged_steps(tmp_path / "runs" / "tiny")) == stopped - 1  # logged steps count from 0

    resume = [*argv, "--trainer.max_steps", str(stopped + 2), "--ckpt_path", "last"]
    done = subprocess.run(resume, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    relative = slot.relative_to(tmp_path)  # as the config names the folder
    assert f"mula fit: resuming from {relative} (step {stopped} of max_steps {stopped + 2})" in done.stderr  # item 4
    # item 2: the horizon followed max_steps (400); the resume with another keeps the checkpoint's, and says so
    assert "keeping the checkpoint's learning-rate schedule" in done.stderr and "would make it" in done.stderr
    assert slot_step(newest_marked_slot(tmp_path / "checkpoints" / "dual")) == stopped + 2
    newest = max(tmp_path.glob("runs/tiny/version_*"), key=lambda p: int(p.name.split("_")[1]))
    assert _logged_steps(newest.parent)[-2:] == [stopped, stopped + 1]


def _agree(rank, world_size):
    request = StopRequest(["SIGUSR1"])
    before = request.agreed()
    if rank == world_size - 1:
        request.request(signal.SIGUSR1)
    return before, request.agreed()


@pytest.mark.distributed
def test_a_stop_requested_on_one_rank_is_agreed_by_all():
    """Only the last of 3 ranks records a signal: every rank's agreement names it (and none did before)."""
    results = run_distributed_test(_agree, world_size=3)
    assert results == [(None, int(signal.SIGUSR1))] * 3


def test_the_handlers_record_the_first_signal_and_a_second_ctrl_c_stops_at_once():
    """A real SIGTERM and a SIGINT to this process are recorded, not raised; the handlers are put back after; a
    second SIGINT while the first is pending raises KeyboardInterrupt (stop now, unsaved)."""
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    assert request.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert request.received == signal.SIGTERM and request.agreed() == signal.SIGTERM
        ctrl_c = StopRequest(["SIGINT"])
        ctrl_c.request(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.request(signal.SIGINT)
    finally:
        request.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal_exit_code(signal.SIGTERM) == 143 and signal_exit_code(signal.SIGUSR1) == 138
    with pytest.raises(ValueError, match="SIGKILL"):
        StopRequest(["SIGKILL"])


def test_lightnings_sigterm_exception_before_the_loop_exits_143_not_0(monkeypatch, capsys):
    """Lightning's ``SIGTERMException`` (a ``SystemExit`` without a code: success to a shell) that ends a stage
    before the training loop is a stop: ``mula fit`` returns 143 and says so."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from mula_lightning import lightning_cli

    def stopped(*args, **kwargs):
        raise SIGTERMException()

    monkeypatch.setattr(lightning_cli, "build_cli", stopped)
    assert lightning_cli.main(["fit"]) == 143
    assert "SIGTERM received" in capsys.readouterr().err


def test_slurms_requeue_signal_requeues_the_job_after_the_stop(tmp_path, monkeypatch):
    """Under SLURM with Lightning's auto-requeue, a stop by the requeue signal (SIGUSR1) runs ``scontrol requeue JOB``
    on rank 0 as Lightning's own handler did (an array task by ``ARRAYJOB_TASK``); a SIGTERM, another rank, a run
    without auto-requeue and a failing scontrol do not requeue, and say so."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from mula_lightning.callbacks.graceful_stop import _requeue_slurm_job

    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n[ "$2" != "fail" ]\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    slurm = SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=True))
    trainer = SimpleNamespace(_accelerator_connector=slurm, is_global_zero=True)
    assert _requeue_slurm_job(trainer, signal.SIGTERM) is None
    assert _requeue_slurm_job(trainer, signal.SIGUSR1) == "SLURM job 4242 requeued"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert _requeue_slurm_job(trainer, signal.SIGUSR1) == "SLURM job 77_3 requeued"
    assert calls.read_text().splitlines() == ["requeue 4242", "requeue 77_3"]
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "fail")  # the fake scontrol fails for this job
    assert _requeue_slurm_job(trainer, signal.SIGUSR1).startswith("scontrol requeue fail failed (exit 1")
    other_rank = SimpleNamespace(_accelerator_connector=slurm, is_global_zero=False)
    assert _requeue_slurm_job(other_rank, signal.SIGUSR1) is None
    plain = SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=False))
    without = SimpleNamespace(_accelerator_connector=plain, is_global_zero=True)
    assert _requeue_slurm_job(without, signal.SIGUSR1) is None
