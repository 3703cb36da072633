"""Apply parallelism to a plain single-device model, in one fixed, commented order.

The order matters and is the same everywhere (the strategies call :func:`parallelize`):

0. **Tensor parallelism** (``topology.tp_size > 1``) first: it turns the attention, dense MLP, embedding and LM
   head weights of every Mula model into DTensors sharded over ``tp`` (on the meta device too: nothing is
   materialised whole), and installs the vocabulary-parallel loss.
1. **Expert parallelism** next: it replaces MoE blocks and cuts expert tensors to the local slice, so every
   later step sees the final modules and parameter shapes.
2. **Activation checkpointing** next: whole decoder layers or the selected parts
   (:mod:`~mula_lightning.parallel.activation_checkpointing`), EP collectives included, which are then re-run in
   backward on every rank alike; routers replay their forward's decisions.
3. **Compile** after that: regional compilation of the attention and norm modules of each layer. FastSparseMoE
   is left eager on purpose: its routed-token counts are data dependent, so a compiled MoE block would either
   recompile for every new routing or break its graph at each count; asking to compile it raises.
4. **Data-parallel sharding** last, and not as a module wrapper: the sharded optimizer
   (:class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`) lays the parameters out in flat buffers
   and reduces gradients through hooks, so the module keeps its single-device names (checkpoint keys).

Materialisation (meta device -> real tensors) and the initial broadcast are in :func:`materialize_and_broadcast`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.transformer import (
    BIAS_BUFFER,
    MulaDecoderLayer,
    MulaForCausalLM,
    fill_initial_,
    init_buffer,
    init_parameter,
)
from mula_lightning.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    parse_activation_checkpointing,
)
from mula_lightning.parallel.expert_parallel import apply_expert_parallel, expert_part
from mula_lightning.parallel.params import (
    dtensor_local_box,
    is_dtensor,
    is_expert_param,
    is_tensor_parallel,
    local_tensor,
    logical_name,
)
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.dist import is_distributed


def parallelize(
    model: nn.Module,
    topology: MoETopology,
    *,
    dispatcher: str = "allgather",
    activation_checkpointing: bool | str | list[str] = False,
    compile: bool | dict[str, Any] = False,
) -> nn.Module:
    """TP -> EP -> activation checkpointing -> compile, in place (see the module docstring); returns ``model``.

    Raises:
        ValueError: with tensor parallelism, when the module holds no Mula model or ``tp_size`` does not divide a
            size of one (naming them).
    """
    if topology.tp_size > 1:  # 0. tensor parallelism
        from mula_lightning.parallel.tensor_parallel import apply_tensor_parallel

        mulas = _mula_models(model)
        if not mulas:
            raise ValueError(f"tp_size ({topology.tp_size}) > 1 needs a MulaForCausalLM inside the module")
        for _, mula in mulas:
            apply_tensor_parallel(mula, topology.tp_mesh, sequence_parallel=topology.sequence_parallel)
    if topology.ep_size * topology.etp_size > 1:  # 1. expert (tensor) parallelism
        apply_expert_parallel(model, topology.expert_group, dispatcher=dispatcher, etp_size=topology.etp_size)
    if parse_activation_checkpointing(activation_checkpointing):  # 2. activation checkpointing
        apply_activation_checkpointing(model, activation_checkpointing)
    if compile:  # 3. regional compile (MoE blocks stay eager)
        apply_compile(model, **(compile if isinstance(compile, dict) else {}))
    return model  # 4. data-parallel sharding happens in the sharded optimizer


def apply_compile(model: nn.Module, moe: bool = False, **compile_kwargs: Any) -> nn.Module:
    """Compile the attention and norm modules of every decoder layer in place (``nn.Module.compile``).

    In-place compilation keeps parameter names (no ``_orig_mod.`` prefix), so checkpoints are unchanged.

    Raises:
        ValueError: when ``moe=True``: FastSparseMoE has data-dependent shapes and is not compiled.
    """
    if moe:
        raise ValueError(
            "torch.compile of FastSparseMoE is not supported: routed-token counts per expert are data dependent "
            "(a recompile or graph break per routing); compile=True compiles attention and norms and leaves the "
            "MoE blocks eager"
        )
    for module in model.modules():
        if isinstance(module, MulaDecoderLayer):
            for child in (module.self_attn, module.input_layernorm, module.post_attention_layernorm):
                child.compile(**compile_kwargs)
    return model


def _mula_models(model: nn.Module) -> list[tuple[str, MulaForCausalLM]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MulaForCausalLM)]


@torch.no_grad()
def materialize_and_broadcast(
    model: nn.Module,
    topology: MoETopology,
    device: torch.device,
    seed: int = 0,
    broadcast: bool = True,
    weights: Any = None,
) -> nn.Module:
    """Give every rank the same initial weights, reading or drawing them once per shard.

    A model on the meta device is allocated on ``device``; on the ranks with ``dp_rank == 0`` (one per expert
    slice) or ``dense_dp_rank == 0`` (one per tensor-parallel slice) every parameter of a Mula model is drawn from
    (seed, single-device name) on the full tensor and sliced, or, with ``weights``, read from it:
    ``weights.read(config, name, rows)`` returns the parameter of single-device name ``name`` (rows ``rows`` of it
    for an expert slice; see :class:`~mula_lightning.checkpoint.init_source.InitWeights`); other modules get
    ``reset_parameters()``. Then replicated tensors are broadcast from global rank 0, expert slices from the
    ``dp_rank == 0`` rank of each DP group and tensor-parallel slices from the ``dense_dp_rank == 0`` rank of each
    dense DP group, so one process, DDP and every DP x EP x TP layout start bit-identical and only one rank per
    shard ever initialises or reads.
    """
    was_meta = any(p.is_meta for p in model.parameters())
    if weights is not None and not was_meta:
        raise ValueError("weights to read need a model built on the meta device (its values would be overwritten)")
    if was_meta:
        _to_empty_meta_only(model, device)
        if topology.dp_rank == 0 or topology.dense_dp_rank == 0:
            _initialise(model, topology, seed, weights)
    else:
        model.to(device)
    if broadcast:
        broadcast_from_readers(model, topology)
    return model


def reads_shard(name: str, tensor: Any, topology: MoETopology) -> bool:
    """Whether this rank is the one that reads (or draws) model tensor ``name`` for its replicas: global rank 0 for a
    replicated tensor, the ``dp_rank == 0`` rank of each EP group for an expert slice, the ``dense_dp_rank == 0`` rank
    of each ``tp`` group for a tensor-parallel slice; the others receive it from :func:`broadcast_from_readers`."""
    if is_expert_param(name) and topology.ep_size * topology.etp_size > 1:
        return topology.dp_rank == 0
    if is_tensor_parallel(tensor):
        return topology.dense_dp_rank == 0
    return topology.stage_rank == 0  # each pipeline stage reads its own layers


def broadcast_from_readers(model: nn.Module, topology: MoETopology) -> None:
    """Send every model tensor from its reader (:func:`reads_shard`) to its replicas, in place (collective)."""
    if not is_distributed() or topology.world_size == 1:
        return
    for name, tensor in model.state_dict().items():
        if is_expert_param(name) and topology.ep_size * topology.etp_size > 1:
            if topology.dp_size > 1:  # the dp_rank == 0 member of the group
                dist.broadcast(tensor, src=topology.expert_root, group=topology.dp_group)
        elif is_tensor_parallel(tensor):
            if topology.dense_dp_size > 1:  # the dense_dp_rank == 0 member of the group: the stage's tp_rank
                src = topology.stage_root + topology.tp_rank
                dist.broadcast(local_tensor(tensor), src=src, group=topology.dense_dp_group)
        elif topology.stage_size > 1:  # a replicated tensor: from the stage's first rank to the stage
            dist.broadcast(local_tensor(tensor), src=topology.stage_root, group=topology.stage_group)


def _meta_parameter_table(model: nn.Module) -> dict[int, tuple[MulaConfig, str]] | None:
    """``id(meta parameter) -> (its Mula config, single-device name)``; None when the meta parameters cannot be made
    one by one (see :func:`parameter_initializer`)."""
    table: dict[int, tuple[MulaConfig, str]] = {}
    for _, mula in _mula_models(model):
        for wrapped_name, param in mula.named_parameters():
            table[id(param)] = (mula.config, logical_name(wrapped_name))
    params = list(model.parameters())
    known = {  # the routers' selection biases, set by init_mula_buffers
        id(b) for _, mula in _mula_models(model) for n, b in mula.named_buffers() if n.endswith(BIAS_BUFFER)
    }
    if not any(p.is_meta for p in params) or any(b.is_meta and id(b) not in known for b in model.buffers()):
        return None
    if any(p.is_meta and id(p) not in table for p in params):
        return None
    return table


class _MetaSources:
    """What a meta parameter of a Mula model is a part of: its config, single-device name, full shape and where its
    elements start in the full tensor's flattened elements (an expert slice of expert parallelism: its rows)."""

    def __init__(self, table: dict[int, tuple[MulaConfig, str]]) -> None:
        self.table = table
        self.slices: dict[int, tuple[tuple[int, ...], int]] = {}

    def slice_experts(self, model: nn.Module, ep_rank: int, ep_size: int) -> None:
        """Record that the (meta) expert parameters of ``model`` hold slice ``ep_rank`` of ``ep_size`` of their
        layer's experts (:func:`~mula_lightning.parallel.expert_parallel.apply_expert_parallel` cut them), so a range
        of one is drawn or read at its rows of the full tensor."""
        for param in model.parameters():
            if id(param) in self.table and is_expert_param(self.table[id(param)][1]) and ep_size > 1:
                shape = tuple(param.shape)
                self.slices[id(param)] = ((shape[0] * ep_size, *shape[1:]), ep_rank * param.numel())

    def source(self, param: nn.Parameter) -> tuple[MulaConfig, str, tuple[int, ...], int]:
        config, name = self.table[id(param)]
        shape, offset = self.slices.get(id(param), (tuple(param.shape), 0))
        return config, name, shape, offset


