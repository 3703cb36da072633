"""Auxiliary-loss-free load balancing (DeepSeek-V3): the once-per-optimizer-step update of the routers' expert bias.

Legend: E = experts of one router.

A router built with ``bias_update_rate > 0`` (:class:`~mula_lightning.moe.router.Router`) adds its selection bias
``b`` to the scores it chooses experts by, and adds every training forward's choices to its ``pending_load``.
:func:`update_expert_bias` then, once per optimizer step:

1. sums each router's pending load over ``group`` (one all-reduce of every router's E counts, float64: exact up to
   2**53 tokens), so ``load_e`` counts the (token, k) choices of expert e over the step's **global** batch, all its
   micro-batches (gradient accumulation, pipeline micro-batches) included;
2. moves the bias: ``b_e += rate * sign(mean(load) - load_e)`` (an overloaded expert down, an underloaded one up,
   one at the mean unchanged);
3. empties the pending loads.

The update is **not re-centred** (Megatron-Core's rule, and DeepSeek-V3's as written; torchtitan subtracts the mean of
the update): only differences between biases change a choice, so re-centring changes no routing, and without it a
balanced layer's bias stays where it is and an update is exactly ``rate`` per expert, which keeps a checkpointed
bias readable against the step count. The counts are identical on every rank after the all-reduce, so every rank
computes the same float32 bias with no further communication.

Which ranks to sum over: those that route different tokens through the same routers, i.e. data x expert parallel
ranks (a pipeline stage's ranks: routers of other stages are other routers). Tensor-parallel ranks without sequence
parallelism route the same tokens: summing them multiplies every count by ``tp``, which leaves the signs, hence the
update, unchanged; with sequence parallelism each routes its own part of the sequence and the sum is the sequence's.

A second call within one step finds no pending load and changes nothing (every sign is 0), so installing the
update on two optimizers that both step is harmless; a step that counted no tokens on any rank leaves the bias.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.moe.router import Router

__all__ = ["expert_bias_routers", "install_expert_bias_update", "update_expert_bias"]


def expert_bias_routers(module: nn.Module) -> list[Router]:
    """The routers of ``module`` whose bias moves (``bias_update_rate > 0``), in module order (the same on every rank
    holding the same layers)."""
    return [m for m in module.modules() if isinstance(m, Router) and m.bias_update_rate > 0 and m.has_expert_bias]


@torch.no_grad()
def update_expert_bias(module: nn.Module, group: Any = None, reduce: bool = True) -> list[torch.Tensor]:
    """Move the selection bias of every router of ``module`` by its step's global load (module docstring).

    Collective over ``group`` (default: every rank) when ``torch.distributed`` is initialised, ``reduce`` is set and
    the group has more than one rank: every rank of it must call with the same routers. ``reduce=False`` means that
    this rank alone routes through these routers (a pipeline stage of one rank, whose group is None, not the world):
    its own loads are the global ones.

    Returns:
        the global load (E,) float64 of each updated router (for logging; empty when nothing has a bias to move).
    """
    routers = expert_bias_routers(module)
    if not routers:
        return []
    device = routers[0].e_score_correction_bias.device
    loads = torch.cat(
        [
            r.pending_load.to(device) if r.pending_load is not None else torch.zeros(r.num_experts, device=device)
            for r in routers
        ]
    ).to(torch.float64)
    if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    out = list(loads.split([r.num_experts for r in routers]))
    for router, load in zip(routers, out):
        step = router.bias_update_rate * torch.sign(load.mean() - load)
        bias = router.e_score_correction_bias
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))
        router.pending_load = None
    return out


def install_expert_bias_update(
    optimizer: torch.optim.Optimizer, module: nn.Module, group: Any = None, reduce: bool = True
) -> Any:
    """Run :func:`update_expert_bias` (``module``, ``group``, ``reduce``) after every ``optimizer.step()``: once per
    optimizer step whatever the gradient accumulation. The sharded strategies (``epso``, ``zero_topo``) and
    :class:`~mula_lightning.lightning_module.MulaLM` install it themselves; a Fabric loop with another strategy calls
    this once after ``fabric.setup``. Installing again on the same optimizer replaces the earlier hook.

    Returns:
        the hook's handle (``handle.remove()`` uninstalls it), or None when ``module`` has no bias to move.
    """
    previous = getattr(optimizer, "_mula_expert_bias_hook", None)
    if previous is not None:
        previous.remove()
        optimizer._mula_expert_bias_hook = None
    if not expert_bias_routers(module):
        return None

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        update_expert_bias(module, group, reduce)

    handle = optimizer.register_step_post_hook(after_step)
    optimizer._mula_expert_bias_hook = handle
    return handle
