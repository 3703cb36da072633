"""The ``"epso"`` strategy: DP x EP with the EP-aware sharded optimizer, for Fabric and for the Trainer.

Both classes are thin: they reuse Lightning's DDP strategies for launching, process groups and collectives,
and delegate the work to :mod:`mula_lightning.parallel`:

* setup (:func:`setup_epso_module`): build the DP x EP topology, make the model expert parallel
  (:func:`~mula_lightning.parallel.parallelize.parallelize`: EP -> activation checkpointing -> compile),
  materialise it and broadcast the initial weights from one rank per shard; no DDP wrapper;
* the user's ``torch.optim.AdamW`` becomes a :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`
  (``sharded_optimizer="ep_aware" | "dp" | "none"``), whose hooks reduce gradients during backward;
* gradient clipping goes to the sharded global-norm clip (value clipping raises); gradient accumulation
  reduces once per optimizer step;
* checkpoints are ``torch.distributed.checkpoint`` directories with logical keys
  (:mod:`mula_lightning.parallel.state_dict`), loadable at another layout.

Precision is owned by the strategy: ``32-true`` (fp32 parameters) or ``bf16-true`` (bf16 parameters with an fp32
master copy in the optimizer); ``bf16-mixed`` is rejected because its fp32 parameters would make the bf16
compute an autocast copy of every weight on every rank.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy
from torch import nn

from mula_lightning.parallel.sharded_optimizer import MODES, ShardedAdamW
from mula_lightning.strategies.common import (
    EPSOSettings,
    InPlaceCheckpointRestore,
    ShardedFabricHooks,
    check_precision,
    load_sharded_checkpoint,
    repoint_scheduler,
    save_sharded_checkpoint,
    setup_epso_module,
    unwrap_optimizer,
)


class _ShardedBackwardSync(_BackwardSyncControl):
    """Fabric's ``no_backward_sync``: accumulate into the flat gradient buffers without reducing."""

    def __init__(self, strategy: FabricEPSOStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        opt = self.strategy.sharded_optimizer
        if not enabled or opt is None:
            return nullcontext()
        return _sync_disabled(opt)


@contextmanager
def _sync_disabled(optimizer: ShardedAdamW) -> Generator[None, None, None]:
    previous = optimizer.require_grad_sync
    optimizer.require_grad_sync = False
    try:
        yield
    finally:
        optimizer.require_grad_sync = previous


class FabricEPSOStrategy(ShardedFabricHooks, FabricDDPStrategy):
    """DP x EP with EPSO for ``lightning.fabric.Fabric`` (``Fabric(strategy="epso")`` or an instance).

    Args:
        ep_size: expert-parallel degree (divides the world size and every MoE layer's experts).
        sharded_optimizer: ``"ep_aware"`` (EPSO), ``"dp"`` (SO / ZeRO-1 over DP) or ``"none"`` (replicated).
        dispatcher: MoE token dispatch, ``"allgather"`` (Aurora) or ``"alltoall"``.
        reduce_dtype: dtype gradients are reduced in (``torch.float32``, or ``torch.bfloat16`` as in the paper).
        bucket_numel: elements per gradient-reduction bucket.
        seed: initialisation seed for models built on the meta device (``fabric.init_module(empty_init=True)``).
        activation_checkpointing: recompute decoder layers in backward.
        compile: regional ``torch.compile`` of attention and norms (a dict is passed to ``compile``).
        init_from_dense: a dense checkpoint (HF Llama directory or Mula model-only checkpoint) to upcycle into the
            model at setup, online: each rank builds only its own experts (see
            :func:`~mula_lightning.strategies.common.initialise_from_dense`).
        upcycle: options of that upcycling: ``granularity``, ``noise``, ``seed``, ``layers``.
        **kwargs: Lightning's DDP strategy arguments (accelerator, parallel_devices, cluster_environment, ...).
    """

    strategy_name = "epso"

    def __init__(
        self,
        ep_size: int = 1,
        sharded_optimizer: str = "ep_aware",
        dispatcher: str = "allgather",
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int | None = 40_000_000,
        seed: int = 0,
        activation_checkpointing: bool = False,
        compile: bool | dict[str, Any] = False,
        init_from_dense: str | None = None,
        upcycle: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.settings = EPSOSettings(
            ep_size,
            sharded_optimizer,
            dispatcher,
            reduce_dtype,
            bucket_numel,
            seed,
            activation_checkpointing,
            compile,
            init_from_dense,
            upcycle,
        )
        self._backward_sync_control = _ShardedBackwardSync(self)
        self.topology = None
        self.sharded_optimizer: ShardedAdamW | None = None
        self._module: nn.Module | None = None
        self._names_by_id: dict[int, str] = {}

    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision)

    def module_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().module_init_context(empty_init)

    def module_to_device(self, module: nn.Module) -> None:
        if not any(p.is_meta for p in module.parameters()):  # meta modules are materialised in setup_module
            module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._names_by_id = {id(p): n for n, p in module.named_parameters()}  # before materialising replaces them
        self.topology = setup_epso_module(module, self.settings, self.root_device, self.topology)
        self._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedAdamW:
        if self._module is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup(model, optimizer)")
        self.sharded_optimizer = ShardedAdamW.from_optimizer(
            self._module,
            unwrap_optimizer(optimizer),
            self.topology,
            self._names_by_id,
            **self.settings.optimizer_kwargs(),
        )
        return self.sharded_optimizer

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(
                "the epso strategy saves torch.distributed.checkpoint directories: no storage_options/filter"
            )
        save_sharded_checkpoint(Path(path), state, self.topology)

    def load_checkpoint(
        self, path, state=None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_sharded_checkpoint(Path(path), state or {}, self.topology, strict)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("epso", cls, description="DP x EP with the EP-aware sharded optimizer (EPSO)")


class EPSOStrategy(InPlaceCheckpointRestore, TrainerDDPStrategy):
    """DP x EP with EPSO for ``lightning.pytorch.Trainer`` (``Trainer(strategy="epso")`` or an instance).

    The LightningModule builds its model in ``configure_model`` (ideally on the meta device:
    ``with torch.device("meta")``); the strategy parallelises, materialises and broadcasts it. Arguments as in
    :class:`FabricEPSOStrategy`.
    """

    strategy_name = "epso"

    def __init__(
        self,
        ep_size: int = 1,
        sharded_optimizer: str = "ep_aware",
        dispatcher: str = "allgather",
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int | None = 40_000_000,
        seed: int = 0,
        activation_checkpointing: bool = False,
        compile: bool | dict[str, Any] = False,
        init_from_dense: str | None = None,
        upcycle: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.settings = EPSOSettings(
            ep_size,
            sharded_optimizer,
            dispatcher,
            reduce_dtype,
            bucket_numel,
            seed,
            activation_checkpointing,
            compile,
            init_from_dense,
            upcycle,
        )
        self.topology = None

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        return unwrap_optimizer(self.optimizers[0]) if self.optimizers else None

    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision_plugin)

    def tensor_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().tensor_init_context(empty_init)

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.topology = setup_epso_module(self.model, self.settings, self.root_device, self.topology)
        self.barrier()
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            opts = [
                ShardedAdamW.from_optimizer(
                    self.model, unwrap_optimizer(o), self.topology, **self.settings.optimizer_kwargs()
                )
                for o in self.optimizers
            ]
            for config in self.lr_scheduler_configs:
                index = next(
                    i for i, o in enumerate(self.optimizers) if unwrap_optimizer(o) is config.scheduler.optimizer
                )
                repoint_scheduler(config.scheduler, opts[index])
            self.optimizers = opts
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # setup_epso_module materialises / moves the model

    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: the sharded optimizer reduces gradients

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        opt = self.sharded_optimizer
        with _sync_disabled(opt) if opt is not None else nullcontext():
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from mula_lightning.parallel.state_dict import model_state_dict

        return model_state_dict(self.model, self.topology)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from mula_lightning.parallel.state_dict import optimizer_state_dict

        return optimizer_state_dict(unwrap_optimizer(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("the epso strategy saves torch.distributed.checkpoint directories: no storage_options")
        rest = dict(checkpoint)
        state = {"state_dict": rest.pop("state_dict")}
        for i, opt_state in enumerate(rest.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        save_sharded_checkpoint(Path(filepath), state, self.topology, metadata=rest)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {"state_dict": self.model}
        for i, opt in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = unwrap_optimizer(opt)
        return load_sharded_checkpoint(Path(checkpoint_path), state, self.topology, strict=True)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("epso", cls, description="DP x EP with the EP-aware sharded optimizer (EPSO)")


__all__ = ["MODES", "EPSOStrategy", "FabricEPSOStrategy"]
