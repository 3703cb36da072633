"""The ``"epso"`` strategy: DP x EP (x TP) with the EP-aware sharded optimizer, for Fabric and for the Trainer.

Both classes are thin: they reuse Lightning's DDP strategies for launching, process groups and collectives,
and delegate the work to :mod:`mula_lightning.parallel`:

* setup (:func:`setup_epso_module`): build the topology (one DeviceMesh: dense ``dp x tp`` and MoE ``edp x ep``
  folded over the same ranks), make the model tensor and expert parallel
  (:func:`~mula_lightning.parallel.parallelize.parallelize`: TP -> EP -> activation checkpointing -> compile),
  materialise it and broadcast the initial weights from one rank per shard; no DDP wrapper;
* the ``tp`` ranks of one group read the same batch: ``distributed_sampler_kwargs`` report the dense data-parallel
  group (``world / tp`` replicas);
* the user's ``torch.optim.AdamW`` becomes a :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`
  (a :class:`~mula_lightning.optim.muon.MuonAdamW` a :class:`~mula_lightning.parallel.sharded_muon.ShardedMuon`)
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
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy
from torch import nn
from typing_extensions import override

from mula_lightning.checkpoint.init_source import InitWeights
from mula_lightning.checkpoint.sharded import load_sharded_checkpoint, sharded_checkpoint_parts
from mula_lightning.models.transformer import MulaForCausalLM
from mula_lightning.parallel.activation_checkpointing import parse_activation_checkpointing
from mula_lightning.parallel.context_parallel import apply_context_parallel
from mula_lightning.parallel.expert_parallel import expert_part
from mula_lightning.parallel.parallelize import materialize_and_broadcast, parallelize
from mula_lightning.parallel.params import is_expert_param
from mula_lightning.parallel.pipeline import prune_to_stages
from mula_lightning.parallel.sharded_muon import shard_optimizer
from mula_lightning.parallel.sharded_optimizer import MODES, ShardedAdamW, unwrap_optimizer
from mula_lightning.parallel.state_dict import model_state_dict, optimizer_state_dict
from mula_lightning.parallel.token_dispatchers import DISPATCHERS
from mula_lightning.parallel.topology import MoETopology, build_topology
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


@dataclass
class EPSOSettings:
    """The user's choices for a DP x EP run (validated on construction)."""

    ep_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    etp_size: int = 1
    sharded_optimizer: str = "ep_aware"
    dispatcher: str = "allgather"
    reduce_dtype: torch.dtype = torch.float32
    bucket_numel: int | None = 40_000_000
    seed: int = 0
    activation_checkpointing: bool | str | list[str] = False
    compile: bool | dict[str, Any] = False
    init_from_dense: str | None = None
    upcycle: dict[str, Any] | None = None
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1
    pp_boundaries: list[int] | str | None = None
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("ep_size", "tp_size", "etp_size", "pp_size", "pp_virtual_stages", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        self._check_pipeline()
        self._check_context_parallel()
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel=True splits the sequence over tensor-parallel ranks: set tp_size > 1")
        if self.tp_size > 1 and self.sharded_optimizer == "dp":
            raise ValueError(
                f"sharded_optimizer='dp' with tp_size ({self.tp_size}) > 1 is not supported: it is the DP-only "
                "baseline of DP x EP; use 'ep_aware' (each family sharded over exactly its replicas) or 'none'"
            )
        if self.etp_size > 1 and self.dispatcher != "allgather":
            raise ValueError(
                f"etp_size ({self.etp_size}) > 1 needs dispatcher='allgather' (got {self.dispatcher!r}): the "
                "all-gather dispatcher's reduce-scatter sums the experts' partial down projections"
            )
        if self.etp_size > 1 and self.sharded_optimizer == "dp":
            raise ValueError(
                f"sharded_optimizer='dp' with etp_size ({self.etp_size}) > 1 is not supported: it is the DP-only "
                "baseline of DP x EP; use 'ep_aware' or 'none'"
            )
        if self.sharded_optimizer not in MODES:
            raise ValueError(f"sharded_optimizer ({self.sharded_optimizer!r}) must be one of {MODES}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be one of {tuple(DISPATCHERS)}")
        if isinstance(self.reduce_dtype, str):
            self.reduce_dtype = getattr(torch, self.reduce_dtype.replace("torch.", ""))
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"reduce_dtype ({self.reduce_dtype}) must be torch.float32 or torch.bfloat16")
        parse_activation_checkpointing(self.activation_checkpointing)  # an unknown part is named at construction

    def _check_context_parallel(self) -> None:
        """What context parallelism does not run with yet, refused in one line naming the sizes."""
        if self.cp_size == 1:
            return
        if self.etp_size > 1:
            raise ValueError(
                f"cp_size ({self.cp_size}) > 1 with etp_size ({self.etp_size}) > 1 is not supported yet: context "
                "parallelism folds with data, expert, tensor and pipeline parallelism (ep_size, tp_size, pp_size)"
            )
        if self.compile:
            raise ValueError(f"cp_size ({self.cp_size}) > 1 with compile: the attention's all-gather would break the "
                             "compiled graph; set compile=False")  # fmt: skip

    def _check_pipeline(self) -> None:
        from mula_lightning.parallel.pipeline import SCHEDULES

        if isinstance(self.pp_boundaries, str) and self.pp_boundaries != "params":
            raise ValueError(
                f"pp_boundaries ({self.pp_boundaries!r}) must be a list of layer indices, 'params' or None"
            )
        m = self.pp_microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"pp_microbatches ({m!r}) must be an integer >= 1, or None (one sequence each)")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule ({self.pp_schedule!r}) must be one of {tuple(SCHEDULES)}")
        if self.pp_virtual_stages > 1 and not SCHEDULES[self.pp_schedule]:
            raise ValueError(
                f"pp_virtual_stages ({self.pp_virtual_stages}) > 1 needs pp_schedule='interleaved_1f1b'; "
                f"{self.pp_schedule!r} runs one stage per rank"
            )
        if self.pp_size > 1 and self.pp_schedule != "gpipe" and m is not None and m < self.pp_size:
            raise ValueError(f"pp_microbatches ({m}) must be at least pp_size ({self.pp_size}) for {self.pp_schedule}")

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(mode=self.sharded_optimizer, reduce_dtype=self.reduce_dtype, bucket_numel=self.bucket_numel)


