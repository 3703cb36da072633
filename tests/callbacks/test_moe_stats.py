"""MoEStats on a user's own LightningModule: it finds the MoE statistics of any module holding a MulaForCausalLM,
and says once when there is nothing to log."""

from __future__ import annotations

import csv
import warnings

import lightning.pytorch as pl
import pytest
import torch

from mula_lightning.callbacks import MoEStats
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.moe.balancing import install_expert_bias_update

VOCAB, SEQ = 64, 16


class _UserModule(pl.LightningModule):
    """A minimal user module: a MulaForCausalLM attribute, its own training_step, no ``last_moe_aux``."""

    def __init__(self, preset: str) -> None:
        super().__init__()
        sizes = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2)
        config = MulaConfig.from_name(preset, **sizes)
        self.net = MulaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.net(ids, labels=ids)
        return out.loss + out.aux_loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(module, tmp_path, callback):
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (12, SEQ)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        log_every_n_steps=1,
        callbacks=[callback],
        logger=pl.loggers.CSVLogger(tmp_path, name="user"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    path = tmp_path / "user" / "version_0" / "metrics.csv"
    if not path.exists():  # nothing was logged at all
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_statistics_of_a_user_module_holding_a_mula_model(tmp_path):
    """Without ``last_moe_aux``, the callback hooks the MulaForCausalLM inside the module: every step logs per-layer
    imbalance and the overall figures, and the last load shares are one distribution per MoE layer."""
    module = _UserModule("mula-tiny-moe")
    callback = MoEStats(wandb_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MoEStats has nothing to log")
        rows = _fit(module, tmp_path, callback)
    logged = [r for r in rows if r.get("moe/imbalance_max")]
    assert len(logged) == 3 and all(r["moe/layer_1/imbalance"] for r in logged)
    load = callback.last_load
    assert load.shape == (2, module.net.config.num_experts)
    torch.testing.assert_close(load.sum(dim=1), torch.ones(2))
    assert not callback._handles  # hooks removed at the end of training


def test_nothing_to_log_warns_once(tmp_path, recwarn):
    """A dense model has no MoE statistics: one warning names the module, no moe/ key is logged."""
    rows = _fit(_UserModule("mula-tiny-dense"), tmp_path, MoEStats(wandb_every_n_steps=0))
    messages = [str(w.message) for w in recwarn.list if "MoEStats has nothing to log" in str(w.message)]
    assert messages == [
        "MoEStats has nothing to log: _UserModule sets no `last_moe_aux` and holds no MulaForCausalLM with MoE layers"
    ]
    assert not any(k.startswith("moe/") for r in rows for k, v in r.items() if v)


class _BiasedModule(_UserModule):
    """A user module whose model balances with a selection bias, its update installed on the user's optimizer."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        sizes = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2)
        self.net = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", bias_update_rate=0.05, **sizes))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        install_expert_bias_update(optimizer, self)
        return optimizer


def test_selection_bias_is_logged_per_layer(tmp_path):
    """With auxiliary-loss-free balancing every logged step has each layer's bias range, and the last logged biases
    are the routers' own after the step's update (moved from zero)."""
    module = _BiasedModule()
    callback = MoEStats(wandb_every_n_steps=0)
    rows = [r for r in _fit(module, tmp_path, callback) if r.get("moe/imbalance_max")]
    assert len(rows) == 3
    assert all(r["moe/layer_0/expert_bias_min"] and r["moe/layer_1/expert_bias_max"] for r in rows)
    biases = torch.stack([m.mlp.gate.e_score_correction_bias for m in module.net.model.layers])
    assert torch.equal(callback.last_bias, biases) and biases.abs().max() > 0
    assert float(rows[-1]["moe/layer_1/expert_bias_max"]) == pytest.approx(biases[1].max().item(), rel=1e-6)
