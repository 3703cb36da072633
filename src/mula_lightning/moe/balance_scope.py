"""Over which tokens the load-balancing loss counts its expert frequencies: a micro-batch, a sequence, or the global
batch of an optimizer step.

Why: the Switch / OLMoE loss ``E * sum_e f_e P_e`` pushes the routing towards equal expert frequencies ``f_e`` within
the tokens it counts. Counted per micro-batch (what every framework did until 2025), it asks each micro-batch of a
few sequences, often of one domain, to use every expert evenly, which fights the specialisation experts should
learn; "Demons in the Detail" (Qwen, arXiv 2501.11873) counts the frequencies over the global batch instead and
reports lower perplexity and experts that specialise by domain. Megatron's ``global_aux_loss`` does the same with a
running sum over the micro-batches of a step.

The scopes (:attr:`~mula_lightning.moe.config.MoEConfig.balance_scope`):

* ``"micro_batch"`` (the default, today's): ``f_e`` and ``P_e`` over the micro-batch's tokens on this rank;
* ``"sequence"``: the loss of each sequence alone (its own ``f_e`` and ``P_e``), averaged over the sequences: the
  strictest, every sequence spread over the experts;
* ``"global_batch"``: ``f_e`` counted over every rank holding other tokens of the step (the group
  :func:`enable_global_batch_balance` gives the routers: the data-parallel ranks, and the expert-parallel ones, which
  read their own batches) and over the step's micro-batches so far (the running-sum rule: micro-batch ``m`` sees the
  counts of micro-batches ``1..m``; the last one sees the whole step's), ``P_e`` over this rank's micro-batch. The
  gradient is that of ``P_e`` alone (``f_e`` is a count), so the data-parallel mean of the ranks' gradients equals the
  gradient of one process holding every rank's tokens of each micro-batch under the same rule: no rescaling by the
  data-parallel size (the mistake of Megatron #3672, whose gradient came out ``1 / dp`` of the plain loss's). The
  running sum restarts at each optimizer step (:func:`reset_balance_window`; ``MulaLM`` restarts it at the first
  micro-batch of each accumulation window, a Fabric loop after each ``optimizer.step()``).

Under activation checkpointing the recomputed router takes the frequencies its first run used (the routing replay),
so a recomputation neither counts twice nor communicates. A forward outside training (validation, no gradient, a
pipeline's shape inference) counts its micro-batch alone, without communicating. Sequence parallelism takes
``"micro_batch"`` only (refused otherwise, in one line).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.moe.config import BALANCE_SCOPES

__all__ = [
    "BALANCE_SCOPES",
    "reduce_router_losses_over",
    "enable_global_batch_balance",
    "install_balance_window_reset",
    "reset_balance_window",
    "scoped_balance_loss",
    "sequence_scope_balance_loss",
]


def sequence_scope_balance_loss(probs_SE: torch.Tensor, indices_SK: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` of each of the ``num_sequences`` sequences (consecutive, equal lengths) alone, averaged:
    the load-balancing loss at ``"sequence"`` scope."""
    num_tokens, num_experts = probs_SE.shape
    if num_sequences < 1 or num_tokens % num_sequences:
        raise ValueError(f"{num_tokens} tokens do not split into {num_sequences} sequences of equal length")
    length = num_tokens // num_sequences
    with torch.no_grad():
        pairs = indices_SK.reshape(num_sequences, -1)
        counts_BE = torch.zeros(num_sequences, num_experts, dtype=probs_SE.dtype, device=probs_SE.device)
        counts_BE.scatter_add_(1, pairs, torch.ones_like(pairs, dtype=probs_SE.dtype))
    p_BE = probs_SE.reshape(num_sequences, length, num_experts).mean(1)
    return num_experts * (counts_BE / length * p_BE).sum(-1).mean()


