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

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from mula_lightning.utils.fault_plan import FaultPlan

__all__ = ["FaultInjector"]


class FaultInjector(Callback):
    """Fire the faults of ``spec`` (default: ``MULA_FAULT``) that match this process, each once (the Trainer's
    hooks driving a :class:`~mula_lightning.utils.fault_plan.FaultPlan`, which a Fabric loop drives itself).

    Args:
        spec: fault list (see the module docstring); ``None`` reads ``MULA_FAULT``.
    """

    def __init__(self, spec: str | None = None) -> None:
        self.plan = FaultPlan(spec)
        self.faults = self.plan.faults

    @staticmethod
    def _ranks(trainer: Any) -> tuple[int, int]:
        rank = int(getattr(trainer, "global_rank", os.environ.get("RANK", 0)))
        return rank, int(getattr(trainer, "local_rank", os.environ.get("LOCAL_RANK", 0)))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint

        rank, local_rank = self._ranks(trainer)
        self.plan.at_setup(rank, local_rank)  # during the set-up, before the checkpoint is loaded
        for callback in (c for c in trainer.callbacks if isinstance(c, DualCheckpoint)):
            callback.phase_hook = self.plan.disk_full_hook(
                lambda: trainer.global_step, rank, local_rank, callback.phase_hook
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.plan.before_step(trainer.global_step + 1, *self._ranks(trainer))  # the optimizer step this batch is of

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.plan.poison(loss)
