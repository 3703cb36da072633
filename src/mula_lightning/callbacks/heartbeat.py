"""``Heartbeat``: every rank tells the launcher its step and phase, so that a hang is seen within seconds.

Why: a rank that stops making progress (a node frozen, a GPU that hangs, a process stopped) does not exit; the
other ranks then wait in their next collective until the process group's timeout (30 minutes by default), and a
job can sit idle for hours. ``mula launch`` (:mod:`mula_lightning.launch`) runs a store and gives every rank its
address in ``MULA_HEARTBEAT``; this callback writes one small record per rank at the start of training and after
every training and validation batch (the protocol: :mod:`mula_lightning.utils.launch_env`; one more, ``setup``,
before the checkpoint is loaded, which splits a restart's cost into starting and reloading), and the launcher
declares a hang when a rank's record has not changed for ``--hang-timeout`` seconds. The records also tell the
launcher the step each attempt resumed from and when its first step ran (the "time lost" of a restart).

The timeout must exceed the longest silent stretch of a healthy run: the slowest step, a checkpoint save, a
validation batch. Without ``MULA_HEARTBEAT`` the callback does nothing (``mula fit`` adds it only when the variable
is set). A Fabric loop calls :class:`~mula_lightning.utils.launched_loop.LaunchedLoop` at the same points (it beats
with :class:`~mula_lightning.utils.launch_env.HeartbeatClient`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint
from mula_lightning.utils.launch_env import HeartbeatClient

__all__ = ["Heartbeat"]


class Heartbeat(Callback):
    """Report ``step`` and phase to the launcher's store after each batch (a no-op without ``MULA_HEARTBEAT``).

    Args:
        address: ``host:port`` of the store (default: ``MULA_HEARTBEAT``).
        connect_timeout_s: how long to wait for the store when connecting.
    """

    def __init__(self, address: str | None = None, connect_timeout_s: float = 60.0) -> None:
        self.client = HeartbeatClient(address, connect_timeout_s)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":  # processes up and the group formed; the checkpoint is loaded after this
            self.client.beat(trainer.global_step, "setup", trainer.global_rank)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.client.beat(trainer.global_step, "start", trainer.global_rank)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.client.beat(trainer.global_step, "train", trainer.global_rank, saved=_saved(trainer))

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self.client.beat(trainer.global_step, "validation", trainer.global_rank, saved=_saved(trainer))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.client.beat(trainer.global_step, "end", trainer.global_rank, saved=_saved(trainer))
        self.client.flush(timeout_s=5.0)  # the sender is a daemon thread: deliver the end before the process ends


def _saved(trainer: Any) -> bool:
    """Whether a DualCheckpoint of this trainer saved a slot in this process (the launcher's resume switch)."""
    return any(isinstance(cb, DualCheckpoint) and cb.saves_this_process for cb in trainer.callbacks)
