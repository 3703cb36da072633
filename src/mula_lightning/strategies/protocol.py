"""What a LightningModule may ask of a sharding strategy: one declared protocol instead of probing private members.

``MulaLM`` (and any user module) needs three things from a strategy that shards the model and the optimizer
(``epso``, ``zero_topo``), and nothing else:

* whether the module should build its model on the meta device, and the seed the strategy materialises it from
  (weights are a function of (seed, parameter name), so every layout starts from the same model), or the weights
  it reads instead (``init_from``);
* the expert-parallel degree, to check that it divides the experts and the number of processes before any
  allocation;
* the global L2 norm of the reduced gradients (each element of the unsharded model counted once), for logging:
  a sharded optimizer holds only its shard, so ``torch.nn.utils.get_total_norm`` over ``p.grad`` would be wrong.

A strategy that does not implement the protocol (``ddp``, ``fsdp``, one device) is treated as a plain one: the
module builds its model for real, EP is 1, and the norm is taken over ``p.grad``. The check is
``isinstance(strategy, ShardingStrategy)`` (a runtime-checkable protocol: attributes and methods, no base class).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "ShardingStrategy",
    "strategy_cp_size",
    "strategy_ep_size",
    "strategy_pipeline",
    "strategy_tensor_parallel",
]


@runtime_checkable
class ShardingStrategy(Protocol):
    """The strategy side of the ``MulaLM`` <-> strategy contract (see the module docstring).

    Attributes:
        builds_on_meta: the module builds its model under ``torch.device("meta")`` in ``configure_model``; the
            strategy materialises, shards and broadcasts it.
        init_seed: the seed of that materialisation; a module may set it in ``configure_model`` (``MulaLM`` hands
            over its own ``seed``).
        init_from: weights to materialise from instead of the seed (a model-only checkpoint, a transformers
            directory or a full checkpoint, read once per shard and broadcast); ``MulaLM`` hands over its own.
        ep_size: the expert-parallel degree (1 when experts are not split).
    """

    builds_on_meta: bool
    init_seed: int
    init_from: str | None
    ep_size: int

    def global_grad_norm(self, optimizer: Any) -> torch.Tensor:
        """The global L2 norm of the reduced gradients of ``optimizer`` (wrapped or not), before clipping; runs the
        pending gradient reductions first. Collective: every rank calls it."""
        ...


def strategy_ep_size(strategy: Any) -> int:
    """The expert-parallel degree of any strategy (1 unless it implements :class:`ShardingStrategy`)."""
    return strategy.ep_size if isinstance(strategy, ShardingStrategy) else 1


def strategy_cp_size(strategy: Any) -> int:
    """The context-parallel degree of any strategy (1 unless it cuts sequences over ranks)."""
    settings = getattr(strategy, "settings", None) if isinstance(strategy, ShardingStrategy) else None
    return int(getattr(settings, "cp_size", 1))


def strategy_tensor_parallel(strategy: Any) -> tuple[int, bool, int]:
    """``(tp_size, sequence_parallel, etp_size)`` of any strategy (``(1, False, 1)`` unless it has tensor or expert
    tensor parallelism)."""
    settings = getattr(strategy, "settings", None) if isinstance(strategy, ShardingStrategy) else None
    return (
        int(getattr(settings, "tp_size", 1)),
        bool(getattr(settings, "sequence_parallel", False)),
        int(getattr(settings, "etp_size", 1)),
    )


def strategy_pipeline(strategy: Any) -> dict[str, Any]:
    """The pipeline-parallel settings of any strategy: ``pp_size``, ``pp_schedule``, ``pp_microbatches``,
    ``pp_virtual_stages``, ``pp_boundaries`` (``pp_size`` 1 unless it has pipeline parallelism)."""
    settings = getattr(strategy, "settings", None) if isinstance(strategy, ShardingStrategy) else None
    return {
        "pp_size": int(getattr(settings, "pp_size", 1)),
        "pp_schedule": getattr(settings, "pp_schedule", "1f1b"),
        "pp_microbatches": getattr(settings, "pp_microbatches", None),
        "pp_virtual_stages": int(getattr(settings, "pp_virtual_stages", 1)),
        "pp_boundaries": getattr(settings, "pp_boundaries", None),
    }
