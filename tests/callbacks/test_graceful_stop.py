"""A run stopped from outside saves, says where it resumes and exits non-zero (issue 76, item 1).

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

from mula_lightning.checkpoint.slots import newest_marked_slot, slot_step
from mula_lightning.testing import run_distributed_test
from mula_lightning.testing.tiny_run import tiny_fit_config
from mula_lightning.utils.stop_request import StopRequest, signal_exit_code

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_DEBUG", None)
    return env


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
    exit status is 143 and stderr says which step and how to resume; ``--ckpt_path last`` then trains on from it."""
    config = tiny_fit_config(tiny_data, 400, every_n_train_steps=1000)
    config["trainer"]["devices"] = 2
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
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
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