def setup_epso_module(
    module: nn.Module,
    settings: EPSOSettings,
    device: torch.device,
    topology: MoETopology | None = None,
    weights: InitWeights | None = None,
) -> MoETopology:
    """Topology, then :func:`parallelize` (EP -> AC -> compile), then materialise and broadcast the weights (drawn
    from ``settings.seed``, or read from ``weights`` once per shard)."""
    if weights is not None and settings.init_from_dense:
        raise ValueError(
            f"init_from ({weights.path}) and init_from_dense ({settings.init_from_dense}) both give the initial "
            "weights; keep one"
        )
    staged = pipeline_model(module, settings.pp_size) if settings.pp_size > 1 else None  # named before any group
    topology = topology or build_topology(
        settings.ep_size,
        settings.tp_size,
        settings.sequence_parallel,
        settings.etp_size,
        settings.pp_size,
        settings.cp_size,
    )
    if staged is not None:  # on the meta device: this rank never materialises another stage's layers
        prune_to_stages(staged, topology.pp_rank, settings.pp_size, settings.pp_virtual_stages, settings.pp_boundaries)
    parallelize(
        module,
        topology,
        dispatcher=settings.dispatcher,
        activation_checkpointing=settings.activation_checkpointing,
        compile=settings.compile,
    )
    if settings.cp_size > 1:
        apply_context_parallel(module, topology.cp_group, settings.cp_size, topology.cp_rank)
    materialize_and_broadcast(module, topology, device, seed=settings.seed, weights=weights)
    if settings.init_from_dense:
        initialise_from_dense(module, settings.init_from_dense, topology, settings.upcycle or {})
    return topology


def pipeline_model(module: nn.Module, pp_size: int) -> MulaForCausalLM:
    """The one ``MulaForCausalLM`` inside ``module`` that pipeline parallelism cuts into stages.

    Raises:
        ValueError: naming the module when it holds none, or several.
    """
    found = [m for m in module.modules() if isinstance(m, MulaForCausalLM)]
    if len(found) != 1:
        raise ValueError(
            f"pp_size ({pp_size}) > 1 splits one MulaForCausalLM by layers; {type(module).__name__} holds {len(found)}"
        )
    return found[0]


