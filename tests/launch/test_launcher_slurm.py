"""The slurm backend with a fake ``srun`` and ``scontrol`` on PATH: the nodes come from the allocation, each attempt
is one srun step, a failed host named by srun's report lines is excluded from the next step's --nodelist."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from mula_lightning.launch import Launcher, LaunchOptions
from mula_lightning.launch.slurm_backend import parse_srun_line

HERE = Path(__file__).parent


def _tool(path, script):
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    path.chmod(0o755)


def test_srun_command_lines_exclude_the_failed_host(tmp_path, monkeypatch, fake_env, fake_command, fake_slurm,
                                                    leftover_processes):  # fmt: skip
    """SLURM_JOB_NODELIST=node[1-4], 3 active + 1 buffer: attempt 0 runs `srun --nodelist=node1,node2,node3`; node2
    is killed at step 3 (srun: "node2: task 1: Killed"), so attempt 1 runs `srun --nodelist=node1,node4,node3`, with
    the same command, and finishes; nothing is left running."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-4]")
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
    assert report["attempts"][0]["reason"].startswith("hard failure: node2 lost (every rank killed by a SIGKILL")
    assert leftover_processes(launcher.launch_id) == []


def _slurm_launch(tmp_path, monkeypatch, fake_command, fault, **env):  # with the fake_slurm fixture
    """3 active + 1 buffer over the fake srun; returns (exit code, report, srun command lines)."""
    monkeypatch.setenv("MULA_FAULT", fault)
    monkeypatch.setenv("FAKE_STEPS", "5")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    options = LaunchOptions(
        command=fake_command, nnodes=3, buffer_nodes=1, backend="slurm", nodes=["node1", "node2", "node3", "node4"],
        report_dir=str(tmp_path / "launch"), grace_s=3.0, settle_s=0.5, poll_s=0.05,
    )  # fmt: skip
    code = Launcher(options).run()
    report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    return code, report, [next(a for a in line if a.startswith("--nodelist=")) for line in lines]


@pytest.mark.usefixtures("fake_slurm")
def test_srun_abort_and_segfault_wordings_make_a_suspect_not_a_lost_node(tmp_path, monkeypatch, fake_env, fake_command):
    """srun's "task 1: Aborted (core dumped)" (NCCL's watchdog on a healthy rank): node2 is a suspect after the first
    (the relaunch keeps it) and is taken out only when it fails first again in that relaunch; the second relaunch runs
    on the buffer node. Before, any wording srun printed for a signal read as a lost node (the other wordings:
    test_parse_srun_line_knows_the_real_wordings)."""
    fault = "abort@step=2,node=node2;abort@step=5,node=node2,attempt=1"
    code, report, nodelists = _slurm_launch(tmp_path, monkeypatch, fake_command, fault)
    assert code == 0
    first, second, _ = report["attempts"]
    assert first["failed_hosts"] == [] and first["suspect_hosts"] == ["node2"] and "SIGABRT" in first["reason"]
    assert second["failed_hosts"] == ["node2"]
    assert nodelists == ["--nodelist=node1,node2,node3"] * 2 + ["--nodelist=node1,node4,node3"]


@pytest.mark.usefixtures("fake_slurm")
def test_srun_node_failure_line_is_a_lost_node_even_amid_invalid_bytes(tmp_path, monkeypatch, fake_env, fake_command):
    """1 MB of stderr with invalid UTF-8 bytes (and a 50 kB line without a newline) before srun's "Node failure on
    node2": the reader keeps reading (the step does not block on a full pipe), the node-failure line takes node2 out
    at once and the relaunch runs on node4."""
    code, report, nodelists = _slurm_launch(
        tmp_path, monkeypatch, fake_command, "kill@step=2,node=node2", FAKE_NODE_FAILURE="1", FAKE_SRUN_NOISE="1"
    )
    assert code == 0
    first, second = report["attempts"]
    assert first["failed_hosts"] == ["node2"] and "SLURM node failure" in first["reason"]
    assert nodelists == ["--nodelist=node1,node2,node3", "--nodelist=node1,node4,node3"]


@pytest.mark.parametrize(
    ("line", "host", "code", "node_failure"),
    [
        ("srun: error: nid001: task 3: Exited with exit code 86", "nid001", 86, False),
        ("srun: error: nid001: tasks 0-3: Killed", "nid001", -9, False),
        ("srun: error: nid002: task 1: Aborted (core dumped)", "nid002", -6, False),
        ("srun: error: nid002: task 1: Segmentation fault (core dumped)", "nid002", -11, False),
        ("srun: error: nid002: task 1: Bus error", "nid002", -7, False),
        ("srun: error: nid002: task 1: Something new in SLURM 27", "nid002", 1, False),
        ("srun: error: Node failure on nid007", "nid007", -9, True),
    ],
)
def test_parse_srun_line_knows_the_real_wordings(line, host, code, node_failure):
    """Each srun report line maps to its host, exit code (-signal) and node-failure flag; an unknown wording is an
    ordinary failure (code 1, wording kept), never a lost node."""
    event = parse_srun_line(line)
    assert (event.host, event.code, event.node_failure) == (host, code, node_failure)
    if code == 1:
        assert event.detail == "Something new in SLURM 27" and "Something new" in event.describe()


