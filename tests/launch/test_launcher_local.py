"""The attempt loop on simulated local nodes with fake ranks (no training): each failure kind is detected, the
right nodes are taken out, the relaunch resumes, nothing is left running, and the report says what happened."""

import json
import os
import subprocess
import sys
import time

import pytest

from mula_lightning.launch import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OUT_OF_NODES,
    EXIT_RESTARTS_EXHAUSTED,
    Launcher,
    LaunchOptions,
)
from mula_lightning.utils.launch_env import parse_nan_line


@pytest.fixture
def launch(tmp_path, monkeypatch, fake_env, fake_command, leftover_processes):
    """Run the launcher in this process over fake ranks; returns (exit code, report) and checks no process is left."""

    def run(fault, **kwargs):
        if fault:
            monkeypatch.setenv("MULA_FAULT", fault)
        settings = dict(grace_s=2.0, settle_s=0.5, poll_s=0.05, startup_timeout_s=60.0)
        options = LaunchOptions(command=fake_command, report_dir=str(tmp_path / "launch"), **{**settings, **kwargs})
        launcher = Launcher(options)
        code = launcher.run()
        report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
        assert leftover_processes(launcher.launch_id) == []  # nothing of the launch is left running
        return code, report

    return run


def _steps(state, rank):
    return [line.split() for line in (state / f"steps.rank{rank}").read_text().splitlines()]


def test_killed_node_is_replaced_by_the_buffer_node_and_the_run_resumes(launch, fake_env):
    """3 nodes x 2 ranks + 1 buffer; both ranks of node0 (rank 0 writes the fake checkpoint) SIGKILLed at step 5:
    node0 is taken out, node3 takes its place (node rank 0), the run resumes from the step-4 checkpoint and
    finishes; the report names node0, the resumed step, the time lost and its parts."""
    code, report = launch("kill@step=5,node=node0", nnodes=3, buffer_nodes=1, nproc_per_node=2)
    assert code == 0 and report["outcome"] == "succeeded"
    first, second = report["attempts"]
    assert first["nodes"] == ["node0", "node1", "node2"] and first["failed_hosts"] == ["node0"]
    assert "hard failure: node0 lost" in first["reason"]
    assert second["nodes"] == ["node3", "node1", "node2"] and second["outcome"] == "succeeded"
    (restart,) = report["restarts"]
    assert restart["failed_hosts"] == ["node0"] and restart["resumed_from_step"] == 4
    assert restart["time_lost_s"] is not None and restart["time_lost_s"] > 0
    cost = restart["cost_s"]  # the settle time, the relaunch, a reload of nothing, the steps past 4 done again
    assert cost["detection"] >= 0.5 and cost["restart"] > 0 and cost["reload"] >= 0 and cost["recompute"] >= 0, cost
    assert cost["recompute"] > 0 or restart["steps_redone"] == 0, (cost, restart)
    assert abs(cost["detection"] + cost["restart"] + cost["reload"] + cost["recompute"] - cost["total"]) < 0.01
    assert [s for a, s, h in _steps(fake_env, 2) if a == "1"] == [str(s) for s in range(5, 9)]
    assert {h for a, _, h in _steps(fake_env, 1) if a == "1"} == {"node3"}
    texts = [e["text"] for e in report["events"]]
    assert any("taken out: node0" in t for t in texts) and any("time lost" in t for t in texts)


