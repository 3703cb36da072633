"""What the Fabric and Trainer flavours of both sharded strategies share: Lightning hooks, arguments, precision.

Kept apart from the strategy classes so that each strategy file stays a thin mapping of Lightning's hooks onto
:mod:`mula_lightning.parallel`. Strategy-specific helpers live in their strategy's file (``epso.py``,
``zero_topo.py``); checkpoint formats in :mod:`mula_lightning.checkpoint`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from mula_lightning.checkpoint.async_slots import stage_to_host
from mula_lightning.checkpoint.dcp_format import save_dcp
from mula_lightning.checkpoint.init_source import InitWeights
from mula_lightning.checkpoint.replace_dir import AsyncReplaceSaver, readable_checkpoint, save_replacing
from mula_lightning.parallel.sharded_optimizer import unwrap_optimizer

#: Lightning DDP-strategy arguments that mean something to a sharding strategy. No DDP wrapper is ever built, so the
#: wrapper's own arguments (``find_unused_parameters``, ``static_graph``, ``ddp_comm_hook``, ...) mean nothing here.
DDP_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)


def ddp_arguments(strategy: type, options: Any, ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments to forward to Lightning's DDP strategy base of ``strategy``; refuse every other one.

    Args:
        strategy: the strategy class being constructed.
        options: the callable whose signature lists the strategy's own arguments (for the error message).
        ddp_kwargs: the keywords the constructor did not take itself.

    Raises:
        TypeError: naming the unknown keywords, the strategy's own arguments and the DDP arguments it forwards (a
            misspelled ``ep_szie=2`` or a not-yet-supported ``tp_size=2`` is never silently ignored).
    """
    base = next(c for c in strategy.__mro__ if c.__module__.startswith("lightning.") and c.__name__ == "DDPStrategy")
    accepted = [k for k in DDP_ARGUMENTS if k in inspect.signature(base.__init__).parameters]
    unknown = sorted(set(ddp_kwargs) - set(accepted))
    if unknown:
        own = [n for n, p in inspect.signature(options).parameters.items() if n != "self" and p.kind != p.VAR_KEYWORD]
        raise TypeError(
            f"{strategy.__name__} got unknown keyword arguments {unknown}; its own arguments are {own}, and of "
            f"Lightning's DDP strategy it takes {accepted}"
        )
    return ddp_kwargs


class ShardingOptions:
    """Base of a sharding strategy's options mixin: the parts of the
    :class:`~mula_lightning.strategies.protocol.ShardingStrategy` protocol every such strategy answers the same way
    (the model is built on the meta device and materialised from ``settings.seed``), and the hook that lets the
    Fabric or Trainer flavour set its own attributes after Lightning's constructor ran."""

    builds_on_meta = True
    settings: Any
    #: weights to start from instead of drawing them from the seed (a path :class:`InitWeights` reads); a module
    #: sets it in ``configure_model`` (``MulaLM`` hands over its ``init_from``)
    init_from: str | None = None

    def init_weights(self) -> InitWeights | None:
        """The reader of :attr:`init_from` for the materialisation, or None to draw the weights from the seed."""
        return InitWeights(self.init_from) if self.init_from else None

    def _init_flavour(self) -> None:
        """The Fabric or Trainer flavour's own attributes, set after Lightning's constructor."""

    @property
    def init_seed(self) -> int:
        return self.settings.seed

    @init_seed.setter
    def init_seed(self, seed: int) -> None:
        self.settings.seed = int(seed)


class ShardedFabricHooks:
    """Fabric-strategy hooks shared by the sharded strategies (mix in before Lightning's Fabric DDP strategy).

    The optimizer is built from the set-up module (``setup_optimizer``), a scheduler is re-pointed to it, and
    clipping goes to the optimizer's global-norm clip; value clipping is refused (gradients are sharded).
    """

    strategy_name = "sharded"

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None):
        module = self.setup_module(module)
        optimizers = [self.setup_optimizer(o) for o in optimizers]
        if scheduler is not None:
            repoint_scheduler(scheduler, optimizers[0])
        return module, optimizers, scheduler

    @override
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

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float) -> None:
        raise ValueError(
            f"gradient clipping by value is not supported by the {self.strategy_name} strategy (gradients are "
            "sharded); clip by norm instead (fabric.clip_gradients(model, optimizer, max_norm=...))"
        )


