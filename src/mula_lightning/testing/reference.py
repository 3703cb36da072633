"""The single-process reference of a data-parallel training run, which the distributed parity tests compare with.

Why one definition: a strategy's parity test must compare with exactly the math a DP run stands for (each rank's
micro-batch through the unsharded model, the losses averaged, torch's global-norm clipping, torch's AdamW); a copy in
each test file drifts (a missed ``zero_grad`` or a clip after the step would make a test compare with other math).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["one_process_data_parallel"]


def one_process_data_parallel(
    model: nn.Module,
    batch: Callable[[int, int], torch.Tensor],
    world_size: int,
    steps: range,
    max_norm: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **adamw: Any,
) -> list[list[float]]:
    """Train ``model`` for ``steps`` as one process standing for ``world_size`` DP ranks; per step, each rank's loss.

    ``batch(step, rank)`` gives rank ``rank``'s input ids of a step (the labels too); the step's loss is the mean of
    the ranks' losses; gradients are clipped to ``max_norm`` (global L2 norm, if given) before ``optimizer.step()``
    (default: ``torch.optim.AdamW(model.parameters(), **adamw)``).
    """
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for step in steps:
        per_rank = [model(batch(step, r), labels=batch(step, r)).loss for r in range(world_size)]
        torch.stack(per_rank).mean().backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return losses