@pytest.mark.parametrize("stuck", [2, 0], ids=["survivor", "rank 0"])
def test_a_survivor_stuck_in_the_broken_attempt_gets_a_new_process_in_the_restart(launch, fake_env, monkeypatch, stuck):
    """--in-job, 2 nodes x 2 ranks: rank 3 killed at step 3 is restarted in-job; survivor rank 2 (or rank 0) then ends
    with the stuck exit code (its main thread could not leave the broken attempt) before attempt 1 formed. It gets a
    new process in attempt 1 as well (the event says why), the other survivors keep theirs and the run finishes in 2
    attempts: rank 0 too, since the launcher hosts the job's store (no rank's process holds it)."""
    monkeypatch.setenv("FAKE_STUCK_RANK", str(stuck))
    code, report = launch("kill@step=3,rank=3", nnodes=2, buffer_nodes=1, nproc_per_node=2, in_job=True)
    assert code == 0 and report["outcome"] == "succeeded"
    first, second = report["attempts"][:2]
    texts = " ".join(e["text"] for e in report["events"])
    assert len(report["attempts"]) == 2 and second["started_by"] == "in-job" and second["outcome"] == "succeeded"
    assert second["replaced_ranks"] == sorted([stuck, 3])
    assert f"rank {stuck} could not leave attempt 0 (exit 75" in texts
    kept = [r for r in range(4) if r not in (stuck, 3)]
    assert [second["pids"][r] for r in kept] == [first["pids"][r] for r in kept]
    assert not {second["pids"][r] for r in (stuck, 3)} & set(first["pids"])


def test_a_lost_store_relaunches_the_job_on_a_new_one(tmp_path, monkeypatch, fake_env, fake_command,
                                                     leftover_processes):  # fmt: skip
    """--in-job: the launcher hosts the job's store in a process of its own (rank 0 holds nothing of the job). That
    process killed while the ranks train is a store loss: the attempt fails naming it, no in-job restart is tried,
    the relaunch runs on a new store (another port), the run finishes, and neither store is left running."""
    import threading

    monkeypatch.setenv("FAKE_STEP_S", "0.4")
    options = LaunchOptions(command=fake_command, report_dir=str(tmp_path / "launch"), nnodes=2, in_job=True,
                            grace_s=2.0, settle_s=0.5, poll_s=0.05, startup_timeout_s=60.0)  # fmt: skip
    launcher = Launcher(options)
    ports = []

    def kill_the_store():
        deadline = time.monotonic() + 60
        while launcher.store.proc is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if launcher.store.wait_ready(60):
            ports.append(launcher.store.port)
            launcher.store.proc.kill()

    killer = threading.Thread(target=kill_the_store)
    killer.start()
    code = launcher.run()
    killer.join()
    report = json.loads((tmp_path / "launch" / "launch_report.json").read_text())
    texts = " ".join(e["text"] for e in report["events"])
    assert code == 0 and [a["started_by"] for a in report["attempts"]] == ["launch", "relaunch"], texts
    assert f"the job's store on 127.0.0.1:{ports[0]} ended" in report["attempts"][0]["reason"]
    assert "no in-job restart (the job's store was lost)" in texts and "a new one serves attempt 1" in texts
    assert launcher.store.starts == 2 and launcher.store.port != ports[0] and launcher.store.proc is None
    assert leftover_processes(launcher.launch_id) == []


def test_nan_on_one_node_makes_it_a_suspect_and_twice_in_a_row_takes_it_out(launch, fake_env, tmp_path):
    """Exit code 86 with one host's record in MULA_NAN_EVENTS_FILE (what NaNDetector does): node0 is only a suspect
    (a bad sample or a transient may have caused it) and the relaunch keeps it; a NaN on node0 again in that relaunch
    (at another step) takes it out and the third attempt runs on the buffer node in its place. failed_hosts.txt lists
    the host taken out, one name per line, once: ``srun --exclude=$(paste -sd, failed_hosts.txt)`` reads it."""
    code, report = launch("nan@step=3,node=node0;nan@step=6,node=node0,attempt=1", nnodes=3, buffer_nodes=1)
    assert code == 0
    first, second, third = report["attempts"]
    assert first["suspect_hosts"] == ["node0"] and first["failed_hosts"] == []
    assert first["reason"].startswith("soft failure: NaN at step 2 on 1 rank on node0")
    assert second["nodes"] == ["node0", "node1", "node2"] and second["failed_hosts"] == ["node0"]
    assert third["nodes"] == ["node3", "node1", "node2"] and third["outcome"] == "succeeded"
    hosts = tmp_path / "launch" / "failed_hosts.txt"
    assert hosts.read_text() == "node0\n"
    exclude = subprocess.run(["paste", "-sd,", str(hosts)], capture_output=True, text=True, check=True).stdout
    assert f"--exclude={exclude.strip()}" == "--exclude=node0"
    events = (tmp_path / "launch" / "nan_events.jsonl").read_text().splitlines()
    assert {(r.host, r.step) for r in map(parse_nan_line, events)} == {("node0", 2), ("node0", 5)}


