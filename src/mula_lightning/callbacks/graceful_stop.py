"""``GracefulStop``: a run stopped from outside saves, says where it resumes, and does not look finished (issue 76).

Before, SIGTERM (``kill``, a SLURM time limit, a preemption) went to Lightning's handler, which raises
``SIGTERMException`` at the next batch: a ``SystemExit`` without a code, so the process exited 0 having saved
nothing, and a job script's ``mula fit ... && mula export ...`` went on as if training had finished; Ctrl-C exited 1
without a save or a word about which step a resume would start from.

This callback replaces the handlers of SIGTERM, SIGUSR1 and SIGINT for the training loop
(:class:`~mula_lightning.utils.stop_request.StopRequest`). At each optimizer-step boundary every rank asks whether
any rank got one (a small all-reduce; a signal sent to rank 0 alone stops every rank at the same step). When one did,
the step in progress has finished: the run saves a resumable checkpoint now (every ``DualCheckpoint`` of the Trainer,
or ``last.ckpt`` of a ``ModelCheckpoint``), rank 0 prints one line (the signal, the step, the checkpoint, how to
resume), the Trainer stops, and ``mula fit`` exits with ``128 + signal`` (143 for SIGTERM).

How long a stop takes: the rest of the optimizer step in progress (a validation in progress finishes first), plus the
save. Give SLURM that much warning: ``#SBATCH --signal=USR1@120`` (or ``B:TERM@120``) sends the signal 120 s before
the time limit; SLURM's own ``KillWait`` (30 s by default) between SIGTERM and SIGKILL is short for a large model.

Under SLURM with Lightning's auto-requeue (``SLURMEnvironment(auto_requeue=True)``, its default) the requeue signal
(SIGUSR1 unless configured) also requeues the job after the save, as Lightning's own handler does (``scontrol
requeue``, from rank 0): the requeued job resumes with ``--ckpt_path last``.

A second Ctrl-C stops at once without saving (Lightning's interrupt: exit status 1); the line then names the last
saved step. ``mula fit`` always adds this callback (section ``stop`` of the config); a Trainer script adds it itself
and ends with ``sys.exit(stop.exit_code)``.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from mula_lightning.utils.stop_request import STOP_SIGNALS, StopRequest, signal_exit_code

__all__ = ["GracefulStop"]

log = logging.getLogger(__name__)


class GracefulStop(Callback):
    """Save and stop at the next optimizer-step boundary when the run is sent a stop signal.

    Args:
        signals: the signals that stop the run (names or numbers); ``[]`` leaves Lightning's handlers alone.
        save: write a resumable checkpoint at the stop (the Trainer's ``DualCheckpoint`` / ``ModelCheckpoint``).

    After ``trainer.fit`` returns, :attr:`stopped_by` names the signal (None when the run was not stopped),
    :attr:`stopped_at_step` the last step trained and :attr:`exit_code` the status to exit with (0 when not stopped).
    """

    def __init__(self, signals: list[str] | None = None, save: bool = True) -> None:
        self.request = StopRequest(STOP_SIGNALS if signals is None else signals)
        self.save = save
        self.stopped_by: str | None = None
        self.stopped_at_step: int | None = None
        self.saved: list[str] = []

    @property
    def exit_code(self) -> int:
        """``128 + signal`` after a stop (what a shell reports for a process that signal ended), else 0."""
        if self.stopped_by is None:
            return 0
        return signal_exit_code(getattr(signal, self.stopped_by))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning registered its own handlers (just before the loop runs): ours replace them for the loop
        if self.request.signums:
            self.request.install()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.request.installed or self.stopped_by is not None:
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():  # the optimizer step in progress is not finished
            return
        signum = self.request.agreed(trainer.strategy.root_device)
        if signum is None:
            return
        self.stopped_by, self.stopped_at_step = signal.Signals(signum).name, trainer.global_step
        start = time.monotonic()
        if self.save:
            self.saved = self._save(trainer)
        trainer.should_stop = True
        requeued = _requeue_slurm_job(trainer, signum)
        if trainer.is_global_zero:
            where = (
                f"saved {', '.join(self.saved)} in {time.monotonic() - start:.1f} s; resume with --ckpt_path last "
                "(ckpt_path='last')"
                if self.saved
                else "nothing saved (no checkpoint callback)"
            )
            print(
                f"mula: {self.stopped_by} received: stopped after step {trainer.global_step}, {where}"
                f"{f'; {requeued}' if requeued else ''}; exit code {self.exit_code}",
                file=sys.stderr,
                flush=True,
            )

    def _save(self, trainer: Any) -> list[str]:
        """Write a resumable checkpoint with every checkpoint callback that makes one (collective)."""
        from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint

        saved = []
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, DualCheckpoint):
                if callback.last_saved_step != trainer.global_step:
                    saved.append(str(callback.save(trainer)))
                    callback.wait()
                else:
                    saved.append(f"{callback.dirpath} (step {trainer.global_step} was just saved)")
            elif isinstance(callback, ModelCheckpoint) and callback.dirpath:
                path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
                trainer.save_checkpoint(path)
                saved.append(str(path))
        return saved

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A stop that did not wait for the step boundary (a second Ctrl-C; Lightning's ``SIGTERMException`` before
        the loop started): name the last saved step, since nothing was saved now."""
        self.request.restore()
        if not trainer.is_global_zero or not isinstance(exception, (KeyboardInterrupt, SystemExit)):
            return
        steps = [getattr(c, "last_saved_step", -1) for c in trainer.checkpoint_callbacks]
        last = max(steps, default=-1)
        resume = f"a resume (--ckpt_path last) starts after step {last}" if last > 0 else "no checkpoint was saved"
        print(f"mula: interrupted at step {trainer.global_step} without saving; {resume}", file=sys.stderr, flush=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.request.restore()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.request.restore()


def _requeue_slurm_job(trainer: Any, signum: int) -> str | None:
    """Requeue the SLURM job after a stop by Lightning's requeue signal, as Lightning's own handler does (rank 0
    runs ``scontrol requeue JOB``); what was done, or None when the run is not a SLURM job with auto-requeue."""
    import os
    import subprocess

    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    if signum != int(environment.requeue_signal or 0) or not trainer.is_global_zero:
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not job:
        return "not requeued (no SLURM_JOB_ID)"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({err})"
    if result.returncode:
        return f"scontrol requeue {job} failed (exit {result.returncode}: {result.stderr.strip()[:200]})"
    return f"SLURM job {job} requeued"
