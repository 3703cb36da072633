"""MoEStats: the global statistics are the right reductions of the per-layer router outputs, and with a
WandbLogger (offline) the heatmap image and per-layer histograms reach the W&B run."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger

from mula_lightning.callbacks import MoEStats
from mula_lightning.data import MulaDataModule
from mula_lightning.lightning_module import MulaLM
from mula_lightning.moe.reference import MoEAux

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2)


def _aux(tokens, dropped, lb, z):
    t = torch.tensor
    return MoEAux(t(0.0), t(lb), t(z), t(tokens), t(dropped))


def test_global_stats_imbalance_drops_and_losses():
    """Summed over 2 ranks (the reduce doubles counts and losses): imbalance = max/mean of the kept pairs, dropped
    fraction = dropped / (kept + dropped), losses averaged over ranks, load = shares per layer."""
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=lambda x, reduce_op: 2 * x))
    aux = [_aux([10, 20, 30, 40], 5, 1.5, 0.25), _aux([25, 25, 25, 25], 0, 1.0, 0.5)]
    stats = MoEStats.global_stats(trainer, aux)
    torch.testing.assert_close(stats["imbalance"], torch.tensor([40 / 25, 1.0]))
    torch.testing.assert_close(stats["dropped_frac"], torch.tensor([10 / 210, 0.0]))
    torch.testing.assert_close(stats["load_balance_loss"], torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(stats["z_loss"], torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(stats["load"][0], torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_wandb_offline_receives_heatmap_and_histograms(tiny_data, tmp_path, monkeypatch):
    """A 4-step run with WandbLogger(offline) and wandb_every_n_steps=2: the expert-load heatmap PNGs are written to
    the offline run's media folder and the histograms are in its history; scalars were logged too."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), project="moe-stats-test", offline=True)
    stats = MoEStats(wandb_every_n_steps=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[stats],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(MulaLM(model="mula-tiny-moe", model_overrides=TINY), MulaDataModule(str(tiny_data), micro_batch_size=2))
    run_dir = logger.experiment.dir
    logger.experiment.finish()
    from pathlib import Path

    images = list((Path(run_dir) / "media" / "images" / "moe").glob("expert_load_*.png"))
    assert len(images) == 2  # steps 2 and 4
    assert stats.last_load.shape == (2, 4)
    assert torch.allclose(stats.last_load.sum(dim=1), torch.ones(2))
    assert {"moe/layer_0/imbalance", "moe/imbalance_max", "moe/layer_1/expert_3"} <= set(trainer.logged_metrics)
    assert trainer.logged_metrics["moe/layer_0/imbalance"] >= 1.0 - 1e-6


def test_per_expert_scalars_are_capped(tiny_data, tmp_path):
    """With max_expert_scalars below layers x experts (8), no per-expert scalar is logged, the per-layer ones are."""
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        log_every_n_steps=1,
        logger=False,
        callbacks=[MoEStats(max_expert_scalars=4, wandb_every_n_steps=0)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(MulaLM(model="mula-tiny-moe", model_overrides=TINY), MulaDataModule(str(tiny_data), micro_batch_size=2))
    keys = set(trainer.logged_metrics)
    assert "moe/layer_1/imbalance" in keys and not any("/expert_" in k for k in keys)