def test_nan_on_every_rank_is_a_divergence_and_evicts_nobody(launch, fake_env):
    """Every rank non-finite at the same step (a diverging run): the model or the data, not hardware; the launch
    stops at once with EXIT_DIVERGED, no node is taken out or suspected, the checkpoint is left alone."""
    code, report = launch("nan@step=3", nnodes=3, buffer_nodes=1)
    assert code == EXIT_DIVERGED == 5 and report["outcome"] == "diverged"
    (attempt,) = report["attempts"]
    assert attempt["failed_hosts"] == [] and attempt["suspect_hosts"] == []
    assert "divergence" in report["message"] and "node0, node1, node2" in report["message"]
    assert (fake_env / "checkpoint").read_text() == "2"


def test_a_nan_that_replays_on_the_replacement_node_is_the_data(launch, fake_env):
    """rank 0 NaN at step 3 twice in a row on node0 takes it out; the buffer node2 in its place then hits NaN at the
    same step for the same rank (the same batch: the data order is replayed): a divergence verdict, not a third
    eviction."""
    faults = "nan@step=3,rank=0;nan@step=3,rank=0,attempt=1;nan@step=3,rank=0,attempt=2"
    code, report = launch(faults, nnodes=2, buffer_nodes=2, max_restarts=5)
    assert code == EXIT_DIVERGED
    first, second, third = report["attempts"]
    assert second["failed_hosts"] == ["node0"] and third["nodes"] == ["node2", "node1"]
    assert third["failed_hosts"] == [] and "again on other nodes" in third["reason"]


def test_a_rank_aborted_once_relaunches_on_the_same_nodes(launch, fake_env):
    """SIGABRT (what PyTorch's NCCL watchdog does to healthy ranks after a peer's error, also a native library's
    abort) is not proof of a lost node: node1 is a suspect, the relaunch runs on the same nodes and finishes; an
    abort first on the same node again would take it out (the exception test shows the chain)."""
    code, report = launch("abort@step=3,node=node1", nnodes=2, buffer_nodes=1)
    assert code == 0
    first, second = report["attempts"]
    assert first["failed_hosts"] == [] and first["suspect_hosts"] == ["node1"] and "SIGABRT" in first["reason"]
    assert second["nodes"] == ["node0", "node1"] and second["outcome"] == "succeeded"


def test_stopped_rank_is_detected_as_a_hang_within_the_timeout(launch, fake_env, monkeypatch):
    """A rank stopped with SIGSTOP never exits: its silence past --hang-timeout (3 s) is detected within the timeout
    + 10 s, its node (stopped process) is taken out, every process is killed (a stopped one too) and the run
    finishes on the buffer node."""
    monkeypatch.setenv("FAKE_STEPS", "6")
    code, report = launch("hang@step=3,node=node1,local_rank=0", nnodes=2, buffer_nodes=1, hang_timeout_s=3.0)
    assert code == 0
    first, second = report["attempts"]
    assert first["outcome"] == "hang" and first["failed_hosts"] == ["node1"] and "silent" in first["reason"]
    stopped_at = float((fake_env / "stopped_at").read_text())
    detected = next(e["time"] for e in report["events"] if "failed after step" in e["text"])
    # silence counts from the last beat the launcher received: the stopped rank's step-2 beat may still sit in its
    # sender thread when SIGSTOP arrives, so it may be the step-1 beat, one fake step (FAKE_STEP_S) before the stop
    step_s = float(os.environ["FAKE_STEP_S"])
    assert 3.0 - step_s <= detected - stopped_at <= 3.0 + 10.0
    assert second["nodes"] == ["node0", "node2"]


