"""LaunchedLoop, mula launch's half in a Fabric loop: its beats reach the launcher's server with the phases a restart's
cost is split by, and MULA_FAULT's faults fire in the loop where FaultInjector fires them in the Trainer."""

import errno
import time

import pytest
import torch

from mula_lightning.launch.heartbeat_server import HeartbeatServer
from mula_lightning.utils.launched_loop import LaunchedLoop


def test_beats_carry_the_resume_point_the_phases_and_the_saved_flag(monkeypatch):
    """A loop resumed at step 4 (attempt 2): the server's record of rank 3 follows setup -> start -> train -> end, with
    resumed_from 4, its setup and start times, the time of its first trained step, and `saved` once a step reported a
    completed slot (sticky afterwards); nothing is sent without MULA_HEARTBEAT."""
    monkeypatch.setenv("MULA_LAUNCH_ATTEMPT", "2")
    with HeartbeatServer() as server:
        loop = LaunchedLoop(rank=3, local_rank=1, heartbeat_address=server.address, fault_spec="")
        loop.setup()
        assert loop.heartbeat.flush(5.0) and server.read(2, 4)[3]["phase"] == "setup"
        loop.start(4)
        loop.step_done(5)
        assert loop.heartbeat.flush(5.0)
        record = server.read(2, 4)[3]
        assert (record["step"], record["phase"], record["resumed_from"], record["saved"]) == (5, "train", 4, False)
        assert record["setup_time"] <= record["start_time"] <= record["first_train_time"] <= time.time()
        loop.step_done(6, saved=True)
        loop.step_done(7)
        loop.end(7)
        record = server.read(2, 4)[3]  # end() delivers its beat before it returns
        assert (record["step"], record["phase"], record["saved"]) == (7, "end", True)
        loop.heartbeat.close()
    monkeypatch.delenv("MULA_HEARTBEAT", raising=False)
    assert not LaunchedLoop(rank=0, local_rank=0, fault_spec="").heartbeat.enabled


def test_faults_fire_for_this_rank_and_attempt_at_their_step():
    """Rank 1 of attempt 0: a slow fault stalls each step from its step once, an exception fires at its step (once:
    a step rerun after it does not fire again), a nan makes the step's gradients NaN through poison(), a full disk
    fails the first save at or after its step once the slot is cleared (the hook before it still runs), and faults of
    another rank or attempt never fire."""
    spec = "slow@step=2,rank=1,ms=150;exception@step=3,rank=1;nan@step=4,rank=1;diskfull@step=5,rank=1;"
    spec += "kill@step=1,rank=0;kill@step=1,rank=1,attempt=1"
    loop = LaunchedLoop(rank=1, local_rank=0, heartbeat_address="", fault_spec=spec)
    began = time.perf_counter()
    loop.before_step(1)  # the kills are rank 0's and attempt 1's
    assert time.perf_counter() - began < 0.1
    for step, stalled in ((2, True), (2, False), (3, True)):
        began = time.perf_counter()
        if step == 3:
            with pytest.raises(RuntimeError, match="injected exception at step 3"):
                loop.before_step(step)
        else:
            loop.before_step(step)
        assert (time.perf_counter() - began >= 0.15) == stalled
    loop.before_step(3)  # the exception fired once
    weight = torch.ones(3, requires_grad=True)
    loop.before_step(4)
    loss = (weight * 2).sum()
    loop.poison(loss)
    loss.backward()
    assert torch.isnan(weight.grad).all()
    phases = []
    hook = loop.checkpoint_hook(phases.append)
    loop.step_done(4)
    hook("cleared")  # a save of step 4: before the fault's step
    loop.step_done(6)
    hook("begin")
    with pytest.raises(OSError) as err:
        hook("cleared")
    assert err.value.errno == errno.ENOSPC and phases == ["cleared", "begin", "cleared"]
    hook("cleared")  # once only
    assert LaunchedLoop(rank=0, local_rank=0, heartbeat_address="", fault_spec="").checkpoint_hook(None) is None
