"""A failure after training started keeps its traceback: `mula fit` with a ValueError raised at step 3 inside
``training_step`` prints the traceback (rank-prefixed, once) and the one-line summary, exit code 1; bad input found
before launch keeps its one line (tests/test_cli.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mula_lightning.testing.tiny_run import tiny_fit_config

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sys
from mula_lightning.lightning_module import MulaLM

original = MulaLM.training_step

def training_step(self, batch, batch_idx):
    if self.trainer.global_step == 2:
        raise ValueError("a bad value at step 3")
    return original(self, batch, batch_idx)

MulaLM.training_step = training_step
from mula_lightning.cli import main
sys.exit(main(["fit", "--config", sys.argv[1]]))
"""


@pytest.mark.slow
def test_value_error_inside_training_step_reaches_the_terminal_with_its_traceback(tiny_data, tmp_path):
    """The traceback names training_step and the ValueError, every line starts with "[rank 0] ", it is printed once,
    and the last line is the one-line summary; exit code 1."""
    config = tiny_fit_config(tiny_data, 6, every_n_train_steps=100)
    config["trainer"]["strategy"] = "auto"
    config["trainer"]["logger"] = False
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("MULA_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "fit.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    traceback = [line for line in lines if line.startswith("[rank 0] ")]
    assert traceback[0] == "[rank 0] Traceback (most recent call last):", proc.stderr[-3000:]
    assert any("in training_step" in line for line in traceback)
    assert traceback[-1] == "[rank 0] ValueError: a bad value at step 3"
    assert sum(line == "[rank 0] Traceback (most recent call last):" for line in lines) == 1
    assert lines[-1] == "mula fit: error: rank 0: ValueError: a bad value at step 3"