def test_a_node_that_stays_a_straggler_is_replaced_at_the_next_relaunch(launch, fake_env, tmp_path):
    """Straggler reports (rank 0 appends one per step to MULA_STRAGGLERS_FILE, as StragglerDetection does) name
    node1 from step 2 on: after 3 reports in a row the launcher calls node1 slow and the run goes on; the exception at
    step 7 causes a relaunch, which runs on the buffer node in node1's place and lists node1 in failed_hosts.txt. With
    --straggler-reports 0 the reports are not read and node1 stays."""
    fault = "slow@step=2,node=node1,ms=1;exception@step=7,rank=0"
    code, report = launch(fault, nnodes=2, buffer_nodes=1)
    assert code == 0
    first, second = report["attempts"]
    assert first["straggler_hosts"] == ["node1"] and first["failed_hosts"] == []
    assert "RuntimeError" in first["reason"] or "exit" in first["reason"]
    assert second["nodes"] == ["node0", "node2"] and second["outcome"] == "succeeded"
    assert (tmp_path / "launch" / "failed_hosts.txt").read_text() == "node1\n"
    texts = [e["text"] for e in report["events"]]
    slow = next(t for t in texts if "node1 is slow" in t)
    assert "straggler in 3 reports in a row (last at step 4" in slow and "a buffer node replaces it" in slow
    assert any(t.startswith("node1 is replaced by a buffer node") for t in texts)
    (fake_env / "checkpoint").unlink()  # the same run again, from its start
    code, report = launch(fault, nnodes=2, buffer_nodes=1, straggler_reports=0)
    assert code == 0 and [a["nodes"] for a in report["attempts"]] == [["node0", "node1"]] * 2


def test_out_of_nodes_stops_with_its_exit_code_and_leaves_the_checkpoint(launch, fake_env):
    """2 nodes + 1 buffer; node0 dies in attempt 0 and its replacement node2 in attempt 1: no healthy node is left
    for a third attempt, the launch exits with EXIT_OUT_OF_NODES naming the failed nodes, and the last checkpoint
    (step 4, written in attempt 1) is untouched."""
    code, report = launch(
        "kill@step=3,node=node0;kill@step=5,node=node2,attempt=1",
        nnodes=2,
        buffer_nodes=1,
    )
    assert code == EXIT_OUT_OF_NODES == 3 and report["outcome"] == "out_of_nodes"
    assert "2 needed, 1 healthy left of 3" in report["message"]
    assert "node0 (every rank vanished" in report["message"] and "node2 (every rank vanished" in report["message"]
    assert (fake_env / "checkpoint").read_text() == "4"


def test_ordinary_errors_restart_in_place_then_exhaust_the_restarts(launch, fake_env):
    """An exception on rank 0 (exit 1) is a rank failure: node0 is only suspect and the relaunch keeps it; failing
    first again takes it out; with --max-restarts 1 the launch then stops with EXIT_RESTARTS_EXHAUSTED."""
    code, report = launch(
        "exception@step=2,rank=0;exception@step=2,rank=0,attempt=1",
        nnodes=2,
        buffer_nodes=1,
        max_restarts=1,
    )
    assert code == EXIT_RESTARTS_EXHAUSTED == 4 and report["outcome"] == "restarts_exhausted"
    first, second = report["attempts"]
    assert first["suspect_hosts"] == ["node0"] and first["failed_hosts"] == []
    assert second["nodes"] == ["node0", "node1"]  # kept: the error may be the program's
    assert second["failed_hosts"] == ["node0"]  # first to fail twice in a row
    assert "exited with code 1" in first["reason"]


