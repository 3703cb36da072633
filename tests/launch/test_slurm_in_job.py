"""``mula launch --in-job --backend slurm`` over the fake srun: a failed rank is started again alone in a one-task
``srun --overlap`` step, numbered as the job's rank by the task shim, while every other rank keeps its process; a
hang's stopped rank is found and killed through srun on its node; a node SLURM reports failed moves to a buffer
node in-job; the task shim gives Lightning's SLURMEnvironment the job's numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mula_lightning.launch import Launcher, LaunchOptions
from mula_lightning.launch.slurm_task import task_env

HERE = Path(__file__).parent
SHIM = ["-m", "mula_lightning.launch.slurm_task"]
STEPS = 20


@pytest.fixture
def slurm_in_job(tmp_path, monkeypatch, fake_env, fake_command, fake_slurm, leftover_processes):
    """2 active + 1 buffer nodes x 2 ranks, --in-job over the fake srun; returns (exit code, report, srun lines)."""

    def run(fault, **env):
        monkeypatch.setenv("MULA_FAULT", fault)
        monkeypatch.setenv("FAKE_STEPS", str(STEPS))  # fake ranks have no collectives: survivors run on until told
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        options = LaunchOptions(
            command=fake_command, nnodes=2, nproc_per_node=2, buffer_nodes=1, backend="slurm", in_job=True,
            nodes=["node1", "node2", "node3"], report_dir=str(tmp_path / "launch"), grace_s=3.0, settle_s=0.5,
            poll_s=0.05, startup_timeout_s=60.0, hang_timeout_s=3.0, heartbeat_host="127.0.0.1",
        )  # fmt: skip
        launcher = Launcher(options)
        code = launcher.run()
        report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
        lines = [json.loads(line) for line in fake_slurm.read_text().splitlines()]
        assert leftover_processes(launcher.launch_id) == []
        return code, report, lines

    return run


def _steps(state, rank):
    return [line.split() for line in (state / f"steps.rank{rank}").read_text().splitlines()]


def _replacements(lines):
    """The one-task steps: (node, rank) of each."""
    out = []
    for line in lines:
        if "--overlap" in line and SHIM[1] in line:
            node = next(a for a in line if a.startswith("--nodelist=")).partition("=")[2]
            out.append((node, int(line[line.index("--rank") + 1])))
    return out


@pytest.mark.parametrize(
    ("fault", "victim", "how"),
    [("kill@step=3,rank=3", 3, "killed by SIGKILL"), ("exception@step=3,rank=0", 0, "exited with code 1")],
    ids=["kill", "exception of rank 0"],
)
def test_a_failed_rank_restarts_alone_in_an_overlap_step(slurm_in_job, fake_env, fault, victim, how):
    """One rank fails at step 3: attempt 1 is in-job, its only new process is a one-task `srun --overlap` step on the
    rank's node (the main step ran with --no-kill --kill-on-bad-exit=0), numbered as that rank; the three other
    ranks keep their process ids (from their heartbeats) and resume from the newest checkpoint in the same
    processes; the run ends in 2 attempts with every rank at its last step. Rank 0 too: the launcher hosts the store."""
    code, report, lines = slurm_in_job(fault)
    assert code == 0 and report["outcome"] == "succeeded", report["events"]
    first, second = report["attempts"]
    assert how in first["reason"] and second["started_by"] == "in-job" and second["replaced_ranks"] == [victim]
    main = lines[0]
    assert main[:5] == ["srun", "--nodes=2", "--nodelist=node1,node2", "--ntasks-per-node=2", "--ntasks=4"]
    assert {"--no-kill", "--kill-on-bad-exit=0"} <= set(main) and SHIM[1] in main
    assert _replacements(lines) == [(f"node{victim // 2 + 1}", victim)]
    kept = [r for r in range(4) if r != victim]
    assert -1 not in first["pids"] and [second["pids"][r] for r in kept] == [first["pids"][r] for r in kept]
    assert second["pids"][victim] != first["pids"][victim]
    for rank in range(4):  # fake ranks have no collectives: each resumes from the checkpoint file it finds then
        again = [int(s) for a, s, _ in _steps(fake_env, rank) if a == "1"]
        assert again and again == list(range(again[0], STEPS + 1)), (rank, again)
    host_of_victim = {h for a, _, h in _steps(fake_env, victim) if a == "1"}
    assert host_of_victim == {f"node{victim // 2 + 1}"}  # SLURMD_NODENAME of the overlap step


def test_a_stopped_rank_is_found_on_its_node_and_restarted_in_job(slurm_in_job, fake_env):
    """Rank 1 SIGSTOPped at step 3: after the hang timeout the launcher reads /proc/PID/stat of the silent ranks on
    their nodes through srun, finds rank 1 stopped, SIGKILLs it there (srun ... kill -KILL PID), and starts it
    alone in-job; the others keep their processes and the run finishes."""
    code, report, lines = slurm_in_job("hang@step=3,rank=1", FAKE_STEPS="40")  # the others run on for 3 s
    assert code == 0 and report["outcome"] == "succeeded", report["events"]
    first, second = report["attempts"]
    assert first["outcome"] == "hang" and "stopped on node1" in first["reason"] and second["replaced_ranks"] == [0, 1]
    probes = [line for line in lines if "cat" in line]
    assert probes and all("--overlap" in line for line in probes)
    assert any("kill" in line and "-KILL" in line for line in lines)
    assert [second["pids"][r] for r in (2, 3)] == [first["pids"][r] for r in (2, 3)]
    assert sorted(_replacements(lines)) == [("node3", 0), ("node3", 1)]  # node1 taken out: its ranks move


def test_a_node_slurm_reports_failed_moves_to_the_buffer_node_in_job(slurm_in_job, fake_env):
    """Both ranks of node2 killed with SLURM's "Node failure on node2": node2 is lost, ranks 2 and 3 start in
    one-task steps on the buffer node3 (node rank 1), ranks 0 and 1 keep their processes; the run finishes."""
    code, report, lines = slurm_in_job("kill@step=3,node=node2", FAKE_NODE_FAILURE="1")
    assert code == 0 and report["outcome"] == "succeeded", report["events"]
    first, second = report["attempts"]
    assert first["failed_hosts"] == ["node2"] and second["nodes"] == ["node1", "node3"]
    assert sorted(_replacements(lines)) == [("node3", 2), ("node3", 3)]
    assert [second["pids"][r] for r in (0, 1)] == [first["pids"][r] for r in (0, 1)]
    assert {h for a, _, h in _steps(fake_env, 3) if a == "1"} == {"node3"}


def test_the_task_shim_gives_lightning_the_jobs_numbers(tmp_path):
    """A replacement's task is task 0 of 1 for SLURM; after the shim, Lightning's SLURMEnvironment reads rank 5 of 8,
    local rank 1 on node 1 (4 per node) and validates; a main-step task keeps its numbers and a step laid out
    cyclically or of the wrong size is refused, naming the values. The shim writes its host and pid and execs the
    command in the same process."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7"}  # fmt: skip
    env = task_env(step, world_size=8, nproc_per_node=4, rank=5)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        slurm = SLURMEnvironment()
        assert (slurm.global_rank(), slurm.world_size(), slurm.local_rank(), slurm.node_rank()) == (5, 8, 1, 1)
        slurm.validate_settings(num_devices=4, num_nodes=2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("5", "8", "1", "1")
    main = {**step, "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_NODEID": "1"}
    assert task_env(main, 8, 4)["LOCAL_RANK"] == "2"
    with pytest.raises(ValueError, match="runs on node 0 of the step, not on node 1"):
        task_env({**main, "SLURM_NODEID": "0"}, 8, 4)
    with pytest.raises(ValueError, match="SLURM_NTASKS=8, but the launch has 16 ranks"):
        task_env(main, 16, 4)
    show = "import os, json; print(json.dumps([os.getpid(), os.environ['RANK'], os.environ['SLURM_PROCID']]))"
    out = subprocess.run(
        [sys.executable, *SHIM, "--control", str(tmp_path), "--world-size", "8", "--nproc-per-node", "4",
         "--rank", "5", "--key", "r5.2", "--", sys.executable, "-c", show],
        env={**os.environ, **step, "SLURMD_NODENAME": "nid9"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid, rank, procid = json.loads(out.stdout)
    assert (rank, procid) == ("5", "5")
    assert json.loads((tmp_path / "r5.2.pid").read_text()) == {"host": "nid9", "pid": pid}
