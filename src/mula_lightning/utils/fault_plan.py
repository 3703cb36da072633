"""``FaultPlan``: the drill faults of ``MULA_FAULT`` that match this process, fired each once, for any loop.

Why a plain class under the Trainer callback: the faults (the spec: :mod:`mula_lightning.callbacks.fault_injection`)
must fire the same way in ``mula fit`` (:class:`~mula_lightning.callbacks.FaultInjector`, which drives this class
from the Trainer's hooks) and in a Fabric or plain loop (:class:`~mula_lightning.utils.launched_loop.LaunchedLoop`,
which a loop calls itself), so that a drill of a Fabric script under ``mula launch`` means what it means for
``mula fit``. This module imports neither torch nor Lightning.

The loop tells the plan where it is: :meth:`at_setup` once the processes are up, before the checkpoint is loaded
(the ``step=0`` faults: a second fault while the job restarts); :meth:`before_step` before the forward of each
optimizer step's first micro-batch (1-based step: ``kill``, ``hang``, ``exception``, ``abort``, ``nan`` and
``slow``); :meth:`poison` on the loss before its backward (a pending ``nan``); :meth:`disk_full_hook` as the
``phase_hook`` of a :class:`~mula_lightning.callbacks.DualCheckpoint` (``diskfull``).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from mula_lightning.utils.launch_env import ATTEMPT_ENV, FAULT_ENV, Fault, host_name, parse_faults

__all__ = ["FaultPlan"]


class FaultPlan:
    """The faults of ``spec`` (default: ``MULA_FAULT``) of this launch attempt (``MULA_LAUNCH_ATTEMPT``).

    Args:
        spec: fault list (``kind@step=S[,node=H][,rank=R][,local_rank=L][,attempt=A][,ms=M]``, ``;``-separated);
            ``None`` reads ``MULA_FAULT``. A spec that does not parse is a ``ValueError`` naming the part.
    """

    def __init__(self, spec: str | None = None) -> None:
        self.faults = parse_faults(os.environ.get(FAULT_ENV, "") if spec is None else spec)
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        self._fired: set[Fault] = set()
        self._nan_pending = False
        self._slowed_step = 0  # the last step a slow fault stalled

    def mine(self, rank: int, local_rank: int) -> list[Fault]:
        """The faults that match this host, ``rank``, ``local_rank`` and attempt."""
        return [f for f in self.faults if f.applies(host_name(), rank, local_rank, self.attempt)]

    def at_setup(self, rank: int, local_rank: int) -> None:
        """The ``step=0`` faults: processes up and the group formed, the checkpoint not loaded yet."""
        for fault in self.mine(rank, local_rank):
            if fault.step == 0 and fault not in self._fired:
                self._fired.add(fault)
                self._fire(fault, rank)

    def before_step(self, step: int, rank: int, local_rank: int) -> None:
        """Before the forward of optimizer step ``step`` (1-based; the step is computed, not yet applied): a
        ``slow`` fault stalls ``ms`` (once per step, from its step on), any other fires once at its step."""
        for fault in self.mine(rank, local_rank):
            if fault.kind == "slow":
                if step >= fault.step and self._slowed_step != step:
                    self._slowed_step = step
                    time.sleep(fault.ms / 1000)
            elif fault.step == step and fault not in self._fired and fault.kind != "diskfull":
                self._fired.add(fault)
                self._fire(fault, rank)

    def poison(self, loss: Any) -> None:
        """A ``nan`` fired for this step: the gradients of ``loss`` (a tensor about to be backpropagated) become NaN
        on this rank only, before any reduction."""
        if self._nan_pending and getattr(loss, "requires_grad", False):
            self._nan_pending = False
            loss.register_hook(lambda grad: grad * float("nan"))

    def disk_full_hook(
        self, current_step: Callable[[], int], rank: int, local_rank: int, previous: Any = None
    ) -> Callable[[str], None] | Any:
        """A checkpoint ``phase_hook`` that fails the first save at or after a ``diskfull`` fault's step with
        ``OSError(ENOSPC)`` once its slot is cleared, before anything is written; ``previous`` (another hook) still
        runs first. Returns ``previous`` unchanged when no such fault matches this process."""
        faults = [f for f in self.mine(rank, local_rank) if f.kind == "diskfull"]
        if not faults:
            return previous

        def hook(phase: str) -> None:
            if previous is not None:
                previous(phase)
            step = current_step()
            due = [f for f in faults if f not in self._fired and step >= f.step]
            if phase == "cleared" and due:
                self._fired.update(due)
                where = f"a save at step {step} on {host_name()} rank {rank}"
                print(f"{FAULT_ENV}: injecting diskfull in {where}", file=sys.stderr, flush=True)
                raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV}: injected in {where})")

        return hook

    def _fire(self, fault: Fault, rank: int) -> None:
        where = f"step {fault.step} on {host_name()} rank {rank} (pid {os.getpid()})"
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
        else:  # nan: this step's gradients, on this rank only (before any reduction), become NaN (see poison)
            self._nan_pending = True
