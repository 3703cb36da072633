"""The job's store hosted beside the launcher (``--in-job``): ranks reach it as clients, it ends with the launch, and
a store that cannot serve is named with what it said."""

import datetime
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mula_lightning.launch.store_host import StoreHost

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _this_checkout(monkeypatch):
    """The store process imports this checkout's package (as the launched ranks do)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))


def test_the_hosted_store_serves_clients_and_ends_when_closed():
    """The store listens, a client of it is served (what one rank sets, another reads); a second ensure() keeps the
    same store; failure() is None while it serves and names the exit once it was killed; a new ensure() starts
    another store on another port; close() ends it."""
    with StoreHost() as host:
        port = host.ensure()
        assert host.wait_ready(60), host.failure()
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
        client.set("mula/attempt0/x", "1")
        assert host.failure() is None and host.ensure() == port
        assert dist.TCPStore("127.0.0.1", port, None, False).get("mula/attempt0/x") == b"1"
        host.proc.kill()
        host.proc.wait()
        assert f"the job's store on 127.0.0.1:{port} ended (exit -9)" in host.failure()
        assert host.ensure() != port and host.starts == 2
        proc = host.proc
    assert proc.poll() is not None and host.proc is None


def test_a_store_that_does_not_listen_in_time_is_a_failure():
    """With a start timeout of 0 s, the store that has not said ``ready`` yet is named as not listening in time."""
    with StoreHost(timeout_s=0.0) as host:
        port = host.ensure()
        time.sleep(0.01)
        assert host.failure().startswith(f"the job's store on 127.0.0.1:{port} did not listen within 0 s")
