"""What the Fabric and Trainer flavours of a sharded strategy share: settings, setup, precision, checkpoints.

Kept apart from the strategy classes so that each strategy file stays a thin mapping of Lightning's hooks onto
:mod:`mula_lightning.parallel`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mula_lightning.checkpoint.dcp_format import load_dcp, save_dcp, saved_keys
from mula_lightning.checkpoint.scattered import DPScatteredSavePlanner, broadcast_model, load_model_once
from mula_lightning.parallel.expert_parallel import DISPATCHERS
from mula_lightning.parallel.parallelize import materialize_and_broadcast, parallelize
from mula_lightning.parallel.sharded_optimizer import MODES, ShardedAdamW
from mula_lightning.parallel.state_dict import apply_optimizer_state_dict, model_state_dict, optimizer_state_dict
from mula_lightning.parallel.topology import MoETopology, build_topology


@dataclass
class EPSOSettings:
    """The user's choices for a DP x EP run (validated on construction)."""

    ep_size: int = 1
    sharded_optimizer: str = "ep_aware"
    dispatcher: str = "allgather"
    reduce_dtype: torch.dtype = torch.float32
    bucket_numel: int | None = 40_000_000
    seed: int = 0
    activation_checkpointing: bool = False
    compile: bool | dict[str, Any] = False
    init_from_dense: str | None = None
    upcycle: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size ({self.ep_size}) must be >= 1")
        if self.sharded_optimizer not in MODES:
            raise ValueError(f"sharded_optimizer ({self.sharded_optimizer!r}) must be one of {MODES}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be one of {tuple(DISPATCHERS)}")
        if isinstance(self.reduce_dtype, str):
            self.reduce_dtype = getattr(torch, self.reduce_dtype.replace("torch.", ""))
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"reduce_dtype ({self.reduce_dtype}) must be torch.float32 or torch.bfloat16")

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(mode=self.sharded_optimizer, reduce_dtype=self.reduce_dtype, bucket_numel=self.bucket_numel)


class ShardedFabricHooks:
    """Fabric-strategy hooks shared by the sharded strategies (mix in before Lightning's Fabric DDP strategy).

    The optimizer is built from the set-up module (``setup_optimizer``), a scheduler is re-pointed to it, and
    clipping goes to the optimizer's global-norm clip; value clipping is refused (gradients are sharded).
    """

    strategy_name = "sharded"

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None):
        module = self.setup_module(module)
        optimizers = [self.setup_optimizer(o) for o in optimizers]
        if scheduler is not None:
            repoint_scheduler(scheduler, optimizers[0])
        return module, optimizers, scheduler

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite=True
    ) -> torch.Tensor:
        if float(norm_type) != 2.0:
            raise ValueError(
                f"the {self.strategy_name} strategy clips by the global L2 norm only, got norm_type={norm_type}"
            )
        norm = unwrap_optimizer(optimizer).clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is non-finite ({norm.item()}); not clipping")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float) -> None:
        raise ValueError(
            f"gradient clipping by value is not supported by the {self.strategy_name} strategy (gradients are "
            "sharded); clip by norm instead (fabric.clip_gradients(model, optimizer, max_norm=...))"
        )


class InPlaceCheckpointRestore:
    """Trainer-strategy hooks for strategies whose ``load_checkpoint`` restores model and optimizer in place.

    The checkpoint is read after ``setup`` (the module must be parallelised and the sharded optimizer built first),
    and Lightning's own model / optimizer restore steps become no-ops. Mix in before the Lightning base class.
    """

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by load_checkpoint

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False


