"""How often a training step reads tensor values back to the host (on an accelerator, each read waits for every
kernel launched so far): once per step, the NaN detector's flag, whatever else ``mula fit`` runs beside the model."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Callback, Trainer

from mula_lightning.callbacks import MoEStats, MulaProgress, MulaThroughput, NaNDetector
from mula_lightning.data import MulaDataModule
from mula_lightning.lightning_module import MulaLM
from mula_lightning.testing import HostReads, counting_host_reads

TINY = dict(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2)
#: the CPU experts take their group sizes on the host (free there); on accelerators they stay on the device
#: (``moe/experts.py``'s ``GroupSizes``, checked by ``make gpu-check`` with CUDA's sync debug mode)
CPU_ONLY_READ = os.path.join("moe", "experts.py")


class _CountFromStep(Callback):
    """Counts the host reads of every training step from ``start`` on (earlier steps build lazy state)."""

    def __init__(self, start: int) -> None:
        self.start, self.steps, self.reads, self._mode = start, 0, HostReads(), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.start:
            self._mode = counting_host_reads()
            self.reads = self._mode.__enter__()
        self.steps += batch_idx >= self.start

    def on_train_end(self, trainer, pl_module) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)


@pytest.mark.parametrize("progress_bar", [False, True])
def test_a_training_step_reads_the_device_once(tiny_data, tmp_path, progress_bar):
    """A MulaLM step under the Trainer with the NaN detector, MoE statistics, throughput and progress callbacks (steps
    that log and print nothing: the progress lines read the loss on their own steps only) reads the host once: the
    NaN detector's flag (one ``tolist``, formerly ``nonzero`` + ``tolist``: two waits on an accelerator). Lightning
    reads the progress bar's metrics at every step, bar or no bar: ``MulaLM`` puts its loss there only when a bar
    shows it, so a run without one pays nothing (with a bar, Lightning's reads for it are its own and not counted
    here). The only other reads are the CPU experts' group sizes (one per MoE layer, CPU only)."""
    counter = _CountFromStep(start=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=7,
        log_every_n_steps=1000,  # no logging step among them: what a step costs between logs
        callbacks=[
            counter,
            NaNDetector(str(tmp_path / "nan")),
            MoEStats(),
            MulaThroughput(window_size=2),
            MulaProgress(mode="lines"),
        ],  # fmt: skip
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(MulaLM(model="mula-tiny-moe", model_overrides=TINY), MulaDataModule(str(tiny_data), micro_batch_size=2))
    reads, steps = counter.reads, counter.steps
    assert steps == 5
    by_nan = reads.total(os.path.join("utils", "non_finite.py"))  # NaNDetector runs NonFiniteCheck
    by_experts = reads.total(CPU_ONLY_READ)
    by_lightning = reads.total(os.sep + "lightning" + os.sep)
    assert by_nan == steps, reads.sites
    assert by_experts == steps * TINY["num_layers"], reads.sites
    if not progress_bar:
        assert by_lightning == 0, reads.sites
    assert reads.total() == by_nan + by_experts + by_lightning, reads.sites
