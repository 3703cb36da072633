"""A stop asked for from outside a training run (SIGTERM, SIGUSR1, Ctrl-C), agreed by every rank at a step boundary.

Why: what ``kill``, a SLURM time limit (``--signal``), a preemption or a person at the terminal sends must end a run
with its work saved and a non-zero status, on every rank at the same step. Acting inside the signal handler cannot do
that: a collective checkpoint needs every rank, and a handler runs at whatever bytecode the main thread was at. So
the handler only records the signal; the training loop asks :meth:`StopRequest.agreed` at each optimizer-step
boundary, which all-reduces the recorded signal over the ranks (a signal sent to one rank, as ``kill PID`` does,
stops all of them at the same step), and the loop then saves and leaves.

A second Ctrl-C (SIGINT) while a stop is pending raises ``KeyboardInterrupt`` at once: a person who does not want to
wait for the step to finish can still stop now, without the save.

Exit status of a stopped run: ``128 + signal number`` (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT), what a
shell reports for a process killed by that signal, so ``mula fit ... && mula export ...`` does not go on.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["STOP_SIGNALS", "StopRequest", "signal_exit_code"]

#: the signals a run stops on by default: a termination (``kill``, SLURM at the time limit, a preemption), SLURM's
#: advance warning (``#SBATCH --signal=USR1@120``; Lightning's requeue signal) and Ctrl-C
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def signal_exit_code(signum: int) -> int:
    """The exit status a shell reports for a process ended by ``signum`` (``128 + signum``)."""
    return 128 + int(signum)


def _signum(name: str | int) -> int:
    if isinstance(name, int):
        return int(signal.Signals(name))
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if not hasattr(signal, key) or key in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"stop signal {name!r} is not a signal a process can catch (e.g. {', '.join(STOP_SIGNALS)})")
    return int(getattr(signal, key))


class StopRequest:
    """Signal handlers that record a stop, and the collective question "does any rank want to stop?".

    Args:
        signals: names (``"SIGTERM"``, ``"USR1"``) or numbers of the signals that request a stop.

    Use: :meth:`install` in the main thread before the loop, :meth:`agreed` at each step boundary (collective when a
    process group exists: every rank must call it at the same step), :meth:`restore` after the loop.
    """

    def __init__(self, signals: Sequence[str | int] = STOP_SIGNALS) -> None:
        self.signums = tuple(dict.fromkeys(_signum(s) for s in signals))
        self.received: int | None = None  # the first signal this process got
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers (only the main thread can: returns False elsewhere, nothing installed)."""
        if threading.current_thread() is not threading.main_thread() or self.installed:
            return self.installed
        for signum in self.signums:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:  # a second Ctrl-C: stop now, unsaved
            raise KeyboardInterrupt
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Record a stop as if ``signum`` had arrived (a test, or a caller with its own reason)."""
        self._handle(int(signum), None)

    def agreed(self, device: torch.device | str = "cpu", group: Any = None) -> int | None:
        """The signal any rank of ``group`` recorded (the largest number when several did), or None: the same answer on
        every rank. Collective over the default process group when one is initialised (one small all-reduce)."""
        import torch.distributed as dist

        local = self.received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            flag = torch.tensor([local], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            local = int(flag.item())
        return local or None
