"""A rank without training, for the launcher's tests: steps, heartbeats, a "checkpoint" and MULA_FAULT faults.

Each step sleeps ``FAKE_STEP_S`` seconds, appends ``attempt step host`` to ``FAKE_STATE_DIR/steps.rankR`` and beats;
rank 0 writes the step to ``FAKE_STATE_DIR/checkpoint`` every 2 steps, and every rank starts from it. The faults of
``MULA_FAULT`` are the real parser's (kill: SIGKILL, hang: SIGSTOP after writing ``stopped_at``, exception: exit 1
with a traceback, abort: SIGABRT, nan: append its NaNDetector line to ``MULA_FAILED_HOSTS_FILE`` and exit 86; slow:
the rank sleeps ``ms`` longer per step, and rank 0 appends a straggler report naming its node to
``MULA_STRAGGLERS_FILE`` after every step from then on, as StragglerDetection's rank 0 would). Without
collectives the other ranks do not notice a failure: the launcher must stop them. ``FAKE_SILENT=1``: the rank
never beats (a rendezvous that never completes); ``FAKE_SILENT_S=T``: no beat, exit 0 after T s;
``FAKE_HANG_AFTER_END=1``: rank 0 reports the end, then never exits. Under ``--in-job`` (``MULA_IN_JOB``) a rank
that sees a later attempt announced rejoins it in the same process, from the checkpoint (as ``run_in_job`` does);
``FAKE_STUCK_RANK=R``: rank R ends with the stuck exit code instead (a survivor that could not leave).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from mula_lightning.utils.launch_env import (
    ATTEMPT_ENV,
    FAULT_ENV,
    IN_JOB_ENV,
    NAN_EVENTS_ENV,
    NAN_EXIT_CODE,
    STRAGGLERS_ENV,
    STUCK_EXIT_CODE,
    HeartbeatClient,
    NanRecord,
    host_name,
    parse_faults,
)


def _announced(after: int) -> int | None:
    """Under ``--in-job``: the attempt the launcher announced after ``after`` (``MULA_IN_JOB``), else None."""
    path = os.environ.get(IN_JOB_ENV)
    try:
        attempt = int(json.loads(Path(path).read_text())["attempt"]) if path else -1
    except (OSError, ValueError, KeyError):
        return None
    return attempt if attempt > after else None


def main() -> int:
    while True:  # under --in-job a survivor runs the attempts the launcher announces, in this process
        code = run_attempt()
        if code is not None:
            return code


def run_attempt() -> int | None:
    """One attempt; its exit code, or None to rejoin the attempt the launcher announced (``--in-job``)."""
    steps = int(os.environ.get("FAKE_STEPS", "8"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.1"))
    state = Path(os.environ["FAKE_STATE_DIR"])
    rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])  # torchrun's, else SLURM's (srun)
    local_rank = int(os.environ.get("LOCAL_RANK") or os.environ["SLURM_LOCALID"])
    attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
    every = parse_faults(os.environ.get(FAULT_ENV, ""))
    faults = [f for f in every if f.applies(host_name(), rank, local_rank, attempt) and f.kind != "slow"]
    slow = [f for f in every if f.kind == "slow" and f.attempt == attempt]
    if os.environ.get("FAKE_SILENT"):  # a rendezvous that never completes: alive, never a heartbeat
        time.sleep(3600)
    if os.environ.get("FAKE_SILENT_S"):  # a command that sends no heartbeats and ends after a while
        time.sleep(float(os.environ["FAKE_SILENT_S"]))
        return 0
    heartbeat = HeartbeatClient()
    heartbeat.beat(0, "setup")  # as Heartbeat does before the checkpoint is loaded
    checkpoint = state / "checkpoint"
    start = int(checkpoint.read_text()) if checkpoint.exists() else 0
    heartbeat.beat(start, "start")
    for step in range(start + 1, steps + 1):
        rejoin = _announced(attempt)
        if rejoin is not None:  # a peer failed: this survivor leaves the attempt and rejoins the next one
            heartbeat.close()
            if os.environ.get("FAKE_STUCK_RANK") == str(rank):  # blocked in the broken attempt: ends itself
                return STUCK_EXIT_CODE
            os.environ[ATTEMPT_ENV] = str(rejoin)
            return None
        for fault in (f for f in faults if f.step == step):
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                (state / "stopped_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "exception":
                raise RuntimeError(f"injected exception at step {step} on {host_name()}")
            elif fault.kind == "abort":
                os.abort()
            else:
                with open(os.environ[NAN_EVENTS_ENV], "a") as fh:
                    fh.write(NanRecord(host_name(), step=step - 1, ranks=[rank]).line() + "\n")
                return NAN_EXIT_CODE
        mine = [f for f in slow if step >= f.step and f.applies(host_name(), rank, local_rank, attempt)]
        time.sleep(step_s + sum(f.ms for f in mine) / 1000)
        if rank == 0 and os.environ.get(STRAGGLERS_ENV):
            named = [dict(rank=-1, host=f.node, section="data", relative=0.1) for f in slow if step >= f.step]
            with open(os.environ[STRAGGLERS_ENV], "a") as fh:
                fh.write(json.dumps({"step": step, "threshold": 0.75, "stragglers": named}) + "\n")
        with open(state / f"steps.rank{rank}", "a") as fh:
            fh.write(f"{attempt} {step} {host_name()}\n")
        heartbeat.beat(step, "train")
        if rank == 0 and step % 2 == 0:
            tmp = checkpoint.with_suffix(".tmp")
            tmp.write_text(str(step))
            tmp.replace(checkpoint)
    heartbeat.beat(steps, "end")
    heartbeat.flush()
    if os.environ.get("FAKE_HANG_AFTER_END") and rank == 0:  # a teardown that never finishes
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
