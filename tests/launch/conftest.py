"""Helpers of the launcher tests: the fake rank's command and the processes a launch left behind."""

import os
import sys
from pathlib import Path

import pytest

from mula_lightning.testing.drill import launch_processes

FAKE_RANK = Path(__file__).with_name("fake_rank.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """The fake rank's environment (inherited by the launched processes) and its state folder."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("FAKE_STATE_DIR", str(state))
    monkeypatch.setenv("FAKE_STEP_S", "0.15")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'src'}")
    monkeypatch.delenv("MULA_FAULT", raising=False)
    return state


@pytest.fixture
def fake_command() -> list[str]:
    """The command of a fake rank (this interpreter running ``fake_rank.py``)."""
    return [sys.executable, str(FAKE_RANK)]


@pytest.fixture
def leftover_processes():
    """``launch_id -> live PIDs`` of that launch (must be empty once the launcher returns)."""
    return launch_processes


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """``srun`` and ``scontrol`` first on PATH: fake_srun.py and fake_scontrol.py (this interpreter); returns the file
    where the fake srun logs each command line (``FAKE_SRUN_LOG``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_RANK.with_name(f"fake_{tool}.py")} "$@"\n')
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))
    return tmp_path / "srun.log"


@pytest.fixture
def repo_root() -> Path:
    return ROOT