class ParameterInitializer(_MetaSources):
    """The initial value of any meta parameter of a Mula model, drawn on demand from (seed, single-device name).

    Calling it gives a parameter's full value; :meth:`fill_` writes an element range of it, drawing only the blocks
    that range touches (:func:`~mula_lightning.models.transformer.fill_initial_`): a shard owner materialises its
    part without ever holding the whole tensor.
    """

    def __init__(self, table: dict[int, tuple[MulaConfig, str]], seed: int) -> None:
        super().__init__(table)
        self.seed = seed

    def __call__(self, param: nn.Parameter) -> torch.Tensor:
        config, name, shape, offset = self.source(param)
        return (
            init_parameter(name, shape, config, self.seed)
            .reshape(-1)[offset : offset + param.numel()]
            .view(param.shape)
        )

    def fill_(self, param: nn.Parameter, out: torch.Tensor, start: int) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of ``param``'s flattened initial value, written into ``out``."""
        config, name, shape, offset = self.source(param)
        return fill_initial_(out, name, shape, config, self.seed, start + offset)

    def fill_many_(self, requests: list[tuple[nn.Parameter, torch.Tensor, int]]) -> None:
        """:meth:`fill_` for several ``(param, out, start)`` requests (a flat buffer's chunk), every request's staged
        blocks first (see :func:`~mula_lightning.models.transformer.fill_initial_`): into memory allocated but not
        yet written, the block-sized temporaries come and go before the pages drawn in place become resident, so
        materialising a chunk peaks at the chunk, not the chunk plus a block."""
        for blocks in ("staged", "direct"):
            for param, out, start in requests:
                config, name, shape, offset = self.source(param)
                fill_initial_(out, name, shape, config, self.seed, start + offset, blocks=blocks)


