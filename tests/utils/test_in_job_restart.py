"""The rank's side of an in-job restart: which errors are a peer's failure, where a rejoin resumes from, the wait for
the launcher's announcement, and the cut of a broken attempt's connections (the job's store and the heartbeat
connection kept)."""

import json
import socket
import sys
import threading
import time

import pytest

from mula_lightning.utils.in_job_restart import (
    announced_attempt,
    cut_connections,
    in_job_file,
    in_job_op_timeout,
    in_job_timeout,
    is_peer_failure,
    job_sockets,
    resume_args,
    tcp_sockets,
)
from mula_lightning.utils.run_failure import RunFailure

GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:933"


def test_peer_failures_are_told_from_a_ranks_own_errors():
    """gloo's closed and reset connections and an aborted NCCL communicator are a peer's failure, also as the cause
    of another error or inside the RunFailure that mula fit raises; the rank's own errors (an injected exception, a
    full disk, a bad value) are not, so that rank ends and the launcher replaces it."""
    assert is_peer_failure(RuntimeError(GLOO_CLOSED))
    assert is_peer_failure(RuntimeError("Read error [127.0.0.1]:31108: Connection reset by peer"))
    assert is_peer_failure(RuntimeError("NCCL communicator was aborted on rank 3"))
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as err:
            raise KeyError("teardown failed") from err
    except KeyError as outer:
        assert is_peer_failure(outer)
        assert is_peer_failure(RunFailure(outer, rank=1))
    assert not is_peer_failure(RuntimeError("MULA_FAULT: injected exception at step 6 on node0 rank 1"))
    assert not is_peer_failure(OSError(28, "No space left on device"))
    assert not is_peer_failure(ValueError("connection closed by peer"))  # not an error a collective raises


def test_a_rejoin_resumes_from_last_only_once_a_slot_was_saved():
    """The user's --ckpt_path is the start point until this process completed a slot; then `last`, whatever form
    the user's option had; arguments without a path gain `--ckpt_path last`."""
    args = ["fit", "--config", "c.yaml", "--ckpt_path", "init.ckpt", "--trainer.max_steps", "9"]
    assert resume_args(args, saved=False) == args
    assert resume_args(args, saved=True) == ["fit", "--config", "c.yaml", "--trainer.max_steps", "9", "--ckpt_path",
                                             "last"]  # fmt: skip
    assert resume_args(["fit", "--ckpt_path=x.ckpt"], saved=True) == ["fit", "--ckpt_path", "last"]
    assert resume_args(["fit"], saved=True) == ["fit", "--ckpt_path", "last"]


def test_the_rank_waits_for_the_launchers_announcement_and_times_out_naming_the_file(tmp_path):
    """An announcement of the same or an older attempt (or a file being written) is not the next attempt; the next
    one is returned with the ranks it replaces; without one the wait ends with an error naming the file."""
    path = tmp_path / "in_job.json"
    path.write_text(json.dumps({"attempt": 2, "replaced_ranks": []}))

    def announce():
        time.sleep(0.3)
        path.write_text('{"attempt": 3, "repl')  # a torn write first
        time.sleep(0.2)
        path.write_text(json.dumps({"attempt": 3, "replaced_ranks": [2, 3]}))

    thread = threading.Thread(target=announce)
    thread.start()
    began = time.monotonic()
    assert announced_attempt(path, after=2, timeout_s=30, poll_s=0.05) == (3, [2, 3])
    assert time.monotonic() - began >= 0.45
    thread.join()
    with pytest.raises(TimeoutError, match="no attempt after 3 was announced in .*in_job.json"):
        announced_attempt(path, after=3, timeout_s=0.2, poll_s=0.05)