class DCPSaves:
    """Saves of both sharded strategies: a DCP directory that replaces the previous one at that path whole (written
    as ``<path>.partial``, then renamed; :mod:`mula_lightning.checkpoint.replace_dir`), now or, with ``async_save``,
    staged to host memory now and written in the background while training goes on (at most one in flight; the
    next save, a load, a removal and the end of training wait for it). :meth:`stage_checkpoint` also serves
    ``DualCheckpoint(async_save=True)``. A strategy supplies :meth:`checkpoint_parts`; :class:`FabricDCPSaves` and
    :class:`TrainerDCPSaves` give Lightning's two signatures. Mix in before the Lightning base class."""

    #: write ``save_checkpoint`` in a background thread (the strategies' ``async_save`` argument)
    async_save: bool = False
    _async_saver: AsyncReplaceSaver | None = None
    _failed = False  # the run raised: teardown leaves a save in flight alone (its collectives may never finish)

    def checkpoint_parts(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """(logical-key tensors viewing the live state, metadata entries, DCP save planner or None) of ``state``:
        Fabric's state dict, or the Trainer's checkpoint dict."""
        raise NotImplementedError

    def _write_now(self, path: Any, state: dict[str, Any], storage_options: Any, filter: Any = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"the {self.strategy_name} strategy saves torch.distributed.checkpoint directories: no "
                "storage_options or filter"
            )
        if self.async_save:
            if self._async_saver is None:
                self._async_saver = AsyncReplaceSaver()
            self._async_saver.save(Path(path), lambda: self.stage_checkpoint(state))
            return
        # the state's parts collected on every rank and agreed before any rank enters DCP's collectives
        save_replacing(Path(path), prepare=lambda: self.stage_checkpoint(state, copy=False))

    def stage_checkpoint(self, state: dict[str, Any], copy: bool = True) -> Callable[[Path, Any], None]:
        """Copy what ``state`` saves into host memory now; return ``write(path, group)``, which writes that copy as
        ``save_checkpoint`` would (DCP's collectives over ``group``), from any thread, while training goes on.
        With ``copy=False`` (a synchronous save) the write reads the live tensors: only the collection of the
        state's parts happens now, so that the ranks can agree on it before writing."""
        tensors, metadata, planner = self.checkpoint_parts(state)
        if copy:
            tensors, metadata = stage_to_host(tensors), stage_to_host(metadata)

        def write(path: Path, group: Any = None) -> None:
            save_dcp(Path(path), tensors, metadata, planner, process_group=group)

        return write

    def wait_for_checkpoint(self) -> float:
        """Block until the asynchronous save in flight (if any) is written and in place; returns the seconds waited.

        Raises:
            CheckpointWriteError: that save failed on some rank (what was at its path before is untouched).
        """
        return self._async_saver.wait() if self._async_saver is not None else 0.0

    def checkpoint_to_read(self, path: Any) -> Path:
        """The directory a load of ``path`` reads, after the save in flight completed (see
        :func:`~mula_lightning.checkpoint.replace_dir.readable_checkpoint`)."""
        self.wait_for_checkpoint()
        return readable_checkpoint(path)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.wait_for_checkpoint()  # never delete an older checkpoint before the newer one is complete
        super().remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        try:
            if not self._failed:  # after an exception a peer may be gone: do not wait on it
                self.wait_for_checkpoint()  # a failed last save raises here, after Lightning's teardown below
        finally:
            super().teardown()


class FabricDCPSaves(DCPSaves):
    """``fabric.save``: ``save_checkpoint(path, state, storage_options=None, filter=None)``."""

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None):
        self._write_now(path, state, storage_options, filter)


class TrainerDCPSaves(DCPSaves):
    """``trainer.save_checkpoint``: ``save_checkpoint(checkpoint, filepath, storage_options=None)``."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._write_now(filepath, checkpoint, storage_options)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)


class InPlaceCheckpointRestore:
    """Trainer-strategy hooks for strategies whose ``load_checkpoint`` restores model and optimizer in place.

    The checkpoint is read after ``setup`` (the module must be parallelised and the sharded optimizer built first),
    and Lightning's own model / optimizer restore steps become no-ops. Mix in before the Lightning base class.
    """

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by load_checkpoint

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
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
