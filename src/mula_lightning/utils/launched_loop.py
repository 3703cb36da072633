"""``LaunchedLoop``: ``mula launch``'s half inside a Fabric (or plain) training loop: heartbeats and drill faults.

Why: under ``mula launch`` the launcher learns a rank's progress only from its heartbeats (``MULA_HEARTBEAT``): a
rank that never beats is a start that never completed (killed after ``--startup-timeout``), one that stops beating
is a hang, and the phases of the beats split a restart's cost into starting, reloading and recomputing. ``mula fit``
gets this from its ``Heartbeat`` and ``FaultInjector`` callbacks; a loop has no hooks, so it calls this object at
the same points::

    launched = LaunchedLoop(fabric.global_rank, fabric.local_rank)
    launched.setup()                          # group formed; the checkpoint is not loaded yet (step=0 faults)
    ...load the newest checkpoint (DualCheckpoint.load_fabric), with launched.checkpoint_hook() as its phase_hook
    launched.start(step)                      # resumed at `step` (0 for a fresh run)
    while step < max_steps:
        launched.before_step(step + 1)        # before the forward of the step's first micro-batch
        ...forward; launched.poison(loss); backward; optimizer step; step += 1; save every N steps...
        launched.step_done(step, saved=...)   # this step applied (and a slot saved by this process, if one was)
    launched.end(step)

Every method is a no-op where its variable is unset (a run outside ``mula launch``, a run without ``MULA_FAULT``).
Beats never block the loop (:class:`~mula_lightning.utils.launch_env.HeartbeatClient`). Under ``mula launch
--in-job`` make a new one in each attempt (its heartbeats and faults belong to the attempt it was made in):
:func:`~mula_lightning.utils.in_job_restart.run_loop_in_job` calls the whole script's ``main`` again, which does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mula_lightning.utils.fault_plan import FaultPlan
from mula_lightning.utils.launch_env import HeartbeatClient

__all__ = ["LaunchedLoop"]


class LaunchedLoop:
    """Heartbeats (``MULA_HEARTBEAT``) and drill faults (``MULA_FAULT``) of one rank's training loop.

    Args:
        rank: this process's global rank (default: ``RANK``).
        local_rank: its rank on its node (default: ``LOCAL_RANK``).
        fault_spec: the faults (default: ``MULA_FAULT``; see :class:`~mula_lightning.utils.fault_plan.FaultPlan`).
        heartbeat_address: ``host:port`` of the launcher's heartbeat server (default: ``MULA_HEARTBEAT``).
    """

    def __init__(
        self,
        rank: int | None = None,
        local_rank: int | None = None,
        fault_spec: str | None = None,
        heartbeat_address: str | None = None,
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else int(rank)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if local_rank is None else int(local_rank)
        self.heartbeat = HeartbeatClient(heartbeat_address)
        self.faults = FaultPlan(fault_spec)
        self.step = 0  # the last step applied (the step a save at this point belongs to)
        self.saved = False  # this process completed a checkpoint slot

    def setup(self, step: int = 0) -> None:
        """The processes are up and the group is formed; the checkpoint is loaded next. Fires the ``step=0``
        faults (a second fault while the job restarts)."""
        self.heartbeat.beat(step, "setup", self.rank)
        self.faults.at_setup(self.rank, self.local_rank)

    def start(self, step: int) -> None:
        """Training starts (or resumes) after step ``step``: the launcher's ``resumed_from``."""
        self.step = int(step)
        self.heartbeat.beat(step, "start", self.rank)

    def before_step(self, step: int) -> None:
        """Before the forward of optimizer step ``step`` (1-based), at its first micro-batch: the faults of that
        step fire here (a ``slow`` one stalls every step from its step on)."""
        self.faults.before_step(step, self.rank, self.local_rank)

    def poison(self, loss: Any) -> None:
        """Before ``loss``'s backward: a ``nan`` fault of this step makes this rank's gradients NaN (which a
        :class:`~mula_lightning.utils.non_finite.NonFiniteCheck` of the loop then stops every rank on)."""
        self.faults.poison(loss)

    def step_done(self, step: int, saved: bool = False) -> None:
        """Optimizer step ``step`` was applied; ``saved``: a checkpoint slot was completed by this process (sticky,
        the launcher then resumes a relaunch from the newest slot)."""
        self.step = int(step)
        self.saved |= bool(saved)
        self.heartbeat.beat(step, "train", self.rank, saved=self.saved)

    def validation(self, step: int) -> None:
        """A validation batch after step ``step`` (a long validation is not a hang)."""
        self.heartbeat.beat(step, "validation", self.rank, saved=self.saved)

    def checkpoint_hook(self, previous: Any = None) -> Callable[[str], None] | Any:
        """The ``phase_hook`` of a ``DualCheckpoint`` with the ``diskfull`` faults (``previous`` still runs
        first): the first save at or after the fault's step fails with ``OSError(ENOSPC)``."""
        return self.faults.disk_full_hook(lambda: self.step, self.rank, self.local_rank, previous)

    def end(self, step: int) -> None:
        """Training ended after step ``step``: the last beat, delivered before the process ends."""
        self.heartbeat.beat(step, "end", self.rank, saved=self.saved)
        self.heartbeat.flush(timeout_s=5.0)
