"""``NaNDetector``: find the rank whose loss or gradients went non-finite, stop every rank together, name the host.

Why (Aurora paper, Section 4, "Soft node failure handling"): a failing accelerator can keep running and produce
NaN/Inf locally; once gradients are reduced the NaN is on every rank and nobody knows where it came from. The check
itself (gradient hooks, one all-reduce of one flag per optimizer step, the report, ``nan_events.jsonl`` for
``mula launch``, every rank exiting with :data:`NAN_EXIT_CODE` before the update) is
:class:`~mula_lightning.utils.non_finite.NonFiniteCheck`, which a Fabric loop uses directly; this callback drives it
from Lightning's hooks: the model is watched in ``on_fit_start`` (after the strategy set it up), the loss in
``on_before_backward``, the per-step check runs in ``on_before_optimizer_step`` (before clipping and the update).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from mula_lightning.utils.launch_env import FAILED_HOSTS_ENV, NAN_EXIT_CODE, host_name
from mula_lightning.utils.non_finite import FAILED_HOSTS_NAME, NAN_EVENTS_NAME, REPORT_NAME, NonFiniteCheck


class NaNDetector(Callback):
    """Stop the run on the first non-finite local loss or gradient; report the rank, host and tensors.

    Args:
        report_dir: directory of ``nan_report.json``, of ``nan_events.jsonl`` (one JSON record per offending host
            and event: step, ranks, expert-parallel groups, the event's size) and of the failed-hosts file by
            default.
        failed_hosts_file: the host list the offending hosts are added to, one name per line, each once (default
            ``report_dir/failed_hosts.txt``): ``srun --exclude=$(paste -sd, failed_hosts.txt)`` leaves them out.
            Under ``mula launch`` the launcher's own ``failed_hosts.txt`` lists the hosts it took out, and its
            ``nan_events.jsonl`` receives the events (what it attributes from).
        exit_code: the exit status of every rank after a detection (default :data:`NAN_EXIT_CODE`).
        max_tensors: how many offending tensors the report names per rank (first seen first).

    The check runs in ``on_before_optimizer_step``, i.e. with automatic optimization; a LightningModule that
    steps its optimizers itself (manual optimization) calls ``detector.on_before_optimizer_step(trainer, self,
    optimizer)`` before each ``optimizer.step()``.
    """

    def __init__(
        self,
        report_dir: str | Path,
        failed_hosts_file: str | Path | None = None,
        exit_code: int = NAN_EXIT_CODE,
        max_tensors: int = 8,
    ) -> None:
        self.report_dir = Path(report_dir)
        self.failed_hosts_file = Path(failed_hosts_file) if failed_hosts_file else self.report_dir / FAILED_HOSTS_NAME
        self.exit_code = int(exit_code)
        self.max_tensors = max_tensors
        self.check: NonFiniteCheck | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Hook every trainable parameter; called after the strategy set the model up (parameters are final)."""
        if self.check is not None:
            self.check.close()
        ep_size = int(getattr(getattr(trainer.strategy, "topology", None), "ep_size", 1) or 1)
        self.check = NonFiniteCheck(
            self.report_dir,
            self.failed_hosts_file,
            self.exit_code,
            self.max_tensors,
            ep_size=ep_size,
            local_rank=trainer.local_rank,
        ).watch(pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.check is not None:
            self.check.close()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.check is not None:
            self.check.loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The per-step check: one all-reduce of one flag per rank; exit on every rank when any flag is set."""
        if self.check is not None:
            self.check.step(trainer.global_step)


__all__ = [
    "FAILED_HOSTS_ENV",
    "FAILED_HOSTS_NAME",
    "NAN_EVENTS_NAME",
    "NAN_EXIT_CODE",
    "REPORT_NAME",
    "NaNDetector",
    "host_name",
]
