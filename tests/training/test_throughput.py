"""MulaThroughput: tokens/s are logged once the window is full, and MFU only when a peak is given (Lightning knows no
CPU peak, and a guessed one would mislead); the FLOPs are the module's model FLOPs per step."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from mula_lightning.callbacks import MulaThroughput
from mula_lightning.data import MulaDataModule
from mula_lightning.lightning_module import MulaLM

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2)


def _fit(tiny_data, tmp_path, callback, **module_kwargs):
    from lightning.pytorch.loggers import CSVLogger

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        log_every_n_steps=1,
        callbacks=[callback],
        logger=CSVLogger(str(tmp_path), name="t"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, **module_kwargs)
    trainer.fit(lm, MulaDataModule(str(tiny_data), micro_batch_size=2))
    return trainer, lm


def test_tokens_per_second_without_mfu(tiny_data, tmp_path):
    """No peak anywhere: tokens/s and FLOP/s are logged, MFU is not."""
    trainer, lm = _fit(tiny_data, tmp_path, MulaThroughput(window_size=2))
    keys = set(trainer.logged_metrics)
    assert trainer.logged_metrics["train/device/items_per_sec"] > 0
    assert "train/device/flops_per_sec" in keys and "train/device/mfu" not in keys
    assert lm.flops_per_batch == pytest.approx(lm.config.flops_per_token(32) * 2 * 32)


@pytest.mark.parametrize("where", ["callback", "module"])
def test_mfu_with_a_peak(tiny_data, tmp_path, where):
    """A peak on the callback or on the module: MFU = model FLOP/s / (peak TFLOP/s x 1e12)."""
    callback = MulaThroughput(window_size=2, peak_tflops=0.5 if where == "callback" else None)
    trainer, _ = _fit(tiny_data, tmp_path, callback, **({"peak_tflops": 0.5} if where == "module" else {}))
    metrics = trainer.logged_metrics
    assert float(metrics["train/device/mfu"]) == pytest.approx(float(metrics["train/device/flops_per_sec"]) / 0.5e12)


def _fit_context_parallel(rank, world_size, data, logs):
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger

    from mula_lightning.strategies import EPSOStrategy

    class Keep(Callback):  # the logged metrics before Lightning's teardown
        def on_train_end(self, trainer, pl_module):
            self.metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}

    keep = Keep()
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=EPSOStrategy(cp_size=2), max_steps=4,
                      log_every_n_steps=1, callbacks=[MulaThroughput(window_size=2, peak_tflops=0.5), keep],
                      logger=CSVLogger(logs, name="t"), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      limit_val_batches=0)  # fmt: skip
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY)
    trainer.fit(lm, MulaDataModule(data, micro_batch_size=2))
    return keep.metrics, lm.flops_per_batch, lm.config.flops_per_token(32)


@pytest.mark.distributed
def test_ranks_sharing_a_batch_are_counted_once(tiny_data, tmp_path):
    """2 processes at CP 2 read one batch together: the FLOPs are that batch's (2 x 32 tokens), no world rate is
    logged beside the batch's own (one distinct batch; Lightning's world size would have doubled the tokens/s and
    FLOP/s), and MFU is over the 2 ranks' peaks."""
    from mula_lightning.testing import run_pooled_test

    (metrics, flops, per_token), (_, other, _) = run_pooled_test(
        _fit_context_parallel, 2, data=str(tiny_data), logs=str(tmp_path), timeout=300
    )
    assert flops == other == pytest.approx(per_token * 2 * 32)  # rank 0 logs the rates
    assert metrics["train/device/items_per_sec"] > 0 and "train/items_per_sec" not in metrics, metrics
    assert "train/flops_per_sec" not in metrics
    assert metrics["train/device/mfu"] == pytest.approx(metrics["train/device/flops_per_sec"] / (2 * 0.5e12))