@pytest.mark.usefixtures("fake_slurm")
def test_a_hang_under_slurm_is_blamed_on_the_rank_that_fell_behind(tmp_path, monkeypatch, fake_env, fake_command):
    """Under SLURM no process state is visible from the launcher: node2's rank stops at step 2 (SIGSTOP), the others
    run on and report higher steps; after --hang-timeout the heartbeats say who fell behind, so node2 becomes a
    suspect (not a lost node) and the relaunch on the same nodes finishes."""
    monkeypatch.setenv("FAKE_STEPS", "4")
    monkeypatch.setenv("MULA_FAULT", "hang@step=2,node=node2")
    options = LaunchOptions(
        command=fake_command, nnodes=3, buffer_nodes=1, backend="slurm", nodes=["node1", "node2", "node3", "node4"],
        report_dir=str(tmp_path / "launch"), grace_s=3.0, settle_s=0.5, poll_s=0.05, hang_timeout_s=2.0,
    )  # fmt: skip
    assert Launcher(options).run() == 0
    report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
    first, second = report["attempts"]
    assert first["outcome"] == "hang" and first["suspect_hosts"] == ["node2"] and first["failed_hosts"] == []
    # step 1 or 0: its beat of step 1 may still sit in its sender thread when SIGSTOP arrives
    assert re.search(r"rank 1 stopped first \(step [01], the others reached 4\) on node2", first["reason"])
    assert second["nodes"] == ["node1", "node2", "node3"] and second["outcome"] == "succeeded"


@pytest.mark.parametrize(
    ("kill_on_node_fail", "expected"),
    [("1", "was submitted without --no-kill"), ("0", None), (None, "cannot tell whether SLURM job 4242")],
)
def test_no_kill_is_checked_with_scontrol(tmp_path, monkeypatch, kill_on_node_fail, expected):
    """A job without --no-kill (SLURM ends the allocation when a node fails, so no buffer node is ever used) gets a
    warning naming the fix; with --no-kill none; a SLURM that cannot answer gets a warning that says so."""
    from mula_lightning.launch.hostlist import no_kill_warning

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir / "scontrol", HERE / "fake_scontrol.py")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    if kill_on_node_fail is not None:
        monkeypatch.setenv("FAKE_KILL_ON_NODE_FAIL", kill_on_node_fail)
    else:
        monkeypatch.delenv("FAKE_KILL_ON_NODE_FAIL", raising=False)
    warning = no_kill_warning(env)
    if expected is None:
        assert warning is None
    else:
        assert expected in warning and "sbatch --no-kill" in warning


@pytest.mark.usefixtures("fake_slurm")
def test_a_node_slurm_reports_down_is_lost_whatever_its_rank_printed(tmp_path, monkeypatch, fake_env, fake_command):
    """node2's rank exits 1 (alone that makes node2 a suspect), but SLURM reports node2 DOWN+NOT_RESPONDING after the
    failure: an unreachable node is hard evidence, node2 is taken out at once and the relaunch runs on node4."""
    code, report, nodelists = _slurm_launch(
        tmp_path, monkeypatch, fake_command, "exception@step=2,node=node2", FAKE_DOWN_NODES="node2"
    )
    assert code == 0
    first, second = report["attempts"]
    assert first["failed_hosts"] == ["node2"] and "node2 (State=DOWN+NOT_RESPONDING) unreachable" in first["reason"]
    assert nodelists == ["--nodelist=node1,node2,node3", "--nodelist=node1,node4,node3"]


def test_unreachable_nodes_reads_scontrol_states(tmp_path, monkeypatch):
    """Only the nodes whose State has DOWN / NOT_RESPONDING (or a trailing *) count; without scontrol: no evidence."""
    from mula_lightning.launch.hostlist import unreachable_nodes

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir / "scontrol", HERE / "fake_scontrol.py")
    monkeypatch.setenv("FAKE_DOWN_NODES", "n2,n5")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert unreachable_nodes(["n1", "n2", "n3"], env) == {"n2": "DOWN+NOT_RESPONDING"}
    assert unreachable_nodes(["n1", "n2"], {"PATH": str(tmp_path / "empty")}) == {}
