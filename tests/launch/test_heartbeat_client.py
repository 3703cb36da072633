"""The heartbeat between the ranks and the launcher: the client's records reach the server, a server that goes away
and comes back (the launcher restarted, a network blip) costs beats, never the heartbeats for good and never the
training step, and what is not a record on the server's port is refused without harming the ranks' records."""

import socket
import subprocess
import sys
import time
from pathlib import Path

from mula_lightning.launch.heartbeat_server import HeartbeatServer
from mula_lightning.utils.launch_env import HeartbeatClient, heartbeat_line, parse_heartbeat_line

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_heartbeats_survive_a_server_restart():
    """Beats reach server A; A goes away (the sender fails and backs off; every beat still returns at once: a
    training step never waits for the server); a new server on the same port receives the beats again within a few
    backoff periods, with the newest record."""
    server = HeartbeatServer()
    port = server.port
    client = HeartbeatClient(f"127.0.0.1:{port}", connect_timeout_s=1.0)
    client.FIRST_BACKOFF_S = 0.1
    client.beat(1, "train", rank=0)
    assert client.flush(5.0)
    assert server.read(0, 1)[0]["step"] == 1
    server.close()
    for step in range(2, 6):  # the server is gone: no beat may block or raise
        start = time.monotonic()
        client.beat(step, "train", rank=0)
        assert time.monotonic() - start < 0.1
        time.sleep(0.05)
    restarted = HeartbeatServer(port=port)
    try:
        step = 6
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not restarted.read(0, 1):
            client.beat(step, "train", rank=0)
            step += 1
            time.sleep(0.1)
        client.beat(step, "train", rank=0)
        assert client.flush(5.0)
        record = restarted.read(0, 1)[0]
        assert record["step"] == step and record["seq"] == step  # the newest record; the client's counter went on
    finally:
        client.close()
        restarted.close()


def test_server_keeps_the_newest_record_per_attempt_and_rank():
    """Records of 3 ranks in 2 attempts, several per rank over one connection each: ``read(attempt, world)`` gives
    each rank's newest record of that attempt only, and nothing for a rank that never sent one."""
    with HeartbeatServer() as server:
        clients = {}
        for attempt in (0, 1):
            for rank in range(3):
                client = clients[attempt, rank] = HeartbeatClient(server.address)
                client.attempt = attempt
                for step in range(1, 4 + rank + attempt):
                    client.beat(step, "train", rank=rank)
        for client in clients.values():
            assert client.flush(5.0)
            client.close()
        assert {r: rec["step"] for r, rec in server.read(0, 4).items()} == {0: 3, 1: 4, 2: 5}
        assert {r: rec["step"] for r, rec in server.read(1, 4).items()} == {0: 4, 1: 5, 2: 6}
        assert server.read(2, 3) == {}


def test_close_after_the_serving_thread_already_stopped_does_not_raise():
    """The race ``close()`` loses now and then on a loaded machine: the serving thread sees the closed flag at its 1 s
    select timeout and closes its end of the wake-up pair before ``close()`` sends the wake-up byte. Forced here (the
    flag set, the thread left to exit, the flag put back): ``close()`` returns instead of raising BrokenPipeError
    (seen once in a full run), and the listening port is closed."""
    server = HeartbeatServer()
    server._closed = True  # what close() sets first
    server._thread.join(timeout=5.0)
    assert not server._thread.is_alive()
    server._closed = False
    server.close()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", server.port)) != 0


def test_what_is_not_a_record_closes_that_connection_only():
    """Another program's bytes on the port (an HTTP request, a record line with a bad key or a JSON list, a line
    longer than any record) close that connection and are counted; a rank's client on the same server is not
    disturbed, and a valid line sent by hand is acknowledged with ``ok``."""
    with HeartbeatServer() as server:
        client = HeartbeatClient(server.address)
        client.beat(7, "train", rank=1)
        assert client.flush(5.0)
        bad = [b"GET / HTTP/1.1\r\n\r\n", b"MHB1 hb/0/x {}\n", b"MHB1 hb/0/2 [1, 2]\n", b"MHB1 " + b"a" * 70000]
        for payload in bad:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                conn.sendall(payload)
                assert conn.recv(10) == b""  # closed by the server
        assert server.rejected == len(bad)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(heartbeat_line("hb/0/2", '{"step": 3, "phase": "train"}'))
            assert conn.recv(10) == b"ok\n"
        client.beat(8, "train", rank=1)
        assert client.flush(5.0)
        assert {r: rec["step"] for r, rec in server.read(0, 3).items()} == {1: 8, 2: 3}
        client.close()


def test_parse_heartbeat_line_accepts_records_only():
    """The wire format round-trips; other magic words, keys and payloads are None."""
    line = heartbeat_line("hb/3/12", '{"step": 5}')
    assert line.endswith(b"\n") and parse_heartbeat_line(line[:-1]) == ("hb/3/12", {"step": 5})
    for bad in (b"", b"MHB2 hb/0/0 {}", b"MHB1 hb/0 {}", b"MHB1 xx/0/0 {}", b"MHB1 hb/0/0 {", b"MHB1 hb/0/0 3"):
        assert parse_heartbeat_line(bad) is None, bad


def test_launch_protocol_and_launcher_import_without_torch():
    """A process that only speaks the launch protocol (a fake rank, ``mula launch`` itself, the SLURM helpers)
    imports neither torch nor Lightning: it starts in a fraction of a second, not after a second of imports."""
    code = (
        "import sys; import mula_lightning.utils.launch_env, mula_lightning.launch, mula_lightning.cli; "
        "bad = sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules); print(bad); sys.exit(bool(bad))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
