"""A flat-buffer sharded AdamW for DP x EP: ``"ep_aware"`` (EPSO), ``"dp"`` (SO, ZeRO-1) and ``"none"`` (DDP).

Why: with DP x EP, a standard sharded optimizer (SO) splits optimizer states over the DP ranks only, so the
states of the non-expert parameters (replicated on all DP*EP ranks) are stored EP times. EPSO (Aurora paper,
Section 3.2, Figure 6) shards each parameter family over exactly the ranks that replicate it.

Communication plan (W = DP*EP ranks; every family is a :class:`FlatBuffer`; "RS"/"AR"/"AG" = reduce-scatter,
all-reduce, all-gather, bucket by bucket). Gradients are first divided by W (each rank's loss is a mean over
its own tokens; expert gradients already hold their EP group's tokens through the dispatch backward, so every
family is divided by the same W):

=========  ============  ======================  ==================  ==================
mode       family        gradient reduction      states sharded      after the update
=========  ============  ======================  ==================  ==================
none       non-expert    AR over world (W)       no (replicated)     nothing
none       expert        AR over dp (DP)         no (replicated)     nothing
dp         non-expert    RS over dp, AR over ep  over dp (DP)        AG over dp
dp         expert        RS over dp              over dp (DP)        AG over dp
ep_aware   non-expert    RS over world           over world (W)      AG over world
ep_aware   expert        RS over dp              over dp (DP)        AG over dp
=========  ============  ======================  ==================  ==================

On one rank, for every family: backward hooks add each parameter's gradient into the family's gradient
buffer; when every parameter of a bucket is ready (and synchronisation is on: the last micro-batch of a
gradient-accumulation window) the bucket's RS is launched asynchronously, overlapping the rest of backward (a
reduction that holds a copy of its bucket, cast to ``reduce_dtype`` or gloo's receive buffer, is waited for once
more than :data:`COPIES_IN_FLIGHT` are in flight, so the copies never add up to a copy of every gradient).
``step()`` waits for the reductions, runs the cross-group AR of the owned shard where the table says so,
clips by the global norm (each element counted once: a shard replicated R times is counted 1/R each), updates
the owned fp32 shard with AdamW (decoupled weight decay), writes it into the parameters and all-gathers.

Tensor parallelism (``topology.tp_size > 1``, ``ep_aware`` or ``none``): a third family, the weights sharded over
``tp`` (DTensors), is replicated over the ``dense_dp`` group of ``W / tp`` ranks and sharded / reduced over it; the
``tp`` ranks of one group read the same batch, so every family divides by ``dense_dp = W / tp``, the number of
distinct batches. A gradient that is a full copy on each ``tp`` rank (a plain parameter fed the replicated residual
stream, or a replicated DTensor's gradient) is first scaled by ``1/tp``, because the reduction over its replicas
adds the ``tp`` copies; a partial one (sequence parallelism: each ``tp`` rank's norms, routers and experts saw its
part of the sequence, and DTensor leaves the norm weights' gradients ``Partial``) is summed as it is. Sharding over
exactly the ranks that replicate each family keeps EPSO's memory rule under folding.

Bytes per rank (AdamW, P_ne / P_e = non-expert / expert elements of the full model, padding included):
8 bytes of moments per owned element, plus 4 for an fp32 master copy when parameters are not fp32. The gradient
buffer holds every local element in at least float32 (4 bytes each, also for bf16 parameters: twice a bf16 gradient's
2, the price of accumulating micro-batches and receiving the float32 reduction without rounding to bf16; Megatron's
distributed optimizer keeps the same float32 main gradients).
Owned elements: none: P_ne + P_e/EP; dp (SO): P_ne/DP + P_e/(DP*EP); ep_aware (EPSO): P_ne/(DP*EP) +
P_e/(DP*EP); with TP, ep_aware: P_rep/W + P_tp/W + P_e/W (P_rep replicated, P_tp tensor-parallel elements): every
element of the model is owned by exactly one rank.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from mula_lightning.moe.balance_scope import enable_global_batch_balance, install_balance_window_reset
from mula_lightning.moe.balancing import install_expert_bias_update
from mula_lightning.optim.adamw import adamw_update_pieces_
from mula_lightning.parallel.collectives import (
    all_gather_reads_own_chunk,
    all_gather_single,
    gather_from_owners,
    reduce_scatter_single,
    reduce_to_owners,
)
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.ledger import is_recording, record_collective, ring_bytes_sent
from mula_lightning.parallel.params import is_dtensor, is_expert_param, is_tensor_parallel, logical_name
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.precision import at_least_float32

MODES = ("ep_aware", "dp", "none")
#: reductions of bucket copies in flight at once (a cast copy when ``reduce_dtype`` is not the buffers' dtype, gloo's
#: receive buffer): a launched collective holds its input until it is waited for, so launching every bucket's copy
#: before the step waits would keep a copy of every gradient (the model's gradients in bf16: 14 GB for a 7B model)
COPIES_IN_FLIGHT = 2


@dataclass
class FamilyPlan:
    """Process groups of one parameter family (``None`` means a group of one: nothing to send)."""

    name: str
    shard_group: Any
    shard_size: int
    shard_rank: int
    cross_group: Any
    cross_size: int
    cross_rank: int = 0  # index among the ranks holding the same shard (0 writes it to checkpoints)


class ZerosOnFirstUse(MutableMapping):
    """An optimizer shard's state vectors, the lazy ones allocated as zeros when first read.

    torch's AdamW allocates its moments at the first step; allocating them when the optimizer is built would make
    setup hold 2 / (sharding degree) of the model more than it needs (measured by ``benchmarks/memory.py``). Every key
    is listed (``in``, iteration) before it exists, so checkpoints and loads see the same layout at any time.
    """

    def __init__(
        self, lazy: Iterable[str], numel: int, dtype: torch.dtype, device: torch.device, eager: dict[str, torch.Tensor]
    ) -> None:
        self._lazy = [k for k in lazy if k not in eager]
        self._spec = (numel, dtype, device)
        self._data: dict[str, torch.Tensor] = dict(eager)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._data:
            if key not in self._lazy:
                raise KeyError(key)
            numel, dtype, device = self._spec
            self._data[key] = torch.zeros(numel, dtype=dtype, device=device)
        return self._data[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        self._data.pop(key, None)
        self._lazy = [k for k in self._lazy if k != key]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._lazy, *self._data]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._lazy, *self._data]))

    def nbytes(self) -> int:
        """Bytes of every vector, allocated or not."""
        numel, dtype, _ = self._spec
        lazy = sum(numel * dtype.itemsize for k in self._lazy if k not in self._data)
        return lazy + sum(t.numel() * t.element_size() for t in self._data.values())

    def allocated(self) -> list[str]:
        """The keys whose vectors exist now."""
        return list(self._data)


def family_plans(mode: str, topo: MoETopology) -> dict[str, FamilyPlan]:
    """The groups of the table in the module docstring for ``mode`` on ``topo``.

    Raises:
        ValueError: for an unknown mode, or ``"dp"`` with tensor parallelism (its DP-only sharding is the paper's
            baseline of DP x EP; under folding ``"ep_aware"`` shards every family over exactly its replicas).
    """
    if mode not in MODES:
        raise ValueError(f"sharded_optimizer mode {mode!r} must be one of {MODES}")
    if mode == "dp" and topo.tp_size > 1:
        raise ValueError(
            f"sharded_optimizer='dp' with tp_size ({topo.tp_size}) > 1 is not supported: it is the DP-only baseline "
            "of DP x EP; use 'ep_aware' (each family sharded over exactly its replicas) or 'none'"
        )
    # under pipeline parallelism every family lives in one stage: the non-expert one is replicated over its ranks
    w, dp, ep = topo.stage_size, topo.dp_size, topo.ep_size
    stage, dpg, epg = topo.stage_group, topo.dp_group, topo.ep_group
    ddp, ddpg = topo.dense_dp_size, topo.dense_dp_group
    if mode == "none":
        return {
            "non_expert": FamilyPlan("non_expert", None, 1, 0, stage if w > 1 else None, w, topo.stage_rank),
            "tensor_parallel": FamilyPlan(
                "tensor_parallel", None, 1, 0, ddpg if ddp > 1 else None, ddp, topo.dense_dp_rank
            ),
            "expert": FamilyPlan("expert", None, 1, 0, dpg if dp > 1 else None, dp, topo.dp_rank),
        }
    expert = FamilyPlan("expert", dpg if dp > 1 else None, dp, topo.dp_rank, None, 1)
    tensor_parallel = FamilyPlan("tensor_parallel", ddpg if ddp > 1 else None, ddp, topo.dense_dp_rank, None, 1)
    if mode == "dp":
        non_expert = FamilyPlan(
            "non_expert", dpg if dp > 1 else None, dp, topo.dp_rank, epg if ep > 1 else None, ep, topo.ep_rank
        )
    else:
        non_expert = FamilyPlan("non_expert", stage if w > 1 else None, w, topo.stage_rank, None, 1)
    return {"non_expert": non_expert, "tensor_parallel": tensor_parallel, "expert": expert}


def family_of(name: str, param: Any) -> str:
    """The family of a parameter: ``"expert"``, ``"tensor_parallel"`` (sharded over tp) or ``"non_expert"``."""
    if is_expert_param(name):
        return "expert"
    return "tensor_parallel" if is_tensor_parallel(param) else "non_expert"


def local_gradient(param: Any, tp_size: int, sequence_parallel: bool) -> tuple[torch.Tensor, float]:
    """This rank's gradient of ``param`` as its flat buffer adds it, and the factor to add it with.

    A shard's gradient is its own (factor 1); a partial sum over ``tp`` (DTensor's ``Partial``, or a plain
    parameter under sequence parallelism, which saw this rank's part of the sequence) is summed by the family's
    reduction as it is; a full copy on every ``tp`` rank (a replicated gradient, or a plain parameter fed the
    replicated residual stream) is scaled by ``1/tp`` so the reduction's sum of the copies counts it once. Any other
    placement is redistributed to the parameter's own first (a collective every rank runs in the same hook).
    """
    grad = param.grad
    if not is_dtensor(grad):
        return grad, (1.0 if sequence_parallel or tp_size == 1 else 1.0 / tp_size)
    if any(p.is_partial() for p in grad.placements) and not is_tensor_parallel(param):
        return grad.to_local(), 1.0
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(grad.device_mesh, param.placements)
    replicated = all(p.is_replicate() for p in grad.placements)
    return grad.to_local(), (1.0 / grad.device_mesh.size() if replicated else 1.0)


def on_the_optimizer_itself(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an optimizer method on the optimizer inside Lightning's and Fabric's wrappers, not on the wrapper.

    Why: ``fabric.setup_optimizers`` and the Trainer wrap the optimizer in an object whose class subclasses the
    optimizer's (for ``isinstance``), so a method the wrapper does not override (``zero_grad``, ``clip_grad_norm_``)
    runs with the *wrapper* as ``self``: the containers it mutates are the optimizer's (read through the wrapper's
    attribute lookup), but a flag it assigns (``self._synced = False``) lands on the wrapper, and the optimizer's own
    stays stale. A Fabric loop's ``optimizer.zero_grad()`` after a norm query left the sync marked done: the next
    backward's gradients were added to the dropped ones (``epso``) or never reduced (``zero_topo``).
    """

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(unwrap_optimizer(self), *args, **kwargs)

    return run


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over flat, sharded buffers; the communication plan is in the module docstring.

    Args:
        model: the (expert-parallel) module whose parameters are trained.
        topology: the DP x EP layout.
        mode: ``"ep_aware"``, ``"dp"`` or ``"none"``.
        param_groups: optional list of ``{"params": [names or parameters], **hyperparameters}``; defaults to one
            group with all trainable parameters.
        lr, betas, eps, weight_decay: AdamW defaults (the Aurora paper's recipe).
        reduce_dtype: dtype gradients travel in (``torch.float32`` or ``torch.bfloat16`` as in the paper).
            float64 parameters (exact parity checks) keep float64 throughout: gradients travel, and moments and
            updates are computed, in float64.
        bucket_numel: elements per communication bucket (``None``: one bucket per family).
    """

    def __init__(
        self,
        model: nn.Module,
        topology: MoETopology,
        mode: str = "ep_aware",
        param_groups: list[dict[str, Any]] | None = None,
        lr: float = 4e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int | None = 40_000_000,
    ) -> None:
        names = {id(p): logical_name(n) for n, p in model.named_parameters()}
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups = []
        for g in param_groups:
            by_name = {logical_name(n): p for n, p in model.named_parameters()}
            params = [by_name[logical_name(p)] if isinstance(p, str) else p for p in g["params"]]
            unknown = [p for p in params if id(p) not in names]
            if unknown:
                raise ValueError(f"{len(unknown)} optimizer parameter(s) do not belong to the model")
            groups.append({**g, "params": params})
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(groups, defaults)
        self.topology = topology
        self.mode = mode
        self.reduce_dtype = reduce_dtype
        self.world_size = topology.world_size
        self.grad_divisor = topology.batches  # distinct batches per step (W without tensor or context parallelism)
        self.plans = self._family_plans(mode, topology)
        self.require_grad_sync = True
        #: ``zero_grad`` does nothing while set: a Trainer step whose training_step already ran the backward (a
        #: pipeline schedule) must keep its gradients through Lightning's zero_grad before the (empty) backward
        self.keep_grads = False
        self._step = 0
        self._synced = False  # reductions of this step finished (clip_grad_norm_ may run them before step)
        self._grad_norm: torch.Tensor | None = None  # of the reduced gradients, until they change (see owned_grad_norm)

        # every rank lists its families in one order (the order of their collectives)
        by_family: dict[str, list[tuple[str, nn.Parameter, int]]] = {fam: [] for fam in self.plans}
        for gi, group in enumerate(self.param_groups):
            for p in reversed(group["params"]):  # backward produces gradients roughly in reverse order
                name = names[id(p)]
                by_family[self._family_of(name, p, group)].append((name, p, gi))
        self.buffers: dict[str, FlatBuffer] = {}
        for fam, items in by_family.items():
            if items:
                plan = self.plans[fam]
                # gradients accumulate in at least float32 (Megatron's main grad): bf16 buffers would round every
                # micro-batch's sum and the float32-reduced shard again before the float32 master update
                grad_dtype = at_least_float32(items[0][1].dtype)
                cuts = self._cuts(fam, items, plan)
                self.buffers[fam] = FlatBuffer(
                    items, plan.shard_size, plan.shard_rank, bucket_numel, grad_dtype, cuts=cuts
                )
        self.master_dtype = torch.float32  # of half-precision parameters; float32 / float64 ones are their own master
        self._init_state()
        self._pending: dict[tuple[str, int], Any] = {}
        self._copies: deque[tuple[str, int]] = deque()  # buckets whose cast copy a launched reduction holds
        self._ready: dict[tuple[str, int], set[int]] = {}  # per bucket, its parameters with a gradient this round
        #: per bucket, the owned result of reductions already finished this step (several synchronised backwards)
        self._banked: dict[tuple[str, int], torch.Tensor] = {}
        self._written: set[int] = set()  # parameters whose buffer slot holds a gradient since the last zero_grad
        self._bucket_of = {
            id(s.param): (fam, s.bucket, s.start, s.end) for fam, buf in self.buffers.items() for s in buf.slots
        }
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for buf in self.buffers.values() for p in _params(buf)
        ]
        # auxiliary-loss-free balancing: the routers' loads summed over the stage (the ranks routing through them);
        # a stage of one rank (pure pipeline parallelism) has no group and nothing to sum, not the world's loads
        install_expert_bias_update(self, model, topology.stage_group, reduce=topology.stage_size > 1)
        # global-batch balancing: the routers count over the stage's distinct batches, afresh after each step
        enable_global_batch_balance(model, topology.dense_dp_group if topology.dense_dp_size > 1 else None)
        install_balance_window_reset(self, model)

    #: the single-device optimizer :meth:`from_optimizer` takes over, and the param-group keys it keeps
    SINGLE_DEVICE: type[torch.optim.Optimizer] = torch.optim.AdamW
    GROUP_KEYS: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay", "initial_lr")

    def _family_plans(self, mode: str, topology: MoETopology) -> dict[str, FamilyPlan]:
        """The families and their groups, in the order every rank runs their collectives."""
        return family_plans(mode, topology)

    def _family_of(self, name: str, param: Any, group: dict[str, Any]) -> str:
        """The family a parameter of ``group`` is laid out, reduced and updated in."""
        return family_of(name, param)

    def _cuts(self, fam: str, items: list[tuple[str, nn.Parameter, int]], plan: FamilyPlan) -> list[int] | None:
        """Where each shard of a family begins in its buffer (``shard_size + 1`` offsets; shards cut at chosen
        places, e.g. matrix boundaries), or None: equal, padded shards of every bucket."""
        return None

    def _state_keys(self, fam: str) -> tuple[str, ...]:
        """The per-element optimizer states of a family (besides a float32 master of half-precision weights)."""
        return ("exp_avg", "exp_avg_sq")

    @classmethod
    def from_optimizer(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: MoETopology,
        names_by_id: dict[int, str] | None = None,
        **kwargs: Any,
    ) -> ShardedAdamW:
        """Take over a user's ``torch.optim.AdamW``: same param groups and hyper-parameters, sharded states.

        Args:
            names_by_id: ``id(parameter) -> name`` recorded before the model was materialised; moving a model off
                the meta device replaces its parameter objects, so an optimizer built on the meta model is mapped
                to the new parameters by name.

        Raises:
            TypeError: for optimizers other than AdamW (the sharded update implements AdamW only).
        """
        if isinstance(optimizer, cls):
            return optimizer
        if type(optimizer) is not cls.SINGLE_DEVICE:
            raise TypeError(
                f"the sharded optimizer implements {cls.SINGLE_DEVICE.__name__}; got {type(optimizer).__name__}. "
                "Return torch.optim.AdamW or mula_lightning.optim.MuonAdamW from configure_optimizers (its param "
                "groups and hyper-parameters are kept)"
            )
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("amsgrad=True is not supported by the sharded AdamW")
        current = {logical_name(n): p for n, p in model.named_parameters()}
        live = {id(p) for p in current.values()}
        names_by_id = {k: logical_name(v) for k, v in (names_by_id or {}).items()}
        keep = cls.GROUP_KEYS
        groups = []
        for g in optimizer.param_groups:
            params = []
            for p in g["params"]:
                if id(p) in live or id(p) not in names_by_id:  # a parameter of the model stays itself (an id of a
                    params.append(p)  # freed meta parameter may have been reused); a stranger is refused below
                elif names_by_id[id(p)] in current:
                    params.append(current[names_by_id[id(p)]])
                # else: a layer another pipeline stage holds, pruned from this rank's model: not this rank's to train
            groups.append({"params": params, **{k: v for k, v in g.items() if k in keep}})
        sharded = cls(model, topology, param_groups=groups, **kwargs)
        take_over(sharded, optimizer)
        return sharded

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self.shards: dict[str, dict[str, torch.Tensor]] = {}
        for fam, buf in self.buffers.items():
            state_dtype = at_least_float32(buf.dtype)
            master = None
            if buf.dtype != state_dtype:  # written range by range: no concatenated copy of the owned elements
                master = torch.empty(buf.owned_numel, dtype=state_dtype, device=buf.device)
                buf.gather_owned_into(buf.params, master)
            moments = self._state_keys(fam)
            eager = {"master": master} if master is not None else {}
            self.shards[fam] = ZerosOnFirstUse(moments, buf.owned_numel, state_dtype, buf.device, eager)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds once stepped (moments and fp32 master, padding included)."""
        return sum(s.nbytes() for s in self.shards.values())

    # ------------------------------------------------------------- gradients
    def _on_grad(self, param: nn.Parameter) -> None:
        fam, bucket, start, end = self._bucket_of[id(param)]
        key = (fam, bucket)
        if self._synced:  # a backward after clip_grad_norm_ / finish_grad_sync and before step: reduce it as well
            self._reopen_after_sync()
        if key in self._pending:  # a further backward after this bucket's reduction started (see _bank_reduction)
            self._bank_reduction(fam, bucket)
        buf = self.buffers[fam]
        self._grad_norm = None  # a new gradient: a norm taken before no longer holds
        grad, factor = local_gradient(param, self.topology.tp_size, self.topology.sequence_parallel)
        factor /= self.grad_divisor  # the mean over the distinct batches, in the pass that moves the gradient anyway
        slot, flat = buf.grads[start:end], grad.reshape(-1)
        if id(param) in self._written:  # a later micro-batch (or a pipeline schedule's): accumulate
            slot.add_(flat, alpha=factor)
        else:  # the step's first gradient of this parameter overwrites what the slot held (zero_grad wrote nothing)
            if factor == 1:
                slot.copy_(flat)
            elif flat.dtype == slot.dtype:
                torch.mul(flat, factor, out=slot)
            else:  # a half-precision gradient into the float32 buffer: scaled in float32, not rounded first
                slot.copy_(flat).mul_(factor)
            self._written.add(id(param))
        param.grad = None
        if not self.require_grad_sync:  # inside a gradient-accumulation window: accumulate only
            return
        ready = self._ready.setdefault(key, set())
        ready.add(id(param))  # distinct parameters: one that gets two gradients before the launch counts once
        if len(ready) == len(buf.buckets[bucket].slots):
            self._launch(fam, bucket)

    def _bank_reduction(self, fam: str, bucket_index: int) -> None:
        """Finish the bucket's reduction in flight and keep its owned result aside, so a further backward can
        accumulate into the bucket and reduce again.

        Why: DDP and FSDP allow several backwards per step with synchronisation on (Fabric's ``no_backward_sync`` is
        an optional speed-up; so are manual optimisation's repeated ``manual_backward`` calls): each backward's
        gradients are reduced and the reduced gradients add up. Here the first backward launched the bucket's
        reduce-scatter from the flat buffer; writing the next gradients into that buffer while it is being read, and
        counting them towards a launch that already happened, would drop every backward after the first. The banked
        owned range (one shard-sized tensor per bucket, held only in this case) is added to the final reduction in
        :meth:`finish_grad_sync`: sum of the reductions = reduction of the sum. A family whose states are not sharded
        keeps its result in the bucket itself instead (:meth:`_keep_in_bucket`): nothing is banked.
        """
        key = (fam, bucket_index)
        buf = self.buffers[fam]
        b = buf.buckets[bucket_index]
        owned = self._complete_reduction(fam, b)
        if self.plans[fam].shard_size == 1:
            self._keep_in_bucket(fam, b, owned)
            self._ready.pop(key, None)
            return
        banked = self._banked.get(key)
        if banked is None:
            self._banked[key] = owned.to(buf.grads.dtype, copy=True)  # owned may view the buffer itself
        else:
            banked.add_(owned)
        for s in b.slots:  # the next gradients overwrite their slots; untouched slots are zeroed at the next launch
            self._written.discard(id(s.param))
        self._ready.pop(key, None)

    def _keep_in_bucket(self, fam: str, b: Any, reduced: torch.Tensor) -> None:
        """Keep a replicated bucket's reduced gradients in the bucket itself while a further backward accumulates into
        it (mode ``none``, or experts at dp = 1): scaled by ``1 / cross_size``, so the next all-reduce, which sums the
        ranks' equal copies, gives them back whole (exact for power-of-two groups, one rounding otherwise); a family
        that never communicates (a group of one) keeps them as they are. No copy of the gradients, where banking
        held a second one of every element (DDP holds none)."""
        plan = self.plans[fam]
        view = self.buffers[fam].grads[b.start : b.start + b.numel]
        if reduced.data_ptr() != view.data_ptr() or reduced.dtype != view.dtype:  # a cast copy was reduced
            view.copy_(reduced)
        if plan.cross_size > 1 and plan.cross_group is not None:
            view.div_(plan.cross_size)
        # the slots keep their values: the next gradients add to them (_written stays), as micro-batches do

    def _reopen_after_sync(self) -> None:
        """A gradient arrives after the reductions finished (clip_grad_norm_, global_grad_norm): bank every sharded
        bucket's reduced owned range (clipped, if clipping ran), keep a replicated one in place
        (:meth:`_keep_in_bucket`), and start a new round of reductions, as DDP would reduce and add the new
        gradients."""
        self._synced = False
        for fam, buf in self.buffers.items():
            for b in buf.buckets:
                if self.plans[fam].shard_size == 1:
                    self._keep_in_bucket(fam, b, buf.grads[b.start : b.start + b.numel])
                    continue
                lo, hi = b.shard_range(self.plans[fam].shard_rank)
                self._banked[(fam, b.index)] = buf.grads[lo:hi].clone()  # holds any earlier banked result already
                for s in b.slots:  # the next gradients overwrite these slots
                    self._written.discard(id(s.param))
        self._ready.clear()

    def _launch(self, fam: str, bucket_index: int) -> None:
        """Start the bucket's reduce-scatter (or all-reduce when states are replicated); its slots hold gradients
        already scaled by 1/dense_dp (1/W without TP) in :meth:`_on_grad`."""
        if (fam, bucket_index) in self._pending:
            return
        buf, plan = self.buffers[fam], self.plans[fam]
        b = buf.buckets[bucket_index]
        for s in b.slots:  # parameters without a gradient this step (unused): their slots hold an earlier step's
            if id(s.param) not in self._written:
                buf.grads[s.start : s.end].zero_()
        view = buf.grads[b.start : b.start + b.numel]
        reduce_dtype = torch.float64 if view.dtype == torch.float64 else self.reduce_dtype
        send = view if view.dtype == reduce_dtype else view.to(reduce_dtype)
        work, out = None, None
        if plan.shard_size > 1 and b.bounds is not None:  # an owner-aligned bucket: uneven shards
            work, out = reduce_to_owners(send, b.shard_sizes(), plan.shard_group)
            _record("reduce_scatter", plan.shard_group, plan.shard_size, send, out, fam)
        elif plan.shard_size > 1:
            out = torch.empty(b.shard_numel, dtype=reduce_dtype, device=view.device)
            work = reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=plan.shard_group, async_op=True)
            _record("reduce_scatter", plan.shard_group, plan.shard_size, send, out, fam)
        elif plan.cross_size > 1 and plan.cross_group is not None:
            work = dist.all_reduce(send, group=plan.cross_group, async_op=True)
            _record("all_reduce", plan.cross_group, plan.cross_size, send, send, fam)
            out = send
        self._pending[(fam, bucket_index)] = (work, out)
        copied = send is not view or getattr(work, "holds_input_copy", False)
        if copied and work is not None:  # bound the bucket copies alive (COPIES_IN_FLIGHT)
            self._copies.append((fam, bucket_index))
            while len(self._copies) > COPIES_IN_FLIGHT:
                self._settle(*self._copies.popleft())

    def _settle(self, fam: str, bucket_index: int) -> None:
        """Wait for a launched reduction of a bucket copy so the copy can be freed: a reduce-scatter's owned result
        stays (shard-sized); a replicated bucket's all-reduced copy is written back into the float32 buffer."""
        key = (fam, bucket_index)
        if key not in self._pending:  # completed already (finish_grad_sync, a banked reduction)
            return
        work, out = self._pending[key]
        if work is not None:
            work.wait()
        if self.plans[fam].shard_size == 1 and out is not None:
            b = self.buffers[fam].buckets[bucket_index]
            self.buffers[fam].grads[b.start : b.start + b.numel].copy_(out)
            out = None
        self._pending[key] = (None, out)

    @on_the_optimizer_itself
    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction so each rank holds its owned, fully reduced gradient shard."""
        if self._synced:
            return
        self._synced = True
        self._grad_norm = None
        for fam, buf in self.buffers.items():
            plan = self.plans[fam]
            for b in buf.buckets:
                self._launch(fam, b.index)  # buckets whose parameters got no gradient (unused this step)
                owned = self._complete_reduction(fam, b)
                lo, hi = b.shard_range(plan.shard_rank)
                target = buf.grads[lo:hi]
                if owned.data_ptr() != target.data_ptr() or owned.dtype != target.dtype:
                    target.copy_(owned)
                banked = self._banked.pop((fam, b.index), None)  # earlier backwards' reductions (_bank_reduction)
                if banked is not None:
                    target.add_(banked)
        self._ready.clear()
        self._copies.clear()

    def _complete_reduction(self, fam: str, b: Any) -> torch.Tensor:
        """Wait for the bucket's launched reduction (and run the cross-group all-reduce where the plan has one);
        return this rank's owned range of the result (it may be a view of the gradient buffer itself)."""
        plan = self.plans[fam]
        work, out = self._pending.pop((fam, b.index))
        if work is not None:
            work.wait()
        if plan.shard_size > 1:
            if plan.cross_size > 1 and plan.cross_group is not None:
                dist.all_reduce(out, group=plan.cross_group)
                _record("all_reduce", plan.cross_group, plan.cross_size, out, out, fam)
            return out
        if out is not None:  # replicated states: the whole bucket, all-reduced (perhaps in the reduce dtype)
            return out
        lo, hi = b.shard_range(plan.shard_rank)
        return self.buffers[fam].grads[lo:hi]

    def owned_gradient_segments(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's reduced gradient pieces as (logical name, offset in the full flattened parameter, values).

        For checking and debugging: together, the ranks' segments cover every element of the unsharded model
        (replicated shards appear once per replica). Call after :meth:`finish_grad_sync`.

        Raises:
            ValueError: under tensor parallelism, where a local shard is not one flat range of its parameter.
        """
        if self.topology.tp_size > 1:
            raise ValueError("owned_gradient_segments has no flat offsets under tensor parallelism (tp_size > 1)")
        out = []
        ep_rank, ep_size = self.topology.ep_rank, self.topology.ep_size
        for buf in self.buffers.values():
            for seg in buf.segments:
                base = seg.slot.numel * ep_rank if is_expert_param(seg.slot.name) and ep_size > 1 else 0
                values = buf.grads[seg.buffer_start : seg.buffer_end].detach().clone()
                out.append((seg.slot.name, base + seg.param_start, values))
        return out

    @on_the_optimizer_itself
    def owned_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, every element of the model counted exactly once.

        Squares are summed over the owned elements where they live, a bounded chunk at a time (no concatenated copy,
        no shard-sized temporary). The norm is kept until the gradients change (a backward, clipping, ``zero_grad``):
        logging it and clipping by it in one step cost one all-reduce, not two.
        """
        if self._grad_norm is not None:
            return self._grad_norm
        dtype = at_least_float32(next(iter(self.buffers.values())).grads.dtype)
        total = torch.zeros((), dtype=dtype, device=next(iter(self.buffers.values())).device)
        for fam, buf in self.buffers.items():
            family = torch.zeros((), dtype=dtype, device=total.device)
            for lo, hi in buf.owned_ranges():
                family += _sum_of_squares(buf.grads[lo:hi], dtype)
            total += family / self.plans[fam].cross_size
        if self.world_size > 1:  # every stage's elements (pipeline parallelism: each stage holds other layers)
            dist.all_reduce(total, group=self.topology.world_group)
        self._grad_norm = total.sqrt()
        return self._grad_norm

    # ------------------------------------------------------------------ step
    @on_the_optimizer_itself
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the reduced gradients so their global L2 norm is at most ``max_norm``; return the norm before.

        Runs the gradient reductions first (``step`` will not repeat them), like ``torch.nn.utils.clip_grad_norm_``
        with the global norm of the unsharded model.
        """
        self.finish_grad_sync()
        norm = self.owned_grad_norm()
        scale = clip_coefficient(norm, max_norm)
        for buf in self.buffers.values():
            for lo, hi in buf.owned_ranges():
                buf.grads[lo:hi].mul_(scale)
        self._grad_norm = None  # the gradients changed
        return norm

    @on_the_optimizer_itself
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Finish reductions (unless clipping already did), update the owned shards with AdamW, all-gather."""
        loss = closure() if closure is not None else None
        with record_function("mula::gradient_sync"):  # waits for the reduce-scatters (named in profiles)
            self.finish_grad_sync()
        self._step += 1
        mark_stepped(self)
        gathers: list[Any] = []
        for fam, buf in self.buffers.items():
            with record_function("mula::adamw_update"):
                self._update(fam, buf)
            with record_function("mula::weight_all_gather"):
                gathers += self._all_gather(fam, buf)  # in flight while the next family updates
        with record_function("mula::weight_all_gather"):
            for work, _ in gathers:
                work.wait()
        self.zero_grad()
        return loss

    def _update(self, fam: str, buf: FlatBuffer) -> None:
        """The owned shard's update of a family (AdamW here)."""
        self._adamw_update(fam, buf)

    def _adamw_update(self, fam: str, buf: FlatBuffer) -> None:
        """The owned shard's AdamW step in place, run by run (:meth:`FlatBuffer.owned_places`): the buffers' own
        elements, no concatenated copy of the owned gradients and weights and no copy back."""
        state = self.shards[fam]
        master, exp_avg, exp_avg_sq = state.get("master"), state["exp_avg"], state["exp_avg_sq"]
        places = buf.owned_places()
        pieces = []
        for lo, hi, at, group in places:
            grads = buf.grads[at : at + hi - lo]
            grads = grads if grads.dtype == exp_avg.dtype else grads.to(exp_avg.dtype)
            params = master[lo:hi] if master is not None else buf.params[at : at + hi - lo]
            pieces.append((params, grads, exp_avg[lo:hi], exp_avg_sq[lo:hi], group))
        adamw_update_pieces_(pieces, self.param_groups, self._step)
        if master is not None:  # the half-precision weights from their float32 master
            for lo, hi, at, _ in places:
                buf.params[at : at + hi - lo].copy_(master[lo:hi])

    @torch.no_grad()
    @on_the_optimizer_itself
    def write_master_weights(self) -> None:
        """Write every float32 master shard into its (half-precision) parameters and all-gather them, waiting for
        each gather: after an optimizer-state load, the model holds the loaded weights when this returns."""
        gathers: list[Any] = []
        for fam, buf in self.buffers.items():
            if "master" in self.shards[fam]:
                buf.scatter_owned(buf.params, self.shards[fam]["master"].to(buf.dtype))
                gathers += self._all_gather(fam, buf)
        for work, _ in gathers:
            work.wait()

    def _all_gather(self, fam: str, buf: FlatBuffer) -> list[tuple[Any, torch.Tensor]]:
        """Start every bucket's weight all-gather; returns (work, its input) to wait for (the caller's)."""
        plan = self.plans[fam]
        if plan.shard_size == 1:
            return []
        works = []
        # where the backend allows it, the input is the rank's own chunk of the output (Megatron's distributed
        # optimizer gathers its parameter buffer so): no copy, and no owned-shard-sized clones held until the wait
        in_place = all_gather_reads_own_chunk(plan.shard_group, buf.params.device)
        for b in buf.buckets:
            lo, hi = b.shard_range(plan.shard_rank)
            full = buf.params[b.start : b.start + b.numel]
            if b.bounds is not None:  # an owner-aligned bucket: each owner's whole matrices from it
                works.append((gather_from_owners(full, b.shard_sizes(), plan.shard_group), None))
                _record("all_gather", plan.shard_group, plan.shard_size, buf.params[lo:hi], full, fam)
                continue
            shard = buf.params[lo:hi] if in_place else buf.params[lo:hi].clone()  # a copy is held until the wait
            works.append((all_gather_single(full, shard, group=plan.shard_group, async_op=True), shard))
            _record("all_gather", plan.shard_group, plan.shard_size, shard, full, fam)
        return works

    @on_the_optimizer_itself
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.keep_grads:
            return
        # the buffers are not zeroed (a pass over every gradient element, 3 % of a CPU step): a parameter's first
        # gradient of the next step overwrites its slot, and a bucket zeroes the slots no gradient reached before
        # its reduction (see _on_grad and _launch)
        self._written.clear()
        for buf in self.buffers.values():
            for p in _params(buf):
                p.grad = None
        # a skipped step (zero_grad without step after a synchronised backward): the reductions in flight still
        # read and write the gradient buffers the next backward writes, so they finish first
        for work, _ in self._pending.values():
            if work is not None:
                work.wait()
        self._ready.clear()
        self._pending.clear()
        self._copies.clear()
        self._banked.clear()
        self._synced = False
        self._grad_norm = None


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` as a tensor on the norm's device, as ``torch.nn.utils.clip_grad_norm_``
    computes it: the gradients are multiplied by it whether or not they are clipped (by exactly 1.0 when not), so
    clipping costs no host synchronisation (a ``.item()`` per step would stall an accelerator's queue)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _sum_of_squares(x: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 22) -> torch.Tensor:
    """``sum(x**2)`` in ``dtype``, ``chunk`` elements at a time (the temporaries stay small whatever ``x``'s size)."""
    total = torch.zeros((), dtype=dtype, device=x.device)
    for lo in range(0, x.numel(), chunk):
        total += x[lo : lo + chunk].to(dtype).pow(2).sum()
    return total


def _record(op: str, group: Any, size: int, tensor_in: torch.Tensor, tensor_out: torch.Tensor, fam: str) -> None:
    """Add one collective of the optimizer to the communication ledger (free when nothing records)."""
    if is_recording():
        sent = ring_bytes_sent(op, size, tensor_in.numel() * tensor_in.element_size())
        record_collective(op, group, tensor_in, tensor_out, sent, tag=f"optimizer.{fam}")


def _params(buf: FlatBuffer) -> Iterable[nn.Parameter]:
    return (s.param for s in buf.slots)


def take_over(optimizer: torch.optim.Optimizer, user_optimizer: Any) -> None:
    """Let the user's optimizer, replaced by the sharded ``optimizer``, keep driving it.

    Why: an LR scheduler (or a loop that sets ``group["lr"]``) built on the user's optimizer before the strategy
    replaced it (Fabric's two-call set-up: ``setup_module``, a scheduler, then ``setup_optimizers``) writes into that
    optimizer's param groups, which the sharded one never read: the scheduler drove nothing. The user's optimizer
    now holds the sharded optimizer's param-group list itself, and each sharded ``step`` marks it stepped (torch's
    schedulers warn "lr_scheduler.step() before optimizer.step()" otherwise), as with DDP and FSDP, which keep the
    user's optimizer object.
    """
    user_optimizer = unwrap_optimizer(user_optimizer)
    if user_optimizer is None or user_optimizer is optimizer:
        return
    user_optimizer.param_groups = optimizer.param_groups
    optimizer._taken_over = weakref.ref(user_optimizer)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record a step on the optimizer ``optimizer`` took over (see :func:`take_over`), as torch's schedulers
    track it."""
    ref = getattr(optimizer, "_taken_over", None)
    user_optimizer = ref() if ref is not None else None
    if user_optimizer is not None:
        user_optimizer._opt_called = True


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's / Fabric's wrappers."""
    while hasattr(optimizer, "_optimizer"):
        optimizer = optimizer._optimizer
    return optimizer
