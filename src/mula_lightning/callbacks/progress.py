"""``MulaProgress``: a run says how it is doing while it trains (issue 75).

Before, every shipped config switched Lightning's progress bar off (it fills a log file with carriage returns) and
nothing replaced it: minutes of silence on the demo, a SLURM log with nothing about loss, speed, memory or time left
until the run ended or died. This callback prints the line of :class:`~mula_lightning.utils.progress.ProgressMeter`
on the global rank 0 every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) and at
the end, and one line with the validation results when they come. ``mula fit`` always adds it (section
``progress`` of the config)::

    progress:
      mode: auto          # lines when the output is not a terminal, Lightning's bar when it is; lines | bar | off
      every_n_steps: null # = trainer.log_every_n_steps

``auto`` chooses per run: on a terminal with the Trainer's progress bar on (``enable_progress_bar: true``, as the
shipped configs set it) the bar shows the loss and these lines stay off; otherwise (a log file, SLURM, a pipe) the
lines print and ``mula fit`` takes the bar away (:func:`resolve_progress_bar`), since a bar writes nothing readable
there. The loss and the learning rate are read from what the module logged (``train/loss``, ``train/aux_loss``,
``train/lr``), on the printing steps only: the other steps read nothing back from the device.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ProgressBar

from mula_lightning.utils.progress import ProgressMeter

__all__ = ["PROGRESS_MODES", "MulaProgress", "resolve_progress_bar"]

PROGRESS_MODES = ("auto", "lines", "bar", "off")


class MulaProgress(Callback):
    """Progress lines of a Trainer run on the global rank 0.

    Args:
        mode: ``"auto"`` (lines unless the output is a terminal and the Trainer shows its progress bar),
            ``"lines"``, ``"bar"`` (Lightning's bar only) or ``"off"``.
        every_n_steps: optimizer steps between lines; None takes the Trainer's ``log_every_n_steps``; 0 prints the
            last line only.
        peak_tflops: peak dense TFLOP/s of one device (MFU is printed with it); None takes the module's.
        stream: where lines go (default: standard output).
    """

    def __init__(self, mode: str = "auto", every_n_steps: int | None = None, peak_tflops: float | None = None,
                 stream: TextIO | None = None) -> None:  # fmt: skip
        if mode not in PROGRESS_MODES:
            raise ValueError(f"progress mode {mode!r} is not one of {PROGRESS_MODES}")
        if every_n_steps is not None and every_n_steps < 0:
            raise ValueError(f"progress every_n_steps ({every_n_steps}) must be >= 0 or null")
        self.mode, self.every_n_steps, self.peak_tflops, self.stream = mode, every_n_steps, peak_tflops, stream
        self.meter: ProgressMeter | None = None

    def prints_lines(self, trainer: Any) -> bool:
        """Whether this run prints lines (see ``mode``)."""
        if self.mode in ("bar", "off"):
            return False
        if self.mode == "lines":
            return True
        stream = self.stream or sys.stdout
        on_terminal = bool(getattr(stream, "isatty", lambda: False)())
        return not (on_terminal and trainer.progress_bar_callback is not None)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        every = trainer.log_every_n_steps if self.every_n_steps is None else self.every_n_steps
        peak = self.peak_tflops if self.peak_tflops is not None else getattr(pl_module, "peak_tflops", None)
        self.meter = ProgressMeter(
            max_steps=trainer.max_steps, every_n_steps=every, world_size=trainer.world_size,
            enabled=trainer.is_global_zero and self.prints_lines(trainer), peak_tflops=peak, stream=self.stream,
        )  # fmt: skip

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is not None:
            self.meter.device = pl_module.device
            if self.meter.max_steps is None and self.meter.enabled:  # max_epochs instead: the steps they make
                total = trainer.estimated_stepping_batches
                self.meter.max_steps = int(total) if math.isfinite(total) and total > 0 else None
            self.meter.restart(trainer.global_step)  # a resume starts its interval at the restored step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        meter = self.meter
        if meter is None or not meter.enabled:
            return
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        sampler = getattr(trainer, "distributed_sampler_kwargs", None) or {}
        batch_tokens = int(getattr(ids, "numel", lambda: 0)())
        tokens = batch_tokens * int(sampler.get("num_replicas", 1))  # every distinct batch of the step
        flops = getattr(pl_module, "flops_per_batch", None)  # the model FLOPs of this batch
        if flops and batch_tokens:
            meter.flops_per_token = flops / batch_tokens
        meter.add_tokens(tokens)
        meter.step(trainer.global_step, **self._metrics(trainer, pl_module))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is None or not self.meter.enabled or trainer.sanity_checking:
            return
        results = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        if results:
            text = " | ".join(f"{k} {float(v):.4f}" for k, v in sorted(results.items()))
            print(f"validation at step {trainer.global_step}: {text}", file=self.stream or sys.stdout, flush=True)
        self.meter.restart(trainer.global_step)  # the pause is not training time

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is not None:
            self.meter.finish(trainer.global_step, **self._metrics(trainer, pl_module))

    @staticmethod
    def _metrics(trainer: Any, pl_module: Any) -> dict[str, Any]:
        """Readers of the logged loss, auxiliary loss (MoE models only) and learning rate: called on printing steps."""
        metrics = trainer.callback_metrics

        def read(key: str) -> Any:
            return lambda: float(metrics[key]) if key in metrics else None

        moe = getattr(getattr(pl_module, "config", None), "num_experts", 0) > 0
        return {"loss": read("train/loss"), **({"aux": read("train/aux_loss")} if moe else {}), "lr": read("train/lr")}


def resolve_progress_bar(trainer: Any) -> None:
    """Take Lightning's progress bar away when the run's :class:`MulaProgress` prints lines instead (``auto`` off a
    terminal, or ``lines``): a bar writes carriage returns into a log file."""
    progress = [c for c in trainer.callbacks if isinstance(c, MulaProgress)]
    if progress and progress[0].prints_lines(trainer):
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, ProgressBar)]