def test_a_start_that_never_reports_is_a_hang_after_the_startup_timeout(launch, monkeypatch):
    """Ranks that never send a heartbeat (a rendezvous that does not complete) are a hang once --startup-timeout
    passes; with --max-restarts 0 the launch then stops with EXIT_RESTARTS_EXHAUSTED, every rank stopped."""
    monkeypatch.setenv("FAKE_SILENT", "1")
    code, report = launch(None, nnodes=2, max_restarts=0, startup_timeout_s=2.0)
    assert code == EXIT_RESTARTS_EXHAUSTED
    (attempt,) = report["attempts"]
    assert attempt["outcome"] == "hang" and "no rank reported within the startup timeout (2 s)" in attempt["reason"]


def test_a_rank_that_reports_the_end_but_never_exits_is_a_hang(launch, monkeypatch):
    """Rank 0 beats "end" and then never exits (a teardown stuck in a collective): a hang once --hang-timeout passes
    since its last beat, not a launcher waiting forever."""
    monkeypatch.setenv("FAKE_HANG_AFTER_END", "1")
    monkeypatch.setenv("FAKE_STEPS", "3")
    code, report = launch(None, nnodes=2, max_restarts=0, hang_timeout_s=2.0)
    assert code == EXIT_RESTARTS_EXHAUSTED
    (attempt,) = report["attempts"]
    assert attempt["outcome"] == "hang" and "ranks 0 reported the end of training but did not exit" in attempt["reason"]


def test_hang_timeout_zero_turns_detection_off(launch, monkeypatch):
    """--hang-timeout 0: a command that never sends a heartbeat runs to its end (4 s, past a 1 s startup timeout)."""
    monkeypatch.setenv("FAKE_SILENT_S", "4")
    code, report = launch(None, nnodes=2, max_restarts=0, hang_timeout_s=0.0, startup_timeout_s=1.0)
    assert code == 0 and report["outcome"] == "succeeded"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nnodes", "0", "--", "true"], "--nnodes (0) must be at least 1"),
        (["--nnodes", "2"], "no command to launch"),
        (["--nnodes", "2", "--nodes", "a", "--", "true"], "only 1 are available (a)"),
        (["--nnodes", "1", "--hang-timeout", "-1", "--", "true"], "--hang-timeout (-1.0) must be >= 0 (0 = off)"),
        (["--nnodes", "1", "--collective-timeout", "-5", "--", "true"], "--collective-timeout (-5.0) must be >= 0"),
        (["--nnodes", "1", "--backend", "slurm", "--", "true"], "SLURM_JOB_NODELIST is not set"),
    ],
)
def test_bad_options_get_one_line_and_exit_1(tmp_path, repo_root, args, words):
    """`mula launch` refuses a bad option with one line naming it (exit 1), before starting anything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(repo_root / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "mula_lightning.cli", "launch", "--report-dir", str(tmp_path / "r"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mula launch: error:") and words in lines[0], proc.stderr
    assert not (tmp_path / "r").exists()


def test_stopping_the_launcher_stops_every_rank(tmp_path, repo_root, fake_env, fake_command, leftover_processes):
    """SIGTERM to `mula launch` (what scancel does) while ranks run: every rank is stopped, the launcher exits with
    EXIT_INTERRUPTED (130) and the report says so."""
    env = {**os.environ, "PYTHONPATH": str(repo_root / "src"), "FAKE_STEPS": "1000"}
    report_dir = tmp_path / "launch"
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", "--nnodes", "2", "--nproc-per-node", "2"]
    argv += ["--grace", "2", "--report-dir", str(report_dir), "--", *fake_command]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(fake_env.glob("steps.rank*"))) < 4:
        time.sleep(0.1)  # every rank has taken a step
    assert len(list(fake_env.glob("steps.rank*"))) == 4
    proc.terminate()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED == 130, output
    report = json.loads((report_dir / "launch_report.json").read_text())
    assert report["outcome"] == "interrupted" and "SIGTERM" in report["message"]
    assert leftover_processes(report["settings"]["launch_id"]) == []
