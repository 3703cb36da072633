"""The slurm backend with a fake ``srun`` and ``scontrol`` on PATH: the nodes come from the allocation, each attempt
is one srun step, a failed host named by srun's report lines is excluded from the next step's --nodelist."""

import json
import os
import sys
from pathlib import Path

from mula_lightning.launch import Launcher, LaunchOptions

HERE = Path(__file__).parent


def _tool(path, script):
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    path.chmod(0o755)


def test_srun_command_lines_exclude_the_failed_host(tmp_path, monkeypatch, fake_env, fake_command, leftover_processes):
    """SLURM_JOB_NODELIST=node[1-4], 3 active + 1 buffer: attempt 0 runs `srun --nodelist=node1,node2,node3`; node2
    is killed at step 3 (srun: "node2: task 1: Killed"), so attempt 1 runs `srun --nodelist=node1,node4,node3`, with
    the same command, and finishes; nothing is left running."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir / "srun", HERE / "fake_srun.py")
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "import sys; from mula_lightning.launch import expand_hostlist; '
        f'print(chr(10).join(expand_hostlist(sys.argv[3])))" "$@"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-4]")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setenv("MULA_FAULT", "kill@step=3,node=node2")
    monkeypatch.setenv("FAKE_STEPS", "5")
    launcher = Launcher(
        LaunchOptions(
            command=fake_command,
            nnodes=3,
            buffer_nodes=1,
            backend="slurm",
            report_dir=str(tmp_path / "launch"),
            grace_s=3.0,
            settle_s=0.5,
            poll_s=0.05,
        )
    )
    assert launcher.pool.nodes == ["node1", "node2", "node3", "node4"]  # from the (fake) scontrol
    assert launcher.run() == 0
    lines = [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    layout = ["--nodes=3", "--ntasks-per-node=1", "--ntasks=3"]
    assert lines == [
        ["srun", layout[0], "--nodelist=node1,node2,node3", *layout[1:], *fake_command],
        ["srun", layout[0], "--nodelist=node1,node4,node3", *layout[1:], *fake_command],
    ]
    report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
    assert report["attempts"][0]["failed_hosts"] == ["node2"]
    assert report["attempts"][0]["reason"] == "hard failure: node2 lost"
    assert leftover_processes(launcher.launch_id) == []