def test_in_job_settings_come_from_the_launchers_variables(monkeypatch, tmp_path):
    """Without MULA_IN_JOB a run is not restarted in-job; the rejoin timeout defaults to 1800 s, the collective
    timeout to none of its own, and a bad value of either is refused naming the variable."""
    monkeypatch.delenv("MULA_IN_JOB", raising=False)
    monkeypatch.delenv("MULA_IN_JOB_TIMEOUT", raising=False)
    monkeypatch.delenv("MULA_IN_JOB_OP_TIMEOUT", raising=False)
    assert in_job_file() is None and in_job_timeout() == 1800.0 and in_job_op_timeout() is None
    monkeypatch.setenv("MULA_IN_JOB_OP_TIMEOUT", "40")
    assert in_job_op_timeout() == 40.0
    for bad in ("later", "0"):
        monkeypatch.setenv("MULA_IN_JOB_OP_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"MULA_IN_JOB_OP_TIMEOUT='{bad}'"):
            in_job_op_timeout()
    monkeypatch.setenv("MULA_IN_JOB", str(tmp_path / "in_job.json"))
    monkeypatch.setenv("MULA_IN_JOB_TIMEOUT", "12.5")
    assert in_job_file() == tmp_path / "in_job.json" and in_job_timeout() == 12.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("MULA_IN_JOB_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"MULA_IN_JOB_TIMEOUT='{bad}'"):
            in_job_timeout()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_cutting_connections_ends_a_peers_read_and_keeps_the_job_sockets_and_listeners(monkeypatch):
    """Two connections stand for a broken attempt's gloo pair and the job's store: after the cut, the peer of the
    pair reads the end of the stream at once (its collective fails instead of waiting for the group's timeout),
    while the store's connection (MASTER_PORT) still carries data and the listening sockets still accept."""
    listener = socket.create_server(("127.0.0.1", 0))
    store_listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("MASTER_PORT", str(store_listener.getsockname()[1]))
    monkeypatch.delenv("MULA_HEARTBEAT", raising=False)
    pair = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    store = socket.create_connection(store_listener.getsockname())
    store_server, _ = store_listener.accept()
    try:
        kept = set(job_sockets())
        assert {store.fileno(), store_server.fileno()} <= kept and pair.fileno() not in kept
        own = {pair.fileno(), peer.fileno(), store.fileno(), store_server.fileno()}
        others = set(tcp_sockets()) - own  # connections of this test process that are not ours to cut
        assert cut_connections(kept | others) == 2  # both ends of the pair live in this process
        peer.settimeout(5)
        assert peer.recv(16) == b""  # the end of the stream, not a wait
        store.sendall(b"ping")
        store_server.settimeout(5)
        assert store_server.recv(16) == b"ping"
        late = socket.create_connection(listener.getsockname())  # the listener was left alone
        late.close()
        assert pair.fileno() >= 0  # shut down, not closed: its owner still holds the descriptor
    finally:
        for sock in (pair, peer, store, store_server, listener, store_listener):
            sock.close()


def _two_attempts(rank: int, world_size: int, port: int, announcements: str) -> dict:
    """Attempt 0: ranks 1 and 2 wait in an all-reduce for rank 0, queued behind asynchronous ones that wait too,
    while rank 0 stays alive and out of them (a survivor blocked on another survivor) and announces attempt 1; rank
    0 then starts a collective of its own after its watcher's cut. Attempt 1: an all-reduce of every rank."""
    import os

    import torch
    import torch.distributed as dist

    from mula_lightning.utils.in_job_restart import RestartGroup, run_in_job

    dist.destroy_process_group()  # the harness's group: run_in_job forms each attempt's own
    os.environ.update(MASTER_PORT=str(port), MULA_IN_JOB=announcements, MULA_LAUNCH_ATTEMPT="0")
    os.environ["MULA_IN_JOB_TIMEOUT"] = "60"  # a collective that waited for the group's timeout would take 60 s
    os.environ["MULA_IN_JOB_OP_TIMEOUT"] = "45"  # the attempts' collectives' own (set on groups made in them too)
    failures: list[float] = []

    def stage(args: list[str]) -> list:
        attempt = int(os.environ["MULA_LAUNCH_ATTEMPT"])
        if attempt == 0:
            dist.barrier()
            began = time.monotonic()
            try:
                if rank == 0:
                    time.sleep(0.5)  # ranks 1 and 2 are inside the all-reduce by now
                    record = {"attempt": 1, "replaced_ranks": [], "launch_id": "t"}
                    with open(announcements + ".tmp", "w") as fh:
                        json.dump(record, fh)
                    os.replace(announcements + ".tmp", announcements)
                    time.sleep(1.5)  # the watcher (0.5 s polls) cut this rank's connections: a later one fails
                    try:
                        dist.all_reduce(torch.ones(3))
                    except RuntimeError:  # user code that re-raises without the cause: no peer failure in sight
                        raise RuntimeError("the step failed") from None
                else:  # reductions in flight in both of gloo's worker threads (a backward's), one queued behind
                    for _ in range(4):
                        dist.all_reduce(torch.ones(3), async_op=True)
                dist.all_reduce(torch.ones(3))
            except Exception:
                failures.append(time.monotonic() - began)
                raise
            raise AssertionError(f"rank {rank}: the all-reduce of attempt 0 completed")
        RestartGroup._abort_communicators()  # NCCL / XCCL only: a gloo group's abort would stop its worker threads
        values = torch.full((3,), float(rank + 1))
        dist.all_reduce(values)
        later = dist.new_group()
        time.sleep(0.8)  # the watcher's next poll (every 0.5 s)
        groups = (dist.group.WORLD, later)
        timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
        return [attempt, values.tolist(), args, timeouts]

    out = run_in_job(stage, ["fit", "--ckpt_path", "mine.ckpt"], lambda: True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the harness to destroy
    return {"result": out, "failed_after_s": failures}


def test_survivors_blocked_on_each_other_are_cut_free_and_rejoin_the_next_attempt(tmp_path):
    """Three real ranks under ``run_in_job``: two wait in an all-reduce for the third, which is alive and never
    joins it (the case a peer's death does not end), queued behind asynchronous all-reduces in flight in gloo's
    worker threads; once it announces the next attempt, every rank's watcher cuts the attempt's connections, the
    waiting collectives fail within seconds (not the group's 60 s timeout: a gloo group's abort would have stopped
    the workers with the queued one never run, a survivor stuck for good), the
    third rank's own later collective fails too (re-raised by its code as an error that names no peer: any error
    after the cut is survived), and all three form attempt 1 on the same store and all-reduce
    correctly in it (no stale cut reaches the new attempt's connections, and aborting the communicators leaves a gloo
    group working), resuming from ``last``; the collective timeout of MULA_IN_JOB_OP_TIMEOUT is on the attempt's
    group and on a group made during the attempt."""
    from mula_lightning.launch.backends import free_port
    from mula_lightning.testing import run_distributed_test

    results = run_distributed_test(
        _two_attempts, 3, port=free_port(), announcements=str(tmp_path / "in_job.json"), timeout=90
    )
    for rank, res in enumerate(results):
        assert res["result"] == [1, [6.0, 6.0, 6.0], ["fit", "--ckpt_path", "last"], [45.0, 45.0]], (rank, res)
        assert len(res["failed_after_s"]) == 1 and res["failed_after_s"][0] < 15, (rank, res)
