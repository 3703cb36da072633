"""The ``"zero_topo"`` strategy: hierarchical 3-level ZeRO with block-quantized collectives, for Fabric and Trainer.

Both classes are thin: Lightning's DDP strategies launch the processes and own the default group; the work is
done by :class:`~mula_lightning.parallel.zero.engine.HierarchicalZeroAdamW` (its docstring has the
communication plan and the memory per rank):

* setup, no DDP wrapper: a model built on the meta device and trained (``fabric.setup(model, optimizer)``,
  ``Trainer.fit``) is materialised by the engine one unit (layer) at a time, each rank drawing a unit's values from
  (``seed``, name), or with ``init_from`` receiving each tensor from the one rank that read it (round robin), and
  keeping only its chunks, so no rank ever holds the whole model; otherwise (``setup_module`` alone, evaluation,
  parameters outside a Mula model) the whole model is materialised first, drawn or read once and broadcast;
* the user's ``torch.optim.AdamW`` becomes the engine (same param groups and hyper-parameters), which shards the
  weights over ``weight_size`` ranks, the gradients over ``grad_size``, the optimizer states over
  ``optimizer_size`` and keeps a secondary partition over ``secondary_size``; sizes default to the paper's design
  from the topology (``ranks_per_node`` / ``ranks_per_gpu``, else ``MULA_RANKS_PER_NODE`` / ``LOCAL_WORLD_SIZE``
  and ``MULA_RANKS_PER_GPU``) and are validated against the dependency rule;
* expert parallelism (``ep_size``): each MoE layer's experts are cut to this rank's slice on the meta module (as in
  ``epso``, over ``ep_size`` consecutive ranks of a node, with the chosen token dispatcher) before the engine shards
  anything; the engine shards each expert slice over its ``world / ep_size`` replicas with the same three levels
  (:func:`~mula_lightning.parallel.zero.layout.expert_layout`) and the dense weights over every rank;
* gradient accumulation: every micro-batch reduce-scatters inside the gradient group (the shard accumulates), the
  cross-node all-reduce runs once per optimizer step; clipping by the global L2 norm;
* checkpoints: ``torch.distributed.checkpoint`` directories with logical keys
  (:mod:`~mula_lightning.parallel.zero.state_dict`), loadable at another layout or in one process.

Precision: ``32-true`` or ``bf16-true`` (bf16 weights, fp32 masters in the optimizer), as for ``"epso"``.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy
from torch import nn
from typing_extensions import override

from mula_lightning.checkpoint.dcp_format import load_dcp
from mula_lightning.checkpoint.init_source import InitWeights
from mula_lightning.checkpoint.scattered import SpreadReplicasSavePlanner
from mula_lightning.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    parse_activation_checkpointing,
)
from mula_lightning.parallel.expert_parallel import DISPATCHERS, apply_expert_parallel
from mula_lightning.parallel.parallelize import (
    init_mula_buffers,
    materialize_and_broadcast,
    move_real_tensors,
    parameter_initializer,
    weights_initializer,
)
from mula_lightning.parallel.params import logical_name
from mula_lightning.parallel.sharded_optimizer import take_over, unwrap_optimizer
from mula_lightning.parallel.topology import MoETopology, build_topology
from mula_lightning.parallel.zero import state_dict as zc
from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
from mula_lightning.parallel.zero.layout import ZeroTopoLayout, expert_layout, expert_weight_replica_groups
from mula_lightning.strategies.common import (
    FabricDCPSaves,
    InPlaceCheckpointRestore,
    ShardedFabricHooks,
    ShardingOptions,
    TrainerDCPSaves,
    check_precision,
    ddp_arguments,
    repoint_scheduler,
)

log = logging.getLogger(__name__)


@dataclass
class ZeroTopoSettings:
    """The user's choices (0 = the default of :class:`ZeroTopoLayout`)."""

    weight_size: int = 0
    grad_size: int = 0
    optimizer_size: int = 0
    secondary_size: int = 0
    ranks_per_node: int | None = None
    ranks_per_gpu: int | None = None
    quantize_weights: bool = False
    quantize_grads: bool = False
    weight_bits: int = 8
    grad_bits: int = 4
    block_size: int = 256
    seed: int = 0
    activation_checkpointing: bool | str | list[str] = False
    ep_size: int = 1
    dispatcher: str = "allgather"

    def layout(self, world_size: int) -> ZeroTopoLayout:
        """The dense layout at ``world_size`` ranks; with ``ep_size > 1`` the experts' edp layout is checked too."""
        sizes = dict(weight_size=self.weight_size, grad_size=self.grad_size, optimizer_size=self.optimizer_size)
        sizes["secondary_size"] = self.secondary_size
        if self.ranks_per_node is None:
            layout = ZeroTopoLayout.from_env(world_size, **sizes)
        else:
            layout = ZeroTopoLayout(world_size, self.ranks_per_node, self.ranks_per_gpu or 1, **sizes)
        expert_layout(layout, self.ep_size)  # ep_size dividing a node, group sizes nesting with it: named
        return layout

    def engine_kwargs(self) -> dict[str, Any]:
        keys = ("quantize_weights", "quantize_grads", "weight_bits", "grad_bits", "block_size")
        return {k: v for k, v in asdict(self).items() if k in keys}


