"""``MulaThroughput``: tokens/s and MFU through Lightning's own :class:`ThroughputMonitor`.

Lightning's monitor already does the hard parts (a sliding window over steps, excluding validation time, logging
on the Trainer's cadence, device and world rates); this subclass only tells it what a Mula batch is (rows of
``input_ids``; items = tokens) and where the peak FLOP/s come from. Lightning knows the peak of some CUDA devices
and none of CPUs or Intel XPUs, and a guessed peak makes a misleading MFU, so MFU is logged only when the user
gives ``peak_tflops`` (here or on :class:`~mula_lightning.lightning_module.MulaLM`).

Logged keys (``train/...``, also ``validate/...`` during validation): ``device/items_per_sec`` (tokens/s of
rank 0's batch), ``items_per_sec`` (world tokens/s, when several distinct batches are read), ``device/flops_per_sec``,
``flops_per_sec`` and ``device/mfu`` (with a peak). FLOPs come from the module's ``flops_per_batch`` (model FLOPs of
one batch, from the active parameter count: :meth:`MulaConfig.flops_per_token`).

Lightning multiplies a rank's figures by the world size to get the world's, right when every rank reads its own
batch. Under tensor, context or pipeline parallelism the ``tp x cp x pp`` ranks of a group read one batch and share
its work, so the world is counted here in distinct batches (the strategy's ``distributed_sampler_kwargs``) and a
"device" of the logged keys is such a group: its MFU is over the group's peak (its ranks' peaks summed). Otherwise
the world's tokens/s and FLOP/s would be ``tp x cp x pp`` times too many.
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
        sampler = getattr(trainer, "distributed_sampler_kwargs", None) or {}
        batches = int(sampler.get("num_replicas", trainer.world_size))  # distinct batches a step reads
        group = max(1, trainer.world_size // batches)  # the ranks that read one batch together
        self.available_flops = peak * 1e12 * group if peak else None
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops
            throughput.world_size = batches