class WeightsInitializer(_MetaSources):
    """Like :class:`ParameterInitializer`, with the values read from ``weights`` (``init_from``, an
    :class:`~mula_lightning.checkpoint.init_source.InitWeights`), each part read once and broadcast to the ranks that
    keep the same part.

    :meth:`fill_` (what a sharded engine asks for: one element range of a parameter per rank) reads the range alone
    (``weights.read_range``) on one rank of ``replicas``, the ranks that keep the same ranges (the engine's weight
    chunk at the same position in every weight group), round robin over the parameters, and broadcasts it inside
    them: the model is read once over the job, each rank reading about ``1 / world_size`` of it, and no rank holds
    more of a parameter than the range it keeps. Without ``replicas`` (ranges that may differ between ranks), and
    for :meth:`__call__`, the parameter's whole value is read by rank ``i % world_size`` and broadcast to every rank.

    Collective: every rank must ask for the same parameters in the same order (the engine materialises its units in
    one order on every rank), :meth:`fill_` included, with an empty ``out`` where a rank keeps nothing of one, and
    the ranks of one replica group with the same ranges. :meth:`close` releases the replica groups.

    Args:
        replicas: this rank's replica group: ``(process group, its global ranks)``; see :func:`weights_initializer`.
        expert_replicas: the same for the expert slices (:meth:`slice_experts`): the ranks keeping the same ranges of
            the same slice; default ``replicas``.
    """

    def __init__(
        self,
        table: dict[int, tuple[MulaConfig, str]],
        weights: Any,
        rank: int,
        world_size: int,
        device: Any,
        replicas: tuple[Any, list[int]] | None = None,
        expert_replicas: tuple[Any, list[int]] | None = None,
    ) -> None:
        super().__init__(table)
        self.weights, self.rank, self.world_size, self.device = weights, rank, world_size, device
        self.replicas = replicas
        self.expert_replicas = expert_replicas
        self.asked = 0
        self.asked_experts = 0  # the round robin of each replica group counts what its members ask alike

    def __call__(self, param: nn.Parameter) -> torch.Tensor:
        if id(param) in self.slices:
            raise ValueError("a whole expert slice is read range by range (fill_), not whole")
        config, name = self.table[id(param)]
        reader, self.asked = self.asked % self.world_size, self.asked + 1
        if self.rank == reader:
            value = self.weights.read(config, name).to(device=self.device, dtype=param.dtype)
        else:
            value = torch.empty(param.shape, dtype=param.dtype, device=self.device)
        if is_distributed() and self.world_size > 1:
            dist.broadcast(value, src=reader)
        return value

    def fill_(self, param: nn.Parameter, out: torch.Tensor, start: int) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of ``param``'s flattened value, written into ``out`` (collective
        over the replica group: one member reads the range, the others receive it)."""
        if self.replicas is None:
            value = self(param).reshape(-1)
            return out.view(-1).copy_(value[start : start + out.numel()])
        if id(param) in self.slices and self.expert_replicas is not None:
            group, ranks = self.expert_replicas
            reader, self.asked_experts = ranks[self.asked_experts % len(ranks)], self.asked_experts + 1
        else:
            group, ranks = self.replicas
            reader, self.asked = ranks[self.asked % len(ranks)], self.asked + 1
        if out.numel() == 0:  # the whole replica group keeps nothing of this parameter
            return out
        config, name, _, offset = self.source(param)
        if self.rank == reader:
            self.weights.read_range(config, name, out.view(-1), start + offset)
        if group is not None:
            dist.broadcast(out, src=reader, group=group)
        return out

    def close(self) -> None:
        """Release the replica groups (a communicator each on NCCL / XCCL); the initializer is done."""
        for replicas in (self.replicas, self.expert_replicas):
            if replicas is not None and replicas[0] is not None:
                dist.destroy_process_group(replicas[0])
        self.replicas = self.expert_replicas = None


def parameter_initializer(model: nn.Module, seed: int = 0) -> ParameterInitializer | None:
    """The initial full value of any meta parameter of ``model``, drawn on demand from (seed, single-device name):
    exactly what :func:`materialize_and_broadcast` gives it, so a strategy can materialise one shard at a time.

    None when that cannot be done parameter by parameter: a meta parameter outside a Mula model (its module's
    ``reset_parameters`` needs the whole module), or a meta buffer outside a Mula model (a Mula model's are set by
    :func:`init_mula_buffers`); the caller then materialises the whole model as before. A frozen parameter of a Mula
    model is drawn like any other.
    """
    table = _meta_parameter_table(model)
    return None if table is None else ParameterInitializer(table, seed)


def weights_initializer(
    model: nn.Module,
    weights: Any,
    rank: int,
    world_size: int,
    device: torch.device | str = "cpu",
    replica_groups: list[list[int]] | None = None,
    expert_replica_groups: list[list[int]] | None = None,
) -> WeightsInitializer | None:
    """A :class:`WeightsInitializer` for the meta parameters of ``model`` (collective: see there). None in the cases
    :func:`parameter_initializer` names.

    Args:
        replica_groups: a partition of the ranks into the sets that keep the same element ranges of every parameter
            (``ZeroTopoLayout.weight_replica_groups``); every rank creates their process groups, in this order. None:
            whole parameters are read and broadcast to every rank.
        expert_replica_groups: the same partition for the expert slices of an expert-parallel model (the ranks that
            keep the same ranges of the same slice); None: as ``replica_groups``.
    """
    table = _meta_parameter_table(model)
    if table is None:
        return None
    replicas = _replica_group(replica_groups, rank, world_size)
    expert_replicas = _replica_group(expert_replica_groups, rank, world_size)
    return WeightsInitializer(table, weights, rank, world_size, device, replicas, expert_replicas)


def _replica_group(replica_groups: list[list[int]] | None, rank: int, world_size: int) -> tuple[Any, list[int]] | None:
    """(this rank's process group, its ranks) of a partition of the ranks, every group created by every rank."""
    if replica_groups is None:
        return None
    mine = next((list(ranks) for ranks in replica_groups if rank in ranks), None)
    if mine is None or sorted(r for ranks in replica_groups for r in ranks) != list(range(world_size)):
        raise ValueError(f"replica_groups {replica_groups} must partition the {world_size} ranks")
    group = None
    if is_distributed() and any(len(ranks) > 1 for ranks in replica_groups):
        for ranks in replica_groups:  # every rank creates every group, in one order
            created = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                group = created
    return group, mine


def move_real_tensors(model: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of ``model`` that are not on the meta device to ``device`` (values kept);
    meta ones stay for a strategy to materialise shard by shard."""
    model._apply(lambda t: t if t.is_meta else t.to(device))


def _to_empty_meta_only(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta tensors of ``model`` on ``device``; move real ones there with their values.

    ``model.to_empty`` would also replace the *real* tensors of the module tree with uninitialised memory: a
    LightningModule's torchmetrics states (and their reset defaults) or any buffer built outside the meta context.
    """
    for module in model.modules():
        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            module.to_empty(device=device, recurse=False)
    model.to(device)  # everything is real now: this moves the rest, values kept (torchmetrics handles its states)


def expert_full_shape(name: str, local_shape: Any, num_experts: int, etp_size: int) -> tuple[int, ...]:
    """The single-device shape of a fused expert tensor whose local part (experts of one EP rank, ``1/etp_size`` of
    their intermediate dimension) has ``local_shape``."""
    shape = [num_experts, *local_shape[1:]]
    shape[2 if name.endswith("down_proj") else 1] *= etp_size
    return tuple(shape)


def local_part(param: Any, full: torch.Tensor) -> torch.Tensor:
    """The part of the full value ``full`` that this rank holds of the DTensor ``param`` (where DTensor puts it)."""
    shape, offsets = dtensor_local_box(param)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].to(param.dtype)


def _initialise(model: nn.Module, topology: MoETopology, seed: int, weights: Any = None) -> None:
    covered: set[int] = set()
    for _, mula in _mula_models(model):
        config: MulaConfig = mula.config
        for wrapped_name, param in mula.named_parameters():
            name = logical_name(wrapped_name)  # the single-device name, whatever wraps the layers
            covered.add(id(param))
            shape = param.shape
            sliced = is_expert_param(name) and topology.ep_size * topology.etp_size > 1
            rows = slice(topology.ep_rank * shape[0], (topology.ep_rank + 1) * shape[0]) if sliced else None
            if sliced and topology.etp_size > 1:  # this rank's intermediate part of its experts
                full_shape = expert_full_shape(name, shape, config.num_experts, topology.etp_size)
                full = weights.read(config, name, rows) if weights is not None else None
                if full is None:
                    full = init_parameter(name, full_shape, config, seed)[rows]
                param.copy_(expert_part(name, full, topology.etp_rank, topology.etp_size).to(param.dtype))
            elif is_dtensor(param):  # a tensor-parallel slice: this rank's part of the full value
                full = weights.read(config, name) if weights is not None else init_parameter(name, shape, config, seed)
                local_tensor(param).copy_(local_part(param, full))
            elif weights is not None:
                param.copy_(weights.read(config, name, rows))
            elif sliced:  # this rank's experts: a contiguous range of the full tensor, drawn alone
                full_shape = (config.num_experts, *shape[1:])
                fill_initial_(param, name, full_shape, config, seed, start=rows.start * param[0].numel())
            else:
                fill_initial_(param, name, shape, config, seed)  # block by block, straight into the parameter
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and not all(id(p) in covered for p in own) and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    init_mula_buffers(model, weights)


@torch.no_grad()
def init_mula_buffers(model: nn.Module, weights: Any = None, device: torch.device | str | None = None) -> None:
    """Give the buffers of every Mula model in ``model`` their initial values (the routers' selection bias: zero),
    or, with ``weights``, the source's where it holds them (a model trained with the bias); meta buffers are
    allocated on ``device`` (default: CPU). Buffers are small (E floats per MoE
    layer): every rank sets its own."""
    for _, mula in _mula_models(model):
        for wrapped_name, buffer in list(mula.named_buffers()):
            name = logical_name(wrapped_name)
            value = weights.read_buffer(mula.config, name) if weights is not None else None
            if value is None:
                value = init_buffer(name, buffer.shape)
            owner_name, _, leaf = wrapped_name.rpartition(".")
            owner = mula.get_submodule(owner_name)
            if buffer.is_meta:
                owner._buffers[leaf] = value.to(device=device or "cpu", dtype=buffer.dtype)
            else:
                buffer.copy_(value)
