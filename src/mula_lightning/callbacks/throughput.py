"""``MulaThroughput``: tokens/s and MFU through Lightning's own :class:`ThroughputMonitor`.

Lightning's monitor already does the hard parts (a sliding window over steps, excluding validation time, logging
on the Trainer's cadence, device and world rates); this subclass only tells it what a Mula batch is (rows of
``input_ids``; items = tokens) and where the peak FLOP/s come from. Lightning knows the peak of some CUDA devices
and none of CPUs or Intel XPUs, and a guessed peak makes a misleading MFU, so MFU is logged only when the user
gives ``peak_tflops`` (here or on :class:`~mula_lightning.lightning_module.MulaLM`).

Logged keys (``train/...``, also ``validate/...`` during validation): ``device/items_per_sec`` (tokens/s of
rank 0), ``items_per_sec`` (world tokens/s, multi-process runs), ``device/flops_per_sec``, ``flops_per_sec`` and
``device/mfu`` (with a peak). FLOPs come from the module's ``flops_per_batch`` (model FLOPs of the step over all
ranks, from the active parameter count: :meth:`MulaConfig.flops_per_token`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def _rows(batch: Any) -> int:
    return int(batch["input_ids"].shape[0])


def _tokens(batch: Any) -> int:
    return int(batch["input_ids"].numel())


class MulaThroughput(ThroughputMonitor):
    """Tokens/s and (with a peak) MFU of a :class:`~mula_lightning.lightning_module.MulaLM` run.

    Args:
        peak_tflops: peak dense TFLOP/s of one device in the training precision; ``None`` takes the module's
            ``peak_tflops``; MFU is logged only when one of them is set.
        window_size: steps in the sliding window the rates are averaged over (first rates after this many steps).
    """

    def __init__(self, peak_tflops: float | None = None, window_size: int = 20) -> None:
        super().__init__(batch_size_fn=_rows, length_fn=_tokens, window_size=window_size)
        self.peak_tflops = peak_tflops

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        peak = self.peak_tflops if self.peak_tflops is not None else getattr(pl_module, "peak_tflops", None)
        self.available_flops = peak * 1e12 if peak else None
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops
