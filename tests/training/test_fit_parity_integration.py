"""`mula fit` with strategy epso (DP=2 x EP=2, EP-aware sharded AdamW) and with plain ddp, same config and seed,
4 CPU processes: the same losses after N optimizer steps (fp32), with warm-up and clipping active."""

from __future__ import annotations

import copy

import pytest

from mula_lightning.testing import run_pooled_test

STEPS = 6


def _fit_both(rank, world_size, config):
    import torch

    from mula_lightning.lightning_cli import build_cli

    results = {}
    strategies = {
        "ddp": "ddp",
        "epso": {"class_path": "mula_lightning.strategies.EPSOStrategy", "init_args": {"ep_size": 2}},
    }
    for name, strategy in strategies.items():
        cfg = copy.deepcopy(config)
        cfg["trainer"]["strategy"] = strategy
        cli = build_cli(cfg, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
        metrics = cli.trainer.callback_metrics
        results[name] = {k: float(metrics[k]) for k in ("train/loss", "train/lm_loss", "train/grad_norm", "val/loss")}
        results[name]["steps"] = cli.trainer.global_step
        torch.distributed.barrier()
    return results


@pytest.mark.distributed
def test_mula_fit_epso_matches_ddp(tiny_config):
    """After 6 steps (2 of warm-up, then clipping at 0.05, which fires), every rank's last training loss, the global
    gradient norm and the all-reduced validation loss agree between epso and ddp within 1e-4."""
    config = copy.deepcopy(tiny_config)
    config["model"].update(grad_clip=0.05, warmup_steps=2)
    config["trainer"].update(
        devices=4,
        max_steps=STEPS,
        val_check_interval=STEPS,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
    )
    results = run_pooled_test(_fit_both, 4, config=config, timeout=300)
    for rank, per_strategy in enumerate(results):
        ddp, epso = per_strategy["ddp"], per_strategy["epso"]
        assert ddp["steps"] == epso["steps"] == STEPS
        assert ddp["train/grad_norm"] > 0.05  # clipping really fired after the warm-up
        for key in ("train/loss", "train/lm_loss", "train/grad_norm", "val/loss"):
            assert abs(ddp[key] - epso[key]) < 1e-4, (rank, key, ddp[key], epso[key])