def build_pipeline(module: nn.Module, settings: EPSOSettings, topology: MoETopology, device: Any) -> Any:
    """The :class:`~mula_lightning.parallel.pipeline_runner.PipelineRunner` of a set-up module (None without
    pipeline parallelism)."""
    if settings.pp_size == 1:
        return None
    from mula_lightning.parallel.pipeline_runner import PipelineRunner

    return PipelineRunner(  # the stage cuts the model was pruned with (model.pipeline_boundaries)
        pipeline_model(module, settings.pp_size), topology, settings.pp_schedule, settings.pp_microbatches,
        settings.pp_virtual_stages, None, device,
    )  # fmt: skip


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
    from mula_lightning.models.upcycle import UpcycleSpec, build_upcycled

    targets = [m for m in module.modules() if isinstance(m, MulaForCausalLM)]
    if not targets:
        raise ValueError("init_from_dense needs a MulaForCausalLM inside the module being set up")
    for target in targets:
        cfg = target.config
        if not cfg.is_moe:
            raise ValueError(f"init_from_dense upcycles into an MoE; the model config ({cfg.name}) has no experts")
        local = build_upcycled(
            path,
            UpcycleSpec.for_model(cfg, **options),
            ep_rank=topology.ep_rank,
            ep_size=topology.ep_size,
            dtype=next(target.parameters()).dtype,
        )
        have = target.state_dict()
        got = {  # with expert tensor parallelism: this rank's part of its experts' intermediate dimension
            k: expert_part(k, v, topology.etp_rank, topology.etp_size) if is_expert_param(k) else v
            for k, v in local.state_dict().items()
            if topology.pp_size == 1 or k in have  # under pipeline parallelism: this rank's stages only
        }
        wrong = [
            f"{k}: model {tuple(have[k].shape) if k in have else None} vs upcycled {tuple(v.shape)}"
            for k, v in got.items()
            if k not in have or have[k].shape != v.shape
        ] + [f"{k}: missing from the upcycled model" for k in have if k not in got]
        if wrong:
            raise ValueError(f"the dense checkpoint {path} does not fit the model config: " + "; ".join(wrong[:6]))
        for k, v in got.items():
            have[k].copy_(v)