def scoped_balance_loss(
    router: Any, probs_SE: torch.Tensor, chosen_E: torch.Tensor, indices_SK: torch.Tensor, num_sequences: int,
    replay: Any, training: bool,
) -> torch.Tensor:  # fmt: skip
    """The router's load-balancing loss at its ``balance_scope`` (``chosen_E``: this micro-batch's counts per
    expert; ``replay``: the routing replay of an activation-checkpointed forward, or None; ``training``: a training
    step's forward, whose counts join the step's)."""
    scope = getattr(router, "balance_scope", "micro_batch")
    num_tokens, num_experts = probs_SE.shape
    if scope == "sequence":
        return sequence_scope_balance_loss(probs_SE, indices_SK, num_sequences)
    if scope == "global_batch" and replay is not None and replay.replaying:
        f_E = replay.take_frequencies()
    elif scope == "micro_batch" or not training:
        f_E = chosen_E.to(probs_SE.dtype) / max(num_tokens, 1)
    else:
        with torch.no_grad():
            local = torch.cat([chosen_E.to(torch.float64), chosen_E.new_tensor([num_tokens], dtype=torch.float64)])
            group = getattr(router, "balance_group", None)
            if group is not None:
                dist.all_reduce(local, group=group)
            window = getattr(router, "balance_window", None)
            router.balance_window = local if window is None else window + local
            f_E = (router.balance_window[:-1] / router.balance_window[-1].clamp(min=1)).to(probs_SE.dtype)
        if replay is not None:
            replay.frequencies.append(f_E)
    return num_experts * torch.sum(f_E * probs_SE.mean(dim=0))


def _routers(model: nn.Module) -> list[Any]:
    """The model's routers (modules with a balance scope: :class:`~mula_lightning.moe.router.Router`)."""
    return [m for m in model.modules() if hasattr(m, "balance_scope") and hasattr(m, "balance_window")]


def enable_global_batch_balance(model: nn.Module, group: Any) -> int:
    """Give every router of ``model`` at ``"global_batch"`` scope the process ``group`` its counts are summed over
    (None: this process alone); returns how many routers count at that scope. Call after the strategy set the model
    up (``MulaLM`` does it at the start of training): the group is the ranks holding other tokens of a step."""
    routers = [r for r in _routers(model) if getattr(r, "balance_scope", "micro_batch") == "global_batch"]
    for router in routers:
        router.balance_group = group if group is not None and dist.get_world_size(group) > 1 else None
        router.balance_window = None
    return len(routers)


def reduce_router_losses_over(model: nn.Module, reduce: Any, parallelism: str, instead: str = "") -> None:
    """Give every router of ``model`` the ``sequence_reduce`` of a sequence split over ranks (``reduce`` sums over
    them; :func:`~mula_lightning.moe.router.sequence_parallel_router_losses`), so its losses are the whole
    sequences'. A router that sums over other ranks already (sequence parallelism's ``tp`` beside context
    parallelism's ``cp``: each rank holds a part of a part) sums over them first, then over these.

    Raises:
        ValueError: when a router counts at a scope other than ``"micro_batch"`` (its counts would be this rank's part
            of the sequences only), naming the scope and ``parallelism`` (and ``instead``, another way out).
    """
    for router in _routers(model):
        if router.balance_scope != "micro_batch":
            raise ValueError(
                f"balance_scope {router.balance_scope!r} does not run with {parallelism} (each rank holds a part of "
                f"every sequence): use balance_scope 'micro_batch'{instead}"
            )
        inner = getattr(router, "sequence_reduce", None)
        router.sequence_reduce = reduce if inner is None else _then(inner, reduce)


def _then(first: Any, second: Any) -> Any:
    return lambda x: second(first(x))


def reset_balance_window(model: nn.Module) -> None:
    """Start a new step's running sum of the expert counts (at ``"global_batch"`` scope): after each optimizer step,
    and after a skipped one."""
    for router in _routers(model):
        router.balance_window = None


def install_balance_window_reset(optimizer: torch.optim.Optimizer, model: nn.Module) -> Any:
    """:func:`reset_balance_window` after every ``optimizer.step()`` (a Fabric loop; a skipped step calls it itself).
    Returns the hook's handle, or None when no router counts at ``"global_batch"`` scope."""
    if not any(getattr(r, "balance_scope", "micro_batch") == "global_batch" for r in _routers(model)):
        return None
    return optimizer.register_step_post_hook(lambda *_: reset_balance_window(model))
