"""The ranks' heartbeat client: a store that goes away and comes back (the launcher restarted, a network blip) costs
beats, never the heartbeats for good, and never the training step."""

import datetime
import gc
import json
import time

from torch.distributed import TCPStore

from mula_lightning.utils.launch_env import HeartbeatClient, heartbeat_key


def _store(port=0):
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def test_heartbeats_survive_a_store_restart():
    """Beats reach store A; A goes away (the sender fails and backs off; every beat still returns at once: a
    training step never waits for the store); a new store on the same port receives the beats again within a few
    backoff periods, with the newest record."""
    store = _store()
    port = store.port
    client = HeartbeatClient(f"127.0.0.1:{port}", connect_timeout_s=1.0)
    client.FIRST_BACKOFF_S = 0.1
    client.beat(1, "train", rank=0)
    assert client.flush(5.0)
    assert json.loads(store.get(heartbeat_key(0, 0)))["step"] == 1
    del store
    gc.collect()
    for step in range(2, 6):  # the store is gone: no beat may block or raise
        start = time.monotonic()
        client.beat(step, "train", rank=0)
        assert time.monotonic() - start < 0.1
        time.sleep(0.05)
    restarted = _store(port)
    deadline = time.monotonic() + 10.0
    step = 6
    while time.monotonic() < deadline:
        client.beat(step, "train", rank=0)
        if restarted.check([heartbeat_key(0, 0)]):
            break
        step += 1
        time.sleep(0.1)
    assert client.flush(5.0)
    record = json.loads(restarted.get(heartbeat_key(0, 0)))
    assert record["step"] == step and record["seq"] == step  # the newest record; the client's counter went on