class EPSOOptions(ShardingOptions):
    """The constructor and the :class:`~mula_lightning.strategies.protocol.ShardingStrategy` protocol shared by
    :class:`FabricEPSOStrategy` and :class:`EPSOStrategy` (mixed in first, before Lightning's DDP strategy).

    Args:
        ep_size: expert-parallel degree (divides the world size and every MoE layer's experts).
        tp_size: tensor-parallel degree of the dense layers (attention heads, dense MLPs, vocabulary; divides the
            world size and those sizes), folded with ``ep_size`` over the same ranks (MoE parallel folding): the
            ``tp`` ranks are consecutive (one node) and read the same batch.
        etp_size: expert tensor parallelism (Megatron's ETP): each expert's intermediate dimension split over
            ``etp_size`` consecutive ranks, which share an expert slice (``ep_size x etp_size`` ranks split the
            experts; the all-gather dispatcher only). Pays for wide experts (coarse upcycled MoEs), not for
            fine-grained ones, whose experts are already thin.
        sequence_parallel: with ``tp_size > 1``, split the residual stream, the norms and the MoE blocks' tokens
            over ``tp`` along the sequence (Megatron's; the sequence length must divide by ``tp_size``). Without it,
            MoE layers under TP route every token on each ``tp`` rank (correct, ``tp`` times the expert work):
            turn it on for MoE models, as Megatron requires.
        sharded_optimizer: ``"ep_aware"`` (EPSO), ``"dp"`` (SO / ZeRO-1 over DP) or ``"none"`` (replicated).
        dispatcher: MoE token dispatch, ``"allgather"`` (Aurora) or ``"alltoall"``.
        reduce_dtype: dtype gradients are reduced in (``torch.float32``, or ``torch.bfloat16`` as in the paper).
        bucket_numel: elements per gradient-reduction bucket.
        seed: initialisation seed for models built on the meta device (weights are a function of (seed, name)).
        activation_checkpointing: ``"full"`` (or True: recompute each decoder layer in backward), False, or a list
            of the parts to recompute: ``"norm"``, ``"attention"``, ``"moe"`` (the expert block), ``"mlp"`` (dense
            MLPs); routers replay their forward's decisions (:mod:`mula_lightning.parallel.activation_checkpointing`).
        compile: regional ``torch.compile`` of attention and norms (a dict is passed to ``compile``).
        init_from_dense: a dense checkpoint (HF Llama directory or Mula model-only checkpoint) to upcycle into the
            model at setup, online: each rank builds only its own experts (see :func:`initialise_from_dense`).
        upcycle: options of that upcycling: ``granularity``, ``noise``, ``seed``, ``layers``.
        async_save: ``save_checkpoint`` stages the state to host memory and writes it in the background while
            training goes on (at most one save in flight); every save replaces its directory whole.
        pp_size: pipeline stages (consecutive blocks of ``world / pp_size`` ranks; every size above is per stage):
            each rank builds and trains only its stages' layers (embedding on the first, final norm and LM head on
            the last). A step is :meth:`pipeline_step` (``MulaLM`` calls it; a Fabric loop calls it instead of
            ``model(...)`` + ``fabric.backward``); every rank of a pipeline reads the same batch.
        pp_schedule: ``"1f1b"`` (the paper's), ``"gpipe"`` or ``"interleaved_1f1b"`` (with
            ``pp_virtual_stages > 1``), from ``torch.distributed.pipelining``.
        pp_microbatches: micro-batches each rank's batch is cut into (the schedule's; they replace gradient
            accumulation inside a step); None: one sequence each. At least ``pp_size`` for the 1F1B schedules.
        pp_virtual_stages: stages per rank (interleaved 1F1B: rank r runs stages ``r, r + pp, ...``); the layers
            must divide by ``pp_size x pp_virtual_stages``.
        pp_boundaries: the first layer of every stage but the first (stages balanced by hand), ``"params"`` (the
            stages balanced by parameter count, the embedding counted on the first and the LM head on the last), or
            None (equal layer counts).
        cp_size: context parallelism (:mod:`mula_lightning.parallel.context_parallel`): every sequence cut into
            ``2 x cp_size`` chunks over ``cp_size`` consecutive ranks (rank r holding chunks r and 2cp-1-r, the causal
            load balance), keys and values all-gathered for attention, the loss and the routers' losses those of
            the whole sequences; the ``cp`` ranks read one batch and serve as expert-parallel ranks too (folding).
            Sequence lengths must divide by ``2 x cp_size``. Composes with ``tp_size``, with or without
            ``sequence_parallel``, and ``pp_size``; not yet with ``etp_size``.
        cuda_graphs: replay each training micro-batch's forward and backward as two CUDA graphs, captured at the
            first training step (:mod:`mula_lightning.parallel.cuda_graphs`): for one CUDA device per model replica
            (``ep_size``, ``etp_size``, ``tp_size``, ``pp_size`` of 1) and dropless routing; where that does not
            hold, one warning names why and the steps run eagerly. The optimizer step stays eager.
        **ddp_kwargs: only Lightning's DDP-strategy arguments that mean something here (accelerator,
            parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend, timeout,
            start_method); any other keyword raises a ``TypeError`` that names it.
    """

    def __init__(
        self,
        ep_size: int = 1,
        sharded_optimizer: str = "ep_aware",
        dispatcher: str = "allgather",
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int | None = 40_000_000,
        seed: int = 0,
        activation_checkpointing: bool | str | list[str] = False,
        compile: bool | dict[str, Any] = False,
        init_from_dense: str | None = None,
        upcycle: dict[str, Any] | None = None,
        async_save: bool = False,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        etp_size: int = 1,
        pp_size: int = 1,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_virtual_stages: int = 1,
        pp_boundaries: list[int] | str | None = None,
        cuda_graphs: bool = False,
        cp_size: int = 1,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(**ddp_arguments(type(self), EPSOOptions.__init__, ddp_kwargs))
        self.settings = EPSOSettings(
            ep_size,
            tp_size,
            sequence_parallel,
            etp_size,
            sharded_optimizer,
            dispatcher,
            reduce_dtype,
            bucket_numel,
            seed,
            activation_checkpointing,
            compile,
            init_from_dense,
            upcycle,
            pp_size,
            pp_schedule,
            pp_microbatches,
            pp_virtual_stages,
            pp_boundaries if pp_boundaries is None or isinstance(pp_boundaries, str) else list(pp_boundaries),
            cp_size,
        )
        self.topology: MoETopology | None = None
        self.pipeline: Any = None  # the PipelineRunner once set up (pp_size > 1)
        self._pipeline_backward_done = False
        self.async_save = bool(async_save)
        self.cuda_graphs = bool(cuda_graphs)
        self.graphed_forwards: list[Any] = []  # the GraphedTrainingForward of each model once set up (cuda_graphs)
        self._init_flavour()

    @property
    def ep_size(self) -> int:
        return self.settings.ep_size

    @property
    def tp_size(self) -> int:
        return self.settings.tp_size

    @property
    def pp_size(self) -> int:
        return self.settings.pp_size

    @property
    def cp_size(self) -> int:
        return self.settings.cp_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica per distinct batch of a pipeline stage: the ``tp`` ranks of a group (consecutive ranks), the
        ``cp`` ranks of a group (the next consecutive ones, each holding chunks of the batch's sequences) and the
        ``pp`` ranks of a pipeline read the same batch; every other rank, expert-parallel peers included, reads its
        own."""
        shared, pp = self.settings.tp_size * self.settings.cp_size, self.settings.pp_size
        stage = self.num_nodes * self.num_processes // pp
        return {"num_replicas": stage // shared, "rank": self.global_rank % stage // shared}

    def pipeline_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, loss_scale: float = 1.0):
        """Forward and backward of one batch through the pipeline (``pp_size > 1``): every micro-batch through this
        rank's stages with the configured schedule; returns a
        :class:`~mula_lightning.parallel.pipeline_runner.PipelineLoss`, equal on every rank of the pipeline (the
        mean over micro-batches of cross-entropy plus MoE auxiliary losses). Gradients go to the sharded optimizer,
        reduced at its next ``clip_grad_norm_`` / ``step`` (inside ``no_backward_sync`` they accumulate): call it in
        place of ``model(...)`` and ``backward``. ``labels`` default to ``input_ids``; ``loss_scale`` weights this
        batch's gradients (``1 / accumulated batches``). Collective over the pipeline and its stages.

        Raises:
            RuntimeError: without pipeline parallelism, or before the module is set up.
        """
        runner = self._runner()
        optimizer = self.sharded_optimizer
        with _sync_disabled(optimizer) if optimizer is not None else nullcontext():
            result = runner.train_step(input_ids, input_ids if labels is None else labels, loss_scale)
        self._pipeline_backward_done = True
        return result

    def pipeline_eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The summed next-token cross-entropy of one batch through the pipeline (forward only), on every rank of
        the pipeline. Collective over the pipeline and its stages."""
        return self._runner().eval_step(input_ids, input_ids if labels is None else labels)

    def _install_cuda_graphs(self, module: nn.Module) -> None:
        if self.cuda_graphs and not self.graphed_forwards:
            from mula_lightning.parallel.cuda_graphs import install_cuda_graphs

            self.graphed_forwards = install_cuda_graphs(module, self.root_device, self.topology)

    def _runner(self) -> Any:
        if self.pipeline is None:
            raise RuntimeError(
                "pipeline_step needs pp_size > 1 and a set-up module"
                if self.settings.pp_size > 1
                else f"pipeline_step is for pipeline parallelism; this strategy has pp_size {self.settings.pp_size}"
            )
        return self.pipeline

    def global_grad_norm(self, optimizer: Any) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (see ``ShardingStrategy``)."""
        sharded = unwrap_optimizer(optimizer)
        sharded.finish_grad_sync()
        return sharded.owned_grad_norm()


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


class FabricEPSOStrategy(EPSOOptions, ShardedFabricHooks, FabricDCPSaves, FabricDDPStrategy):
    """DP x EP with EPSO for ``lightning.fabric.Fabric`` (``Fabric(strategy="epso")`` or an instance).

    Arguments: see :class:`EPSOOptions`.
    """

    strategy_name = "epso"

    def _init_flavour(self) -> None:
        self._backward_sync_control = _ShardedBackwardSync(self)
        self.sharded_optimizer: ShardedAdamW | None = None
        self._module: nn.Module | None = None
        self._names_by_id: dict[int, str] = {}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision)

    @override
    def module_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().module_init_context(empty_init)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not any(p.is_meta for p in module.parameters()):  # meta modules are materialised in setup_module
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._names_by_id = {id(p): n for n, p in module.named_parameters()}  # before materialising replaces them
        weights = self.init_weights()
        self.topology = setup_epso_module(module, self.settings, self.root_device, self.topology, weights)
        self.pipeline = build_pipeline(module, self.settings, self.topology, self.root_device)
        self._install_cuda_graphs(module)
        self._module = module
        return module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedAdamW:
        if self._module is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup(model, optimizer)")
        self.sharded_optimizer = shard_optimizer(
            self._module,
            unwrap_optimizer(optimizer),
            self.topology,
            self._names_by_id,
            **self.settings.optimizer_kwargs(),
        )
        return self.sharded_optimizer

    def checkpoint_parts(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        return sharded_checkpoint_parts(state, self.topology)

    @override
    def load_checkpoint(
        self, path, state=None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_sharded_checkpoint(self.checkpoint_to_read(path), state or {}, self.topology, strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("epso", cls, description="DP x EP with the EP-aware sharded optimizer (EPSO)")


class EPSOStrategy(EPSOOptions, InPlaceCheckpointRestore, TrainerDCPSaves, TrainerDDPStrategy):
    """DP x EP with EPSO for ``lightning.pytorch.Trainer`` (``Trainer(strategy="epso")`` or an instance).

    The LightningModule builds its model in ``configure_model`` (ideally on the meta device:
    ``with torch.device("meta")``); the strategy parallelises, materialises and broadcasts it. Arguments: see
    :class:`EPSOOptions`.
    """

    strategy_name = "epso"

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        return unwrap_optimizer(self.optimizers[0]) if self.optimizers else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision_plugin)

    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().tensor_init_context(empty_init)

    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        weights = self.init_weights()
        self.topology = setup_epso_module(self.model, self.settings, self.root_device, self.topology, weights)
        self.pipeline = build_pipeline(self.model, self.settings, self.topology, self.root_device)
        self._install_cuda_graphs(self.model)
        self.barrier()
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            opts = [
                shard_optimizer(self.model, unwrap_optimizer(o), self.topology, **self.settings.optimizer_kwargs())
                for o in self.optimizers
            ]
            for config in self.lr_scheduler_configs:
                index = next(
                    i for i, o in enumerate(self.optimizers) if unwrap_optimizer(o) is config.scheduler.optimizer
                )
                repoint_scheduler(config.scheduler, opts[index])
            self.optimizers = opts
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        pass  # setup_epso_module materialises / moves the model

    @override
    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: the sharded optimizer reduces gradients

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        opt = self.sharded_optimizer
        with _sync_disabled(opt) if opt is not None else nullcontext():
            yield

    @override
    def pipeline_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, loss_scale: float = 1.0):
        """See :meth:`EPSOOptions.pipeline_step`. Lightning zeroes the gradients between ``training_step`` and the
        backward; the schedule's gradients are kept through it (the optimizer's ``step`` zeroes them after use)."""
        result = super().pipeline_step(input_ids, labels, loss_scale)
        optimizer = self.sharded_optimizer
        if optimizer is not None and self.lightning_module.automatic_optimization:
            optimizer.keep_grads = True  # until backward() below
        return result

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """After :meth:`pipeline_step` the schedule already ran the backward: only the hooks around it run here."""
        if not self._pipeline_backward_done:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._pipeline_backward_done = False
        if self.sharded_optimizer is not None:
            self.sharded_optimizer.keep_grads = False
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state_dict(self.model, self.topology)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return optimizer_state_dict(unwrap_optimizer(optimizer))

    def checkpoint_parts(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        rest = dict(checkpoint)
        state = {"state_dict": rest.pop("state_dict")}
        for i, opt_state in enumerate(rest.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        return sharded_checkpoint_parts(state, self.topology, metadata=rest)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {"state_dict": self.model}
        for i, opt in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = unwrap_optimizer(opt)
        return load_sharded_checkpoint(self.checkpoint_to_read(checkpoint_path), state, self.topology, strict=True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("epso", cls, description="DP x EP with the EP-aware sharded optimizer (EPSO)")


__all__ = ["MODES", "EPSOOptions", "EPSOSettings", "EPSOStrategy", "FabricEPSOStrategy"]
