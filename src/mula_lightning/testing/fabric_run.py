"""A tiny MoE and one Fabric training step under a given strategy: the common start of checkpoint tests.

Checkpoint tests need a model whose every tensor has moved off its initial values (so a save or load that dropped
something shows), on a real strategy with real processes; this is that start, in one place.
"""

from __future__ import annotations

from typing import Any

import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM

__all__ = ["clipped_fabric_steps", "fabric_after_one_step", "tiny_moe_config"]


def tiny_moe_config(**overrides: Any) -> MulaConfig:
    """A 2-layer MoE of hidden size 16 (vocabulary 64, 4 experts, top-2, FastSparseMoE): seconds to train on CPU."""
    shape = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=8)
    return MulaConfig.from_name("mula-tiny-moe", **{**shape, "num_experts": 4, "top_k": 2, "moe_impl": "fast",
                                                    **overrides})  # fmt: skip


def fabric_after_one_step(strategy: Any, world_size: int, rank: int, config: MulaConfig | None = None, lr=1e-2):
    """``(fabric, model, optimizer)`` after one AdamW step on this rank's tokens (seeded by ``rank``), the model built
    on the meta device and set up by ``strategy`` (call from a rank function of ``run_distributed_test``)."""
    from lightning.fabric import Fabric

    config = config or tiny_moe_config()
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    x = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = model(x, labels=x)
    fabric.backward(out.loss + out.aux_loss)
    optimizer.step()
    return fabric, model, optimizer


def clipped_fabric_steps(
    fabric: Any, model: Any, optimizer: Any, batch: Any, rank: int, steps: range, max_norm: float
) -> list[float]:
    """Train ``steps``: each step one forward on ``batch(step, rank)`` (labels the inputs), Fabric's backward, global
    gradient-norm clipping to ``max_norm``, the optimizer's step; the losses (the parity tests' training loop)."""
    losses = []
    for step in steps:
        x = batch(step, rank)
        loss = model(x, labels=x).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
