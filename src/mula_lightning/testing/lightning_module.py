"""The smallest LightningModule a strategy test needs: a Mula model built on the meta device in ``configure_model``.

Sharded strategies materialise a meta model themselves (every rank only what it owns), so a module for them builds
its model in ``configure_model`` under ``torch.device("meta")``, trains on token batches as their own labels and
hands AdamW to the strategy. Trainer-level tests of both strategies use this one instead of a copy each.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule

from mula_lightning.models import MulaConfig, MulaForCausalLM

__all__ = ["MetaCausalLM"]


class MetaCausalLM(LightningModule):
    """``MulaForCausalLM(config)`` built on the meta device; the loss of a batch of token ids predicting itself.

    Args:
        config: the model's configuration.
        aux_loss: add the MoE load-balancing loss to the language-model loss.
        **adamw: AdamW's arguments (default: ``lr=1e-2``).
    """

    def __init__(self, config: MulaConfig, aux_loss: bool = True, **adamw: Any) -> None:
        super().__init__()
        self.config, self.aux_loss, self.adamw = config, aux_loss, adamw or {"lr": 1e-2}
        self.model: MulaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = MulaForCausalLM(self.config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.model(batch, labels=batch)
        return out.loss + out.aux_loss if self.aux_loss else out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), **self.adamw)
