"""``StragglerDetection``: the Trainer's sections timed on every rank, slow ranks named every N steps (issue 74).

The scoring, the file and the Fabric helper are :mod:`mula_lightning.utils.stragglers`; this callback puts the
section ends on Lightning's hooks: each micro-batch's ``data`` (from the end of the previous batch to
``on_train_batch_start``: the loader's wait and whatever ran between batches), ``forward`` (to
``on_before_backward``), ``backward`` (to ``on_after_backward``), then ``optimizer`` (clipping and the step, to the
``on_train_batch_end`` where the optimizer step count advanced). A checkpoint saved after a step (seen through
``on_save_checkpoint``) is timed as ``checkpoint`` up to the next batch's start; validation is not timed.

On rank 0 each report goes to ``stragglers.jsonl`` (``MULA_STRAGGLERS_FILE`` under ``mula launch``; otherwise
beside the run's logs) and to the Trainer's loggers (``stragglers/count``, ``stragglers/min_relative_score``,
``stragglers/min_individual_score``, ``stragglers/step_ms``), and a named rank is printed with its host and
section. ``mula fit`` always adds it (section ``stragglers`` of the config)::

    stragglers:
      every_n_steps: 50   # a report (one small all-gather) every 50 optimizer steps
      window: 10          # measured over the 10 steps before each report
      threshold: 0.75     # named below 0.75 of the fastest rank's time
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from mula_lightning.utils.launch_env import STRAGGLERS_ENV
from mula_lightning.utils.stragglers import StragglerMonitor, StragglerReport

__all__ = ["STRAGGLERS_FILE", "StragglerDetection"]

#: the report file's name beside the run's logs (when ``MULA_STRAGGLERS_FILE`` is unset)
STRAGGLERS_FILE = "stragglers.jsonl"


class StragglerDetection(Callback):
    """Name the ranks that make the others wait (see :mod:`mula_lightning.utils.stragglers`).

    Args:
        every_n_steps: optimizer steps between reports; 0 turns the callback off.
        window: the steps before each report that are timed.
        threshold: relative score below which a rank is named.
        min_lag: the smallest lag that names a rank, as a fraction of the median step time.
        min_lag_ms: and in milliseconds.
        path: the report file (default: ``MULA_STRAGGLERS_FILE``, else ``stragglers.jsonl`` in the Trainer's log
            directory).
        synchronize: synchronize the device at each section end of the timed steps (default: on CUDA / XPU).
    """

    def __init__(self, every_n_steps: int = 50, window: int = 10, threshold: float = 0.75, min_lag: float = 0.2,
                 min_lag_ms: float = 2.0, path: str | None = None,
                 synchronize: bool | None = None) -> None:  # fmt: skip
        if every_n_steps < 0:
            raise ValueError(f"stragglers every_n_steps ({every_n_steps}) must be >= 0 (0 = off)")
        self.every_n_steps, self.window, self.threshold, self.min_lag = every_n_steps, window, threshold, min_lag
        self.min_lag_ms, self.path, self.synchronize = min_lag_ms, path, synchronize
        if every_n_steps:  # the arguments are checked now, not at the start of training
            self._monitor(None, None)
        self.monitor: StragglerMonitor | None = None
        self._step = 0  # the optimizer steps done at the previous batch end
        self._saved = False  # a checkpoint was saved since the last step ended

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self.every_n_steps:
            return
        path = self.path or os.environ.get(STRAGGLERS_ENV) or str(Path(trainer.log_dir or ".") / STRAGGLERS_FILE)
        self.monitor = self._monitor(path, trainer.strategy.root_device)

    def _monitor(self, path: str | None, device: Any) -> StragglerMonitor:
        return StragglerMonitor(
            self.every_n_steps, min(self.window, self.every_n_steps), self.threshold, self.min_lag, self.min_lag_ms,
            path=path, synchronize=self.synchronize, device=device,
        )  # fmt: skip

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step, self._saved = trainer.global_step, False
        if self.monitor is not None:
            self.monitor.restart(trainer.global_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self._saved:  # the stretch since the step's end held a save: it is the checkpoint's time
            self._saved = False
            self.monitor.outside("checkpoint", self.monitor.step_started)
        self.monitor.mark("data")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.monitor is not None:
            self.monitor.mark("forward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.mark("backward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or trainer.global_step == self._step:  # a micro-batch: the step goes on
            return
        self._step = trainer.global_step
        self.monitor.mark("optimizer")
        report = self.monitor.step_done(trainer.global_step)
        if report is not None:
            self._publish(trainer, report)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._saved = True

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None and not trainer.sanity_checking:
            self.monitor.resume()

    @staticmethod
    def _publish(trainer: Any, report: StragglerReport) -> None:
        metrics = {
            "stragglers/count": float(len(report.stragglers)),
            "stragglers/min_relative_score": report.min_relative,
            "stragglers/min_individual_score": report.min_individual,
            "stragglers/step_ms": report.step_ms,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=report.step)
        for s in report.stragglers:
            print(
                f"straggler at step {report.step}: rank {s.rank} on {s.host} fell behind in {s.section} "
                f"(relative score {s.relative:.2f} < {report.threshold:g}, {s.lag_ms:.1f} ms late; "
                f"individual score {s.individual:.2f})",
                file=sys.stderr,
                flush=True,
            )