def check_expert_parallel(ep_size: int, dispatcher: str, etp_size: int, ranks_per_node: int | None) -> None:
    """The expert-parallel options of ``zero_topo``, refused in one line at construction (before any process starts):
    an ``ep_size`` below 1 or not dividing a given ``ranks_per_node``, an unknown dispatcher, expert tensor parallelism
    (``epso`` has it; inside the hierarchical engine an expert part would need a third family)."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size ({ep_size!r}) must be a positive integer")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher ({dispatcher!r}) must be one of {tuple(DISPATCHERS)}")
    if etp_size != 1:
        raise ValueError(
            f"zero_topo has no expert tensor parallelism (etp_size {etp_size}): use strategy 'epso' for it, or "
            "ep_size alone here"
        )
    if ranks_per_node is not None and ranks_per_node % ep_size:
        raise ValueError(
            f"ep_size ({ep_size}) must divide ranks_per_node ({ranks_per_node}): an expert-parallel group stays "
            "inside one node"
        )


def build_engine(
    module: nn.Module,
    optimizer: Any,
    settings: ZeroTopoSettings,
    world_size: int,
    names: dict[int, str],
    initializer: Any = None,
    device: torch.device | None = None,
) -> HierarchicalZeroAdamW:
    """The engine taking over a user's ``torch.optim.AdamW`` (param groups mapped by logical name); with an
    ``initializer`` it materialises a meta ``module`` on ``device`` one unit at a time."""
    optimizer = unwrap_optimizer(optimizer)
    if isinstance(optimizer, HierarchicalZeroAdamW):
        return optimizer
    groups = None  # set up before its optimizer: one group of every trainable parameter, until adopted
    if optimizer is not None:
        check_adamw(optimizer)
        current = {logical_name(n): p for n, p in module.named_parameters()}
        live = {id(p) for p in current.values()}
        keep = ("lr", "betas", "eps", "weight_decay", "initial_lr")
        groups = [
            {
                "params": [p if id(p) in live else current[logical_name(names[id(p)])] for p in g["params"]],
                **{k: v for k, v in g.items() if k in keep},
            }
            for g in optimizer.param_groups
        ]
    engine = HierarchicalZeroAdamW(
        module,
        settings.layout(world_size),
        groups,
        **settings.engine_kwargs(),
        initializer=initializer,
        device=device,
        ep_size=settings.ep_size,
    )
    take_over(engine, optimizer)  # a scheduler built on the user's optimizer drives the engine
    return engine


def check_adamw(optimizer: Any) -> None:
    """The engine implements AdamW: refuse anything else, naming it."""
    if type(optimizer) is not torch.optim.AdamW or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise TypeError(
            f"the zero_topo strategy implements AdamW (amsgrad=False); got {type(optimizer).__name__}"
            + (" (Muon needs whole matrices, which zero_topo's chunks split: use strategy 'epso')"
               if type(optimizer).__name__ == "MuonAdamW" else "")
        )  # fmt: skip


def _materialize_whole(
    module: nn.Module,
    device: torch.device,
    rank: int,
    world_size: int,
    seed: int,
    weights: InitWeights | None,
    topology: MoETopology | None = None,
) -> None:
    """The whole model on every rank (with expert parallelism, its expert slice: ``topology``), drawn or read once
    and broadcast: for a module the engine cannot materialise one unit at a time (not on the meta device, or with
    modules outside a Mula model). Says so on rank 0 when the module was on the meta device (a sharded set-up was
    likely expected)."""
    if rank == 0 and any(p.is_meta for p in module.parameters()):
        log.warning(
            "zero_topo: materialising the whole model on every rank before sharding it (the module holds parameters "
            "or buffers outside a Mula model, which are not drawn one unit at a time)"
        )
    topology = topology or MoETopology(dp_size=world_size, ep_size=1, rank=rank)
    materialize_and_broadcast(module, topology, device, seed=seed, weights=weights)


def _split_state(state: dict[str, Any], engine: HierarchicalZeroAdamW | None, for_load: bool):
    """(tensors for DCP, other entries) of a Fabric state dict."""
    tensors, extra = {}, {}
    for key, value in state.items():
        if isinstance(value, nn.Module) and engine is not None:
            tensors[key] = zc.model_state_dict(engine, value)
        elif isinstance(unwrap_optimizer(value), HierarchicalZeroAdamW):
            tensors[key] = zc.optimizer_state_dict(unwrap_optimizer(value), for_load=for_load)
        else:
            extra[key] = value
    return tensors, extra


class ZeroTopoOptions(ShardingOptions):
    """The constructor and the :class:`~mula_lightning.strategies.protocol.ShardingStrategy` protocol shared by
    :class:`FabricZeroTopoStrategy` and :class:`ZeroTopoStrategy` (mixed in first, before Lightning's DDP strategy).

    Args:
        weight_size: ranks a weight is sharded over (0 = the paper's default: the ranks of one GPU).
        grad_size: ranks gradients are reduce-scattered over (0 = the ranks of one node).
        optimizer_size: ranks optimizer states are sharded over (0 = every rank).
        secondary_size: ranks of the secondary weight partition (0 = none).
        ranks_per_node: processes per node (None = from the launcher's environment).
        ranks_per_gpu: processes per GPU (tiles / GCDs; None = from the environment, else 1).
        quantize_weights: block-quantized weight all-gather (ZeRO++ qwZ).
        quantize_grads: block-quantized all-to-all gradient reduce-scatter (ZeRO++ qgZ).
        weight_bits: bits of quantized weights (8 or 4).
        grad_bits: bits of quantized gradients (8 or 4).
        block_size: values per quantization block (one scale each).
        seed: initialisation seed for models built on the meta device.
        activation_checkpointing: as for ``epso``: ``"full"`` (or True: recompute each decoder layer in backward),
            False, or a list of parts (``"norm"``, ``"attention"``, ``"moe"``, ``"mlp"``); the engine gathers a
            layer's weights before its backward, so a recomputation finds them in place.
        ep_size: expert-parallel degree: ``ep_size`` consecutive ranks (inside one node: it divides the ranks per
            node) split each MoE layer's experts as under ``epso``; the expert slices are sharded by the engine over
            their ``world / ep_size`` replicas, the dense weights over every rank, as before.
        dispatcher: the token dispatcher of expert parallelism: ``"allgather"`` or ``"alltoall"``.
        etp_size: only 1 (expert tensor parallelism is ``epso``'s); anything else is refused, naming it.
        async_save: ``save_checkpoint`` stages the state to host memory and writes it in the background while
            training goes on (at most one save in flight); every save replaces its directory whole.
        **ddp_kwargs: only Lightning's DDP-strategy arguments that mean something here (accelerator,
            parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend, timeout,
            start_method); any other keyword raises a ``TypeError`` that names it.
    """

    def __init__(
        self,
        weight_size: int = 0,
        grad_size: int = 0,
        optimizer_size: int = 0,
        secondary_size: int = 0,
        ranks_per_node: int | None = None,
        ranks_per_gpu: int | None = None,
        quantize_weights: bool = False,
        quantize_grads: bool = False,
        weight_bits: int = 8,
        grad_bits: int = 4,
        block_size: int = 256,
        seed: int = 0,
        activation_checkpointing: bool | str | list[str] = False,
        ep_size: int = 1,
        dispatcher: str = "allgather",
        etp_size: int = 1,
        async_save: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        check_expert_parallel(ep_size, dispatcher, etp_size, ranks_per_node)
        super().__init__(**ddp_arguments(type(self), ZeroTopoOptions.__init__, ddp_kwargs))
        self.settings = ZeroTopoSettings(
            weight_size,
            grad_size,
            optimizer_size,
            secondary_size,
            ranks_per_node,
            ranks_per_gpu,
            quantize_weights,
            quantize_grads,
            weight_bits,
            grad_bits,
            block_size,
            seed,
            activation_checkpointing,
            ep_size,
            dispatcher,
        )
        parse_activation_checkpointing(activation_checkpointing)  # an unknown part is named at construction
        self.ep_size = ep_size
        self.async_save = bool(async_save)
        self._expert_topology: MoETopology | None = None
        self._init_flavour()

    def global_grad_norm(self, optimizer: Any) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (see ``ShardingStrategy``)."""
        return unwrap_optimizer(optimizer).global_grad_norm()

    def expert_topology(self) -> MoETopology | None:
        """The DP x EP layout of the experts (built once, collective: its process groups), None without EP."""
        if self.ep_size == 1:
            return None
        if self._expert_topology is None:
            self._expert_topology = build_topology(self.ep_size)
        return self._expert_topology

    def _expert_parallel(self, module: nn.Module) -> None:
        """Cut every MoE layer's experts to this rank's slice and give it the dispatcher (on the meta module, before
        anything is materialised; again on the same module: nothing changes)."""
        topology = self.expert_topology()
        if topology is not None:
            apply_expert_parallel(module, topology.expert_group, dispatcher=self.settings.dispatcher)

    def _whole(self, module: nn.Module) -> None:
        """The whole-model path (see :func:`_materialize_whole`), the experts cut first."""
        self._expert_parallel(module)
        _materialize_whole(
            module, self.root_device, self.global_rank, self.world_size, self.settings.seed, self.init_weights(),
            self.expert_topology(),
        )  # fmt: skip

    def _checkpoint_activations(self, module: nn.Module) -> None:
        """Activation checkpointing on the (meta) module before it is materialised: it patches forward methods."""
        if parse_activation_checkpointing(self.settings.activation_checkpointing):
            apply_activation_checkpointing(module, self.settings.activation_checkpointing)

    def _sharded_initializer(self, module: nn.Module):
        """What gives a meta parameter its value when setup can be sharded (every meta parameter in a Mula model and
        trained), else None: drawn from the seed, or with ``init_from`` each weight chunk read by one rank of the
        ranks that keep it (round robin over the parameters) and broadcast to the others; each rank writes only its
        weight chunk of each unit. Call :func:`_release` on it once the engine is built."""
        self._expert_parallel(module)  # the experts cut first: each rank draws or reads its slice's chunks
        weights, ep = self.init_weights(), self.ep_size
        if weights is not None:
            layout = self.settings.layout(self.world_size)
            initializer = weights_initializer(
                module, weights, self.global_rank, self.world_size, self.root_device,
                replica_groups=layout.weight_replica_groups(),
                expert_replica_groups=expert_weight_replica_groups(layout, ep) if ep > 1 else None,
            )  # fmt: skip
        else:
            initializer = parameter_initializer(module, self.settings.seed)
        if initializer is not None:
            initializer.slice_experts(module, self.global_rank % ep, ep)
        return initializer


def _release(initializer: Any) -> None:
    """Release what a sharded initializer holds once the engine has materialised the model (its process groups)."""
    close = getattr(initializer, "close", None)
    if close is not None:
        close()


class _NoReduceControl(_BackwardSyncControl):
    """``no_backward_sync`` is free: gradients are always reduce-scattered into the accumulating shard."""

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        return nullcontext()


class FabricZeroTopoStrategy(ZeroTopoOptions, ShardedFabricHooks, FabricDCPSaves, FabricDDPStrategy):
    """Hierarchical ZeRO for ``lightning.fabric.Fabric`` (``Fabric(strategy="zero_topo")`` or an instance).

    Arguments: see :class:`ZeroTopoOptions`.
    """

    strategy_name = "zero_topo"

    def _init_flavour(self) -> None:
        self._backward_sync_control = _NoReduceControl()
        self.engine: HierarchicalZeroAdamW | None = None
        self._adopted = True  # False while an engine built at setup_module waits for the optimizer's param groups
        self._module: nn.Module | None = None
        self._names: dict[int, str] = {}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision)
        self.settings.layout(self.world_size)  # validate the sizes before any model is built

    @override
    def module_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().module_init_context(empty_init)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """``fabric.setup_module(model)`` (then ``fabric.setup_optimizers(AdamW(model.parameters()))``, the order
        Lightning documents for sharded strategies, or no optimizer at all for evaluation): a meta Mula model is
        materialised by the engine one unit at a time, as by ``fabric.setup(model, optimizer)``; the optimizer built
        afterwards gives the engine its param groups. Otherwise the whole model is materialised on every rank, and
        a log line says so."""
        initializer = self._sharded_initializer(module)
        if initializer is None:
            self._names = {id(p): n for n, p in module.named_parameters()}
            self._module = module
            self._whole(module)
            self._checkpoint_activations(module)
            return module
        self._shard(module, None, initializer)
        self._adopted = False
        return module

    def _shard(self, module: nn.Module, optimizer: Any, initializer: Any) -> None:
        """Build the engine on a meta ``module``, materialising it one unit at a time with ``initializer``; with
        ``optimizer`` None the engine has one param group until :meth:`setup_optimizer` gives it the optimizer's."""
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._checkpoint_activations(module)
        move_real_tensors(module, self.root_device)
        self._module = module
        self.engine = build_engine(
            module, optimizer, self.settings, self.world_size, self._names, initializer, self.root_device
        )
        _release(initializer)
        init_mula_buffers(module, self.init_weights(), self.root_device)  # the routers' selection bias, if any

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None):
        """``fabric.setup(model, optimizer)``: a meta model is materialised by the engine one unit at a time (this
        rank draws its weight chunks only); otherwise (``fabric.setup_module`` alone, modules outside a Mula model)
        the whole model first, as :meth:`setup_module` does."""
        initializer = self._sharded_initializer(module) if len(optimizers) == 1 else None
        if initializer is None:
            return super().setup_module_and_optimizers(module, optimizers, scheduler)
        self._shard(module, optimizers[0], initializer)
        if scheduler is not None:
            repoint_scheduler(scheduler, self.engine)
        return module, [self.engine], scheduler

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> HierarchicalZeroAdamW:
        if self._module is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup(model, optimizer)")
        if self.engine is not None and not self._adopted:  # the engine sharded the module at setup_module
            inner = unwrap_optimizer(optimizer)
            if inner is not self.engine:
                check_adamw(inner)
                self.engine.adopt_param_groups(inner.param_groups)
                take_over(self.engine, inner)  # a scheduler built on it before this call drives the engine
            self._adopted = True
            return self.engine
        self.engine = build_engine(self._module, optimizer, self.settings, self.world_size, self._names)
        return self.engine

    def checkpoint_parts(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        tensors, extra = _split_state(state, self.engine, for_load=False)
        metadata = {k: getattr(v, "state_dict", lambda v=v: v)() for k, v in extra.items()}
        return tensors, metadata, SpreadReplicasSavePlanner()

    @override
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None):
        state = state or {}
        targets, _ = _split_state(state, self.engine, for_load=True)
        metadata = load_dcp(self.checkpoint_to_read(path), targets, strict)
        # the fp32 masters of non-fp32 weights: the optimizer's, where it was loaded (the weights are their rounding);
        # refreshed from the loaded weights only for a model loaded without its optimizer
        optimizer_loaded = any(key in targets and not isinstance(value, nn.Module) for key, value in state.items())
        for key, value in state.items():
            if key not in targets:
                if key in metadata and hasattr(value, "load_state_dict"):
                    value.load_state_dict(metadata.pop(key))
                elif key in metadata:
                    state[key] = metadata.pop(key)
            elif isinstance(value, nn.Module):
                if not optimizer_loaded:
                    zc.load_model_state_dict(self.engine, targets[key])
            else:
                zc.apply_optimizer_state_dict(unwrap_optimizer(value), targets[key])
        return metadata

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zero_topo", cls, description="hierarchical 3-level ZeRO with quantized collectives")


class ZeroTopoStrategy(ZeroTopoOptions, InPlaceCheckpointRestore, TrainerDCPSaves, TrainerDDPStrategy):
    """Hierarchical ZeRO for ``lightning.pytorch.Trainer`` (``Trainer(strategy="zero_topo")`` or an instance).

    The LightningModule builds its model in ``configure_model`` (ideally on the meta device) and returns
    ``torch.optim.AdamW`` from ``configure_optimizers``. Arguments: see :class:`ZeroTopoOptions`.
    """

    strategy_name = "zero_topo"

    _engine: HierarchicalZeroAdamW | None = None

    @property
    def engine(self) -> HierarchicalZeroAdamW | None:
        """The engine holding the model's chunks (also for evaluation: the module is sharded whenever it can be)."""
        return self._engine

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision_plugin)
        self.settings.layout(self.world_size)

    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().tensor_init_context(empty_init)

    @override
    def setup(self, trainer) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        names = {id(p): n for n, p in self.model.named_parameters()}
        fitting = trainer.state.fn == TrainerFn.FITTING
        initializer = self._sharded_initializer(self.model)  # the experts cut first (expert parallelism)
        self._checkpoint_activations(self.model)
        if initializer is None:  # a model that cannot be made parameter by parameter
            self._whole(self.model)
        else:  # the engine materialises one unit at a time below
            move_real_tensors(self.model, self.root_device)
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"zero_topo trains with exactly one optimizer, got {len(self.optimizers)}")
            self._engine = build_engine(
                self.model, self.optimizers[0], self.settings, self.world_size, names, initializer, self.root_device
            )
            for config in self.lr_scheduler_configs:
                repoint_scheduler(config.scheduler, self._engine)
            self.optimizers = [self._engine]
        elif initializer is not None:  # validate / test / predict: sharded too, the engine never steps
            self._engine = build_engine(self.model, None, self.settings, self.world_size, names, initializer,
                                        self.root_device)  # fmt: skip
        else:
            self._engine = None
        if initializer is not None:
            _release(initializer)
            init_mula_buffers(self.model, self.init_weights(), self.root_device)  # the routers' selection bias
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        pass  # materialised in setup

    @override
    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: the engine's hooks gather weights and reduce gradients

    @override
    def block_backward_sync(self):
        return nullcontext()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return self.model.state_dict()
        return zc.model_state_dict(self.engine, self.model)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return zc.optimizer_state_dict(unwrap_optimizer(optimizer))

    def checkpoint_parts(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        rest = dict(checkpoint)
        tensors = {"state_dict": rest.pop("state_dict")}
        for i, opt_state in enumerate(rest.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = opt_state
        return tensors, rest, SpreadReplicasSavePlanner()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        engine, training = self.engine, bool(self.optimizers)
        if engine is None:  # a model set up whole: plain full tensors
            targets: dict[str, Any] = {
                "state_dict": {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            }
        else:
            targets = {"state_dict": zc.model_state_dict(engine, self.model)}
            if training:
                targets["optimizer_0"] = zc.optimizer_state_dict(engine, for_load=True)
        metadata = load_dcp(self.checkpoint_to_read(checkpoint_path), targets, strict=training)
        if engine is None:
            self.model.load_state_dict(targets["state_dict"])
        elif training:  # the optimizer's fp32 masters, not the loaded weights' rounding (see the Fabric strategy)
            zc.apply_optimizer_state_dict(engine, targets["optimizer_0"])
        else:
            zc.load_model_state_dict(engine, targets["state_dict"])
        return metadata

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zero_topo", cls, description="hierarchical 3-level ZeRO with quantized collectives")


__all__ = ["FabricZeroTopoStrategy", "ZeroTopoSettings", "ZeroTopoStrategy"]
