"""``FaultInjector``: hard and soft node failures on demand, for tests and failure drills (``MULA_FAULT``).

Why: a relaunch path that has never seen a real failure does not work when one comes. nvidia-resiliency-ext tests
its launcher with injected SIGKILL, SIGSTOP, exceptions and GPU errors; ``mula launch`` is tested the same way. The
faults come from the environment so that any command (``mula fit``, a user's script with this callback) can be
drilled without editing its config::

    MULA_FAULT="kill@step=5,node=node1"                 # every rank on node1 SIGKILLs itself at step 5
    MULA_FAULT="hang@step=3,node=node2,local_rank=0"    # one rank stops (SIGSTOP): a hang
    MULA_FAULT="nan@step=7,node=node1"                  # that node's gradients turn NaN (NaNDetector: exit 86)
    MULA_FAULT="exception@step=4,rank=0"                # an ordinary Python error
    MULA_FAULT="abort@step=4,node=node1"                # SIGABRT, as NCCL's watchdog ends healthy ranks
    MULA_FAULT="slow@step=20,rank=3,ms=200"             # from step 20 on, rank 3 stalls 200 ms per step
    MULA_FAULT="diskfull@step=6,rank=1"                 # rank 1's first save from step 6 on: ENOSPC mid-save
    MULA_FAULT="kill@step=5,node=node1;nan@step=9,node=node2,attempt=1"   # several, ';'-separated

``step=S`` acts while optimizer step S (1-based) is computed, before it is applied: at the first batch of that step;
``step=0`` (kill, hang, exception, abort) acts in the Trainer's set-up, before the checkpoint is loaded (a second
fault while ``mula launch`` restarts the job).
``attempt`` (default 0) is the launch attempt the fault belongs to (``MULA_LAUNCH_ATTEMPT``): a fault fires once,
not again in the relaunch that resumes before its step. ``node``, ``rank`` and ``local_rank`` narrow where it fires
(default: everywhere). ``slow`` is not fired once: every optimizer step from ``step`` on, the rank sleeps ``ms``
milliseconds before the forward of the step's first micro-batch (a stalled data pipeline, a throttled host:
:class:`~mula_lightning.callbacks.straggler_detection.StragglerDetection` names it in the ``data`` section when this
callback runs before it, as ``mula fit`` orders them). Without ``MULA_FAULT`` the callback does nothing (``mula
fit`` adds it only when set). ``diskfull`` fails the first :class:`~mula_lightning.callbacks.DualCheckpoint` save
at or after ``step`` with ``OSError(ENOSPC)`` once its slot is cleared, before anything is written (in the writer
thread when saves are asynchronous), as a file system that fills up does.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback

from mula_lightning.utils.launch_env import ATTEMPT_ENV, FAULT_ENV, Fault, host_name, parse_faults

__all__ = ["FaultInjector"]


class FaultInjector(Callback):
    """Fire the faults of ``spec`` (default: ``MULA_FAULT``) that match this process, each once.

    Args:
        spec: fault list (see the module docstring); ``None`` reads ``MULA_FAULT``.
    """

    def __init__(self, spec: str | None = None) -> None:
        self.faults = parse_faults(os.environ.get(FAULT_ENV, "") if spec is None else spec)
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        self._fired: set[Fault] = set()
        self._nan_pending = False
        self._slowed_step = 0  # the last step a slow fault stalled

    def _mine(self, trainer: Any) -> list[Fault]:
        rank = int(getattr(trainer, "global_rank", os.environ.get("RANK", 0)))
        local_rank = int(getattr(trainer, "local_rank", os.environ.get("LOCAL_RANK", 0)))
        return [f for f in self.faults if f.applies(host_name(), rank, local_rank, self.attempt)]

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint

        for fault in self._mine(trainer):
            if fault.step == 0 and fault not in self._fired:  # during the set-up, before the checkpoint is loaded
                self._fired.add(fault)
                self._fire(fault, trainer)
        full = [f for f in self._mine(trainer) if f.kind == "diskfull"]
        for callback in (c for c in trainer.callbacks if isinstance(c, DualCheckpoint)) if full else ():
            callback.phase_hook = self._disk_full_hook(trainer, full, callback.phase_hook)

    def _disk_full_hook(self, trainer: Any, faults: list[Fault], previous: Any) -> Any:
        def hook(phase: str) -> None:
            if previous is not None:
                previous(phase)
            due = [f for f in faults if f not in self._fired and trainer.global_step >= f.step]
            if phase == "cleared" and due:
                self._fired.update(due)
                where = f"a save at step {trainer.global_step} on {host_name()} rank {trainer.global_rank}"
                print(f"{FAULT_ENV}: injecting diskfull in {where}", file=sys.stderr, flush=True)
                raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV}: injected in {where})")

        return hook

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1  # the optimizer step this batch belongs to
        for fault in self._mine(trainer):
            if fault.kind == "slow":
                if step >= fault.step and self._slowed_step != step:
                    self._slowed_step = step
                    time.sleep(fault.ms / 1000)
            elif fault.step == step and fault not in self._fired and fault.kind != "diskfull":
                self._fired.add(fault)
                self._fire(fault, trainer)

    def _fire(self, fault: Fault, trainer: Any) -> None:
        where = f"step {fault.step} on {host_name()} rank {trainer.global_rank} (pid {os.getpid()})"
        print(f"{FAULT_ENV}: injecting {fault.kind} at {where}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "exception":
            raise RuntimeError(f"{FAULT_ENV}: injected exception at {where}")
        elif fault.kind == "abort":
            os.abort()
        else:  # nan: this step's gradients, on this rank only (before any reduction), become NaN
            self._nan_pending = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._nan_pending and loss.requires_grad:
            self._nan_pending = False
            loss.register_hook(lambda grad: grad * float("nan"))