def repoint_scheduler(scheduler: Any, optimizer: Any) -> None:
    """Make an LR scheduler built on the user's optimizer drive the sharded one that replaced it.

    Besides swapping ``scheduler.optimizer``, the new optimizer's ``step`` gets the call tracking that
    ``torch.optim.lr_scheduler.LRScheduler`` installs on the optimizer it is built with (otherwise every run warns
    that "optimizer.step() has been overridden after learning rate scheduler initialization").
    """
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    optimizer.step = tracked_step


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's / Fabric's wrappers."""
    while hasattr(optimizer, "_optimizer"):
        optimizer = optimizer._optimizer
    return optimizer


def check_precision(plugin: Any) -> None:
    """Accept ``32-true``, ``bf16-true`` and ``64-true``; reject mixed precision and fp16 (see the strategy docstring).

    ``64-true`` (float64 parameters, gradients, reductions and optimizer states) is for checking the math: a float64
    run agrees with one process to ~1e-12 on any CPU (see :mod:`mula_lightning.testing.parity`).
    """
    name = type(plugin).__name__
    precision = getattr(plugin, "precision", None)
    if "Mixed" in name or precision in ("bf16-mixed", "16-mixed"):
        raise ValueError(
            f"precision={precision!r} is not supported by the sharded strategies: the strategy owns precision; use "
            "'bf16-true' (bf16 parameters, fp32 master weights in the optimizer) or '32-true'"
        )
    if precision not in (None, "32-true", "bf16-true", "64-true"):
        raise ValueError(f"precision={precision!r} is not supported; use '32-true', 'bf16-true' or '64-true'")
    if hasattr(plugin, "clip_grad_by_norm"):  # the Trainer's plugin clips; route it to the sharded optimizer
        plugin.clip_grad_by_norm = _clip_grad_by_norm
        plugin.clip_grad_by_value = _clip_grad_by_value


def _clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
    unwrap_optimizer(optimizer).clip_grad_norm_(float(clip_val))


def _clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
    raise ValueError(
        "gradient_clip_algorithm='value' is not supported with sharded gradients; use the default 'norm' "
        f"(gradient_clip_val={clip_val})"
    )


def setup_epso_module(
    module: nn.Module, settings: EPSOSettings, device: torch.device, topology: MoETopology | None = None
) -> MoETopology:
    """Topology, then :func:`parallelize` (EP -> AC -> compile), then materialise and broadcast the weights."""
    topology = topology or build_topology(settings.ep_size)
    parallelize(
        module,
        topology,
        dispatcher=settings.dispatcher,
        activation_checkpointing=settings.activation_checkpointing,
        compile=settings.compile,
    )
    materialize_and_broadcast(module, topology, device, seed=settings.seed)
    if settings.init_from_dense:
        initialise_from_dense(module, settings.init_from_dense, topology, settings.upcycle or {})
    return topology


@torch.no_grad()
def initialise_from_dense(module: nn.Module, path: str, topology: MoETopology, options: dict[str, Any]) -> None:
    """Online upcycling at setup: each rank builds only its own experts from a dense checkpoint's shards.

    The MoE shape (experts, top-k, router kind, renormalisation, capacity factor) is the model's own config; the
    dense checkpoint (HF Llama directory or Mula model-only checkpoint, read tensor by tensor) supplies every other
    weight; ``options`` are :func:`~mula_lightning.models.upcycle.upcycle`'s ``granularity``, ``noise`` and
    ``seed``. Every rank reads only the FFN slices of its experts, so no rank ever holds the full MoE.

    Raises:
        ValueError: when the upcycled tensors do not have the shapes of the model being trained (the dense
            checkpoint does not fit the model config), naming the first offending tensors.
    """
    from mula_lightning.models.transformer import MulaForCausalLM
    from mula_lightning.models.upcycle import upcycle

    unknown = set(options) - {"granularity", "noise", "seed", "layers"}
    if unknown:
        raise ValueError(f"unknown upcycle options {sorted(unknown)}; known: granularity, noise, seed, layers")
    targets = [m for m in module.modules() if isinstance(m, MulaForCausalLM)]
    if not targets:
        raise ValueError("init_from_dense needs a MulaForCausalLM inside the module being set up")
    for target in targets:
        cfg = target.config
        if not cfg.is_moe:
            raise ValueError(f"init_from_dense upcycles into an MoE; the model config ({cfg.name}) has no experts")
        local = upcycle(
            path,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            router=cfg.router_kind,
            norm_topk_prob=cfg.norm_topk_prob,
            capacity_factor=cfg.capacity_factor,
            ep_rank=topology.ep_rank,
            ep_size=topology.ep_size,
            dtype=next(target.parameters()).dtype,
            **options,
        )
        have, got = target.state_dict(), local.state_dict()
        wrong = [
            f"{k}: model {tuple(have[k].shape) if k in have else None} vs upcycled {tuple(v.shape)}"
            for k, v in got.items()
            if k not in have or have[k].shape != v.shape
        ] + [f"{k}: missing from the upcycled model" for k in have if k not in got]
        if wrong:
            raise ValueError(f"the dense checkpoint {path} does not fit the model config: " + "; ".join(wrong[:6]))
        for k, v in got.items():
            have[k].copy_(v)


def _to_saveable(value: Any, topology: MoETopology) -> Any:
    if isinstance(value, nn.Module):
        return model_state_dict(value, topology)
    if isinstance(unwrap_optimizer(value), ShardedAdamW):
        return optimizer_state_dict(unwrap_optimizer(value))
    return None


def save_sharded_checkpoint(
    path: Path, state: dict[str, Any], topology: MoETopology, metadata: dict[str, Any] | None = None
) -> None:
    """Write a DCP directory: modules and sharded optimizers by logical key, everything else as metadata.

    The metadata holds tensors and plain data only (``torch.save`` bytes, read back with ``weights_only=True``).

    Args:
        state: modules, (wrapped) sharded optimizers, state dicts made by the Trainer's hooks, or plain objects
            (those go to the metadata, as their ``state_dict()`` when they have one).
        metadata: more entries (the Trainer's loops, callbacks, schedulers, ...): tensors and plain data.
    """
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = dict(metadata or {})
    for key, value in state.items():
        saveable = _to_saveable(value, topology)
        if saveable is not None:
            tensors[key] = saveable
        elif isinstance(value, dict) and (key == "state_dict" or key.startswith("optimizer_")):
            tensors[key] = value
        else:
            extra[key] = value.state_dict() if hasattr(value, "state_dict") else value
    # replicated items are written from DP index m % DP for model-parallel shard m (spread over nodes)
    save_dcp(path, tensors, extra, planner=DPScatteredSavePlanner(topology.dp_size, topology.ep_size))


def load_sharded_checkpoint(path: Path, state: dict[str, Any], topology: MoETopology, strict: bool = True):
    """Load a :func:`save_sharded_checkpoint` directory into ``state`` in place, at any layout.

    Modules and sharded optimizers in ``state`` are filled from their logical keys; other entries are restored
    from the metadata (``load_state_dict`` when they have one). Returns the metadata entries that are
    not in ``state`` (Fabric's contract; for the Trainer, the rest of its checkpoint dict).
    """
    saved = saved_keys(path)
    targets: dict[str, Any] = {}
    modules: list[nn.Module] = []
    for key, value in state.items():
        saveable = _to_saveable(value, topology)
        if saveable is None:
            continue
        if key not in saved:
            if strict:
                raise KeyError(f"{path}: the checkpoint has no {key!r} (it holds {sorted(saved)})")
            continue
        if isinstance(value, nn.Module):  # weights: one reader per shard, broadcast to the replicas after the load
            modules.append(value)
            saveable = load_model_once(saveable, topology)
            if not saveable:
                continue
        targets[key] = saveable  # optimizer shards: read by their owners
    metadata = load_dcp(path, targets, strict)
    for module in modules:
        broadcast_model(module, topology)
    for key, value in state.items():
        if key in targets and isinstance(unwrap_optimizer(value), ShardedAdamW):
            apply_optimizer_state_dict(unwrap_optimizer(value), targets[key])
    for key in list(state):
        if key in targets or key not in metadata or isinstance(state[key], nn.Module):
            continue
        if hasattr(state[key], "load_state_dict"):
            state[key].load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return {k: v for k, v in metadata.items() if k not in state}
