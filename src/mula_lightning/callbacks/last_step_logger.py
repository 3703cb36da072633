"""``LastStepLogger``: the metrics of the final training step reach the loggers, whatever ``log_every_n_steps`` is.

Lightning writes training metrics only on steps that are multiples of ``trainer.log_every_n_steps`` (50 by
default). A run shorter than that (``--trainer.max_steps 3``: a smoke test, a first try) logs no training row at all,
and a longer one loses its last steps after the final multiple; ``metrics.csv`` is then empty or ends early, and
``mula report`` has nothing to plot. When training ends normally this callback writes the final step's metrics
(the latest value of every scalar the module and the callbacks logged, as held in ``trainer.callback_metrics``,
validation and test metrics excepted) to every logger at that step, then flushes each logger, so the CSV file is
complete on disk before the process exits. ``mula fit`` always adds it (section ``last_step`` of the config).

Loggers are rank-zero only in Lightning, so nothing is duplicated over ranks, and ``log_every_n_steps: 0`` (logging
switched off) is respected.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

__all__ = ["LastStepLogger"]

EVAL_PREFIXES = ("val", "test")


class LastStepLogger(Callback):
    """Log the final training step's metrics when Lightning's interval skipped it, and flush every logger.

    Args:
        enabled: switch the callback off without removing it from a config.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.logged_step: int | None = None  # the step written by this callback, for tests and reports

    @staticmethod
    def was_logged(trainer: Any) -> bool:
        """Whether Lightning wrote the last optimizer step's row itself (its rule: ``(step + 1) % every == 0``, with
        ``step = global_step - 1`` counted from 0)."""
        every = trainer.log_every_n_steps
        return every > 0 and trainer.global_step % every == 0

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.enabled or trainer.log_every_n_steps == 0 or trainer.global_step == 0:
            return
        if not self.was_logged(trainer):
            metrics = {
                name: float(value)
                for name, value in trainer.callback_metrics.items()
                if not name.startswith(EVAL_PREFIXES) and isinstance(value, torch.Tensor) and value.numel() == 1
            }
            if metrics:
                metrics["epoch"] = trainer.current_epoch  # as Lightning's own rows carry it
                step = trainer.global_step - 1  # Lightning's row index of the last step
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
                self.logged_step = step
        for logger in trainer.loggers:
            logger.save()
