"""Hierarchical 3-level ZeRO (ZeRO-topo paper, Section V) with optional block-quantized collectives.

The model is cut into *units*: every decoder layer (``layers.<i>``) and a root unit with the remaining parameters
(embeddings, final norm, head), hooked on the deepest module that holds them all. Each unit's parameters live in
one :class:`FlatBuffer` (padded so every chunk is a whole number of quantization blocks); the sizes ``w``, ``s``,
``g``, ``o`` and the nested chunk of every rank come from
:class:`~mula_lightning.parallel.zero.layout.ZeroTopoLayout` (``N`` = padded elements of a unit).

Communication plan of one step, per unit (``q`` = quantized when enabled; tags as in the ledger):

1. forward pre-hook: all-gather the ``N / w`` primary chunks over the weight group (``weights.forward``, q: INT8)
   into the full buffer, then start the gather of the next unit (prefetch); compute with the (dequantized) full
   weights; keep this rank's secondary chunk (``N / s``; cut from what was gathered, no extra traffic); forward
   hook: free the full buffer.
2. backward pre-hook (first gradient of the unit's outputs): all-gather the secondary chunks over the secondary
   group (``weights.backward``, q: INT8), prefetch the previous unit.
3. when every parameter of the unit has its gradient: reduce-scatter the fp32 gradient inside the gradient group
   (``grads.reduce_scatter``; q: INT4 all-to-all, fp32 sum in source order) and add into the ``N / g`` gradient
   shard; free the full weights and gradients. Micro-batches accumulate here.
4. ``step()``: all-reduce the gradient shard over the ranks holding it on the other nodes (unquantized,
   ``grads.all_reduce``), divide by the world size once, clip by the global norm, AdamW on the ``N / o`` optimizer
   chunk (inside the gradient chunk) with :func:`adamw_update_`, write it into the primary chunk and all-gather the
   primary chunk from the ``o / w`` optimizer chunks that tile it (``weights.post_step``, unquantized).

Memory per rank and unit (persistent; the full buffer of a unit exists only between its gathers and frees):
primary ``N / w`` x param bytes; secondary ``N / s`` x (1 + 4 / block) bytes quantized, ``N / s`` x param bytes when
``s != w`` unquantized, nothing when ``s == w`` unquantized (the primary is gathered again); gradients ``N / g`` x 4;
optimizer ``N / o`` x 8 (AdamW moments) plus 4 for an fp32 master when parameters are not fp32 (with fp32
parameters the primary chunk is the master). Quantized values never overwrite a master or a primary chunk.
float64 parameters (parity checks) keep gradients, moments and sums in float64 (8 bytes where 4 are written above).

Expert parallelism (``ep_size > 1``): the model's experts are cut to this rank's slice beforehand and a token
dispatcher moves tokens inside each EP group of ``ep_size`` consecutive ranks; a decoder layer's expert tensors form a
unit of their own (after the layer's dense unit), sharded by the same plan over their ``world / ep_size`` edp replicas
with the group sizes of :func:`~mula_lightning.parallel.zero.layout.expert_layout` (each collective above runs inside
the edp ranks of the dense group of its level). An expert gradient holds every token its EP group routed to it, so the
sum over the edp replicas is the sum over every rank's batch: both families are divided by the world size.

Constraints: every trainable parameter must receive a gradient in every backward (no unused parameters), so all ranks
issue the same collectives in the same order. Frozen parameters (``requires_grad=False``) are sharded and gathered like
the others and never updated; a unit holding frozen parameters stays gathered until its backward pass ends (a frozen
weight may be needed for an input gradient after the unit's last trainable gradient arrived). A backward after the
gradients were synchronised (``clip_grad_norm_``, ``global_grad_norm``) and before ``step`` is reduced as well and
added to them, as under DDP.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from mula_lightning.moe.balancing import install_expert_bias_update
from mula_lightning.optim.adamw import adamw_update_
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.params import is_expert_param, logical_name
from mula_lightning.parallel.sharded_optimizer import (
    clip_coefficient,
    mark_stepped,
    on_the_optimizer_itself,
)
from mula_lightning.parallel.zero.collectives import (
    WeightGather,
    all_gather_chunks,
    all_reduce_,
    reduce_scatter_chunks,
    slice_quantized,
)
from mula_lightning.parallel.zero.layout import ShardPositions, ZeroTopoLayout, edp_ranks, expert_layout
from mula_lightning.utils.dist import is_distributed
from mula_lightning.utils.precision import at_least_float32

UNIT_PATTERN = r"(^|\.)layers\.\d+$"
#: the param-group index of frozen parameters (``requires_grad=False``) in the flat buffers: sharded and gathered like
#: the others (a frozen layer costs each rank its chunks only), outside every param group, never updated
FROZEN = -1


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside a (nested) module output."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for k in value.__dataclass_fields__ for t in _tensors(getattr(value, k))]
    return []


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """``id(parameter) -> [(module, attribute)]`` for every module that registers it (tied weights: several)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, leaf))
    return owners


@dataclass
class _Family:
    """A parameter family and the ranks it is sharded over: the dense parameters over every rank, or (expert
    parallelism) this rank's expert slices over their edp replicas, global rank ``offset + stride * k`` for index
    ``k`` of ``layout`` (see :func:`~mula_lightning.parallel.zero.layout.expert_layout`).

    Attributes:
        groups: kind -> (process group, size, chunk position of each group index), for this rank.
    """

    name: str
    layout: ZeroTopoLayout
    index: int  # this rank's index in ``layout``
    stride: int = 1
    offset: int = 0
    groups: dict[str, tuple[Any, int, list[int]]] = field(default_factory=dict)

    @property
    def positions(self) -> ShardPositions:
        return self.layout.positions(self.index)

    @property
    def replicas(self) -> int:
        """Copies of each optimizer chunk over the family's ranks (the global norm counts each element once)."""
        return self.layout.world_size // self.layout.optimizer_size

    def group(self, kind: str) -> tuple[Any, int, list[int]]:
        return self.groups.get(kind, (None, 1, [0]))


class _Unit:
    """One unit's flat buffer, chunks and state (see the module docstring)."""

    def __init__(self, index: int, module: nn.Module, buf: FlatBuffer, family: _Family) -> None:
        lay, pos = family.layout, family.positions
        self.index, self.module, self.buf, self.family = index, module, buf, family
        n = buf.numel
        self.nw, self.ns, self.ng, self.no = (
            n // lay.weight_size,
            n // lay.secondary_size,
            n // lay.grad_size,
            n // (lay.optimizer_size),
        )
        if buf.initial_value is not None:  # a meta unit: draw (or read) this rank's weight chunk alone
            self.primary = buf.fill_initial(buf.params.new_empty(self.nw), pos.weight * self.nw)
        else:
            self.primary = buf.params[pos.weight * self.nw : (pos.weight + 1) * self.nw].clone()
        self.opt_offset = pos.optimizer * self.no - pos.weight * self.nw  # optimizer chunk inside the primary
        self.grad_offset = pos.optimizer * self.no - pos.grad * self.ng  # optimizer chunk inside the gradient shard
        own = self.primary[self.opt_offset : self.opt_offset + self.no]
        state_dtype = at_least_float32(buf.dtype)  # float32, or float64 for float64 parity runs
        self.master_is_primary = buf.dtype == state_dtype
        self.master = own if self.master_is_primary else own.to(state_dtype)
        self.slot_of = {id(s.param): s for s in buf.slots}
        self.state_dtype = state_dtype
        # the moments and the gradient shard are allocated on first use (the first backward, step, save or load),
        # as torch's AdamW allocates its state at the first step: setup keeps the weight chunks only
        self._exp_avg: torch.Tensor | None = None
        self._exp_avg_sq: torch.Tensor | None = None
        self._grad_shard: torch.Tensor | None = None
        #: the reduced (perhaps clipped) shard of the backwards before a gradient sync that a further backward
        #: reopened (see HierarchicalZeroAdamW._reopen_after_sync), added to the next sync's result
        self.banked: torch.Tensor | None = None
        self.secondary: Any = None
        self.full_grad: torch.Tensor | None = None
        self.ready = 0
        self.trainable = sum(s.param.requires_grad for s in buf.slots)  # gradients a backward brings the unit
        self.has_frozen = self.trainable < len(buf.slots)
        self.gathered = False
        self.pending: WeightGather | None = None
        buf.grads = buf.grads.new_empty(0)  # gradients go to full_grad / grad_shard, not the buffer's own
        self.free()

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.buf.slots]

    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.state_dtype, device=self.buf.device)

    @property
    def exp_avg(self) -> torch.Tensor:
        if self._exp_avg is None:
            self._exp_avg = self._zeros(self.no)
        return self._exp_avg

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        if self._exp_avg_sq is None:
            self._exp_avg_sq = self._zeros(self.no)
        return self._exp_avg_sq

    @property
    def grad_shard(self) -> torch.Tensor:
        if self._grad_shard is None:
            self._grad_shard = self._zeros(self.ng)
        return self._grad_shard

    def free(self) -> None:
        self.buf.params.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self) -> None:
        storage = self.buf.params.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.buf.numel * self.buf.params.element_size())


class HierarchicalZeroAdamW(torch.optim.Optimizer):
    """Hierarchical ZeRO engine and its sharded AdamW in one object; plan and memory in the module docstring.

    Args:
        model: the plain single-device module (its parameters become views into per-unit flat buffers).
        layout: group sizes (default: :meth:`ZeroTopoLayout.from_env`, i.e. the paper's design).
        param_groups: ``[{"params": [...], **hyper-parameters}]`` (default: one group with every parameter).
        lr, betas, eps, weight_decay: AdamW defaults.
        quantize_weights: INT8 (``weight_bits``) forward / backward weight all-gathers and secondary partition.
        quantize_grads: INT4 (``grad_bits``) all-to-all gradient reduce-scatter.
        block_size: elements per quantization block.
        unit_pattern: regular expression of the module names that become units.
        initializer: for a model on the meta device, the full initial value of a (meta) parameter; with a
            ``fill_(param, out, start)`` method (an element range of it) each rank writes only its weight chunk of
            each unit, the unit's buffer never written, so no rank holds more than its chunks plus one initializer
            block (see :class:`~mula_lightning.parallel.parallelize.ParameterInitializer`); a plain callable costs
            one parameter's full value at a time.
        device: where meta parameters are materialised (default: CPU).
        ep_size: expert-parallel degree: the model's experts are already cut to this rank's slice (rank ``r`` holds
            slice ``r % ep_size``, :func:`~mula_lightning.parallel.expert_parallel.apply_expert_parallel` over
            groups of ``ep_size`` consecutive ranks); expert parameters then form units of their own, sharded over
            their edp replicas by :func:`~mula_lightning.parallel.zero.layout.expert_layout`.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ZeroTopoLayout | None = None,
        param_groups: list[dict[str, Any]] | None = None,
        lr: float = 4e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        quantize_weights: bool = False,
        quantize_grads: bool = False,
        weight_bits: int = 8,
        grad_bits: int = 4,
        block_size: int = 256,
        unit_pattern: str = UNIT_PATTERN,
        initializer: Callable[[nn.Parameter], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        ep_size: int = 1,
    ) -> None:
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        distributed = is_distributed()
        self.rank = dist.get_rank() if distributed else 0
        self.layout = layout or ZeroTopoLayout.from_env()
        self.ep_size = ep_size
        self.ep_rank = self.rank % ep_size
        if ep_size > 1:
            _check_experts_cut(model, ep_size)
        self.dense = _Family("dense", self.layout, self.rank)
        self.experts = self.dense  # without expert parallelism, expert weights are dense ones
        if ep_size > 1:
            self.experts = _Family(
                "expert", expert_layout(self.layout, ep_size), self.rank // ep_size, ep_size, self.ep_rank
            )
        self.weight_quant = (weight_bits, block_size) if quantize_weights else None
        self.grad_quant = (grad_bits, block_size) if quantize_grads else None
        self.ep_group: Any = None
        if distributed:
            self._build_groups()
        self._step = 0
        self._synced = False
        self._free_when_backward_ends: set[int] = set()  # units kept gathered for their frozen weights
        self._backward_callback_queued = False

        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        for p in model.parameters():  # frozen parameters are sharded too, never updated (see FROZEN), also when
            if not p.requires_grad:  # an optimizer lists them (torch's AdamW skips them: they have no gradient)
                group_of[id(p)] = FROZEN
        modules = [m for n, m in model.named_modules() if re.search(unit_pattern, logical_name(n))]
        owner: dict[int, int] = {}
        for i, m in enumerate(modules):
            for p in m.parameters():
                owner.setdefault(id(p), i + 1)
        # a unit per layer and family: [root, layer 0, layer 0's experts, layer 1, ...], the order forward needs them
        by_unit: dict[tuple[int, int], list[tuple[str, nn.Parameter, int]]] = {}
        for name, p in model.named_parameters():
            if id(p) in group_of:
                name = logical_name(name)
                key = (owner.get(id(p), 0), int(ep_size > 1 and is_expert_param(name)))
                by_unit.setdefault(key, []).append((name, p, group_of[id(p)]))
        if initializer is None and (meta := [n for items in by_unit.values() for n, p, _ in items if p.is_meta]):
            raise ValueError(
                f"{len(meta)} parameters are on the meta device ({', '.join(meta[:3])}, ...): pass an initializer "
                "(the zero_topo strategy does) or materialise the model first"
            )
        owners = _parameter_owners(model)
        self.units: list[_Unit] = []
        for i, kind in sorted(by_unit):
            family = self.experts if kind else self.dense
            lay = family.layout
            o, sec = lay.optimizer_size, lay.secondary_size
            align = block_size * (o * sec // _gcd(o, sec)) // o
            items = by_unit[i, kind]
            meta_unit = any(p.is_meta for _, p, _ in items)  # each rank draws its weight chunk only
            buf = FlatBuffer(
                items, lay.optimizer_size, family.positions.optimizer, None, align=align, allocate_grads=False,
                device=torch.device(device or "cpu") if meta_unit else None, initial_value=initializer,
                defer_initial_values=True,
            )  # fmt: skip
            self._swap_parameters(buf.replaced, owners)
            module = _root_module(model, [s.param for s in buf.slots]) if i == 0 else modules[i - 1]
            self.units.append(_Unit(len(self.units), module, buf, family))
        if still_meta := [n for n, p in model.named_parameters() if p.is_meta]:
            raise ValueError(
                f"parameters left on the meta device after setup (not in the optimizer: frozen?): {still_meta[:5]}"
            )
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._on_module: dict[int, list[_Unit]] = {}
        for u in self.units:
            self._on_module.setdefault(id(u.module), []).append(u)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for u in self.units for p in u.params if p.requires_grad
        ]
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
        install_expert_bias_update(self, model)  # auxiliary-loss-free balancing: loads summed over every rank

    @on_the_optimizer_itself
    def adopt_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Take the param groups and hyper-parameters of an optimizer built after the engine from the model's
        (materialised, sharded) parameters: Lightning's two-call set-up of a sharded strategy, ``setup_module`` then
        an AdamW of ``model.parameters()``. The layout and every chunk stay as they are; each parameter's updates
        follow its new group.

        Raises:
            ValueError: naming parameters the engine does not hold, held twice, or trained by the engine but left out
                of the groups (freeze them before the module is set up instead).
        """
        slots = {id(s.param): s for u in self.units for s in u.buf.slots}
        names = {id(s.param): s.name for s in slots.values()}
        seen: dict[int, int] = {}
        for gi, group in enumerate(groups):
            for p in group["params"]:
                if id(p) not in slots:
                    raise ValueError(
                        f"an optimizer parameter of shape {tuple(p.shape)} is not one the zero_topo engine holds: "
                        "build the optimizer from the set-up module's parameters"
                    )
                if id(p) in seen:
                    raise ValueError(f"parameter {names[id(p)]} is in more than one param group")
                seen[id(p)] = gi
        missing = [names[k] for k, slot in slots.items() if k not in seen and slot.param.requires_grad]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters are not in the optimizer "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "zero_topo updates every parameter it shards; freeze them (requires_grad_(False)) before setting up "
                "the module, or pass them to the optimizer"
            )
        keep = ("lr", "betas", "eps", "weight_decay", "initial_lr")
        self.param_groups = []
        for group in groups:
            self.add_param_group({"params": list(group["params"]), **{k: v for k, v in group.items() if k in keep}})
        seen.update({k: FROZEN for k, slot in slots.items() if not slot.param.requires_grad})
        for u in self.units:
            u.buf.regroup(seen)

    def _swap_parameters(
        self, replaced: dict[int, nn.Parameter], owners: dict[int, list[tuple[nn.Module, str]]]
    ) -> None:
        """Put the materialised parameters in place of their meta originals: in every module that registers one
        (tied weights included) and in the optimizer's param groups."""
        if not replaced:
            return
        for old, new in replaced.items():
            for module, leaf in owners.get(old, []):
                module._parameters[leaf] = new
        for g in self.param_groups:
            g["params"] = [replaced.get(id(p), p) for p in g["params"]]

    # ------------------------------------------------------------------ groups
    def _build_groups(self) -> None:
        """Create every group of every family (each rank creates all of them, in one order) and give each family
        this rank's (group, size, chunk position per group index) of each kind."""
        cache: dict[tuple[int, ...], Any] = {}
        families = [self.dense] + ([self.experts] if self.experts is not self.dense else [])
        for fam in families:
            for offset in range(fam.stride):  # every EP rank's edp ranks, for the experts
                for kind_groups in fam.layout.all_groups().values():
                    for local in kind_groups:
                        ranks = tuple(edp_ranks(local, offset, fam.stride))
                        if len(ranks) > 1 and ranks not in cache:
                            cache[ranks] = dist.new_group(list(ranks))
        if self.ep_size > 1:  # the EP groups, where expert slices are gathered whole (full_state_dict)
            for start in range(0, self.layout.world_size, self.ep_size):
                ranks = tuple(range(start, start + self.ep_size))
                if ranks not in cache:
                    cache[ranks] = dist.new_group(list(ranks))
            first = self.rank - self.ep_rank
            self.ep_group = cache[tuple(range(first, first + self.ep_size))]
        for fam in families:
            fam.groups = _family_groups(fam, cache)

    def _group(self, kind: str, unit: _Unit | None = None) -> tuple[Any, int, list[int]]:
        """(group, size, positions) of ``kind`` for ``unit``'s family (default: the dense one)."""
        return (self.dense if unit is None else unit.family).group(kind)

    # ------------------------------------------------------------- weights
    def _start_gather(self, u: _Unit, phase: str) -> None:
        if u.gathered or u.pending is not None:
            return
        u.allocate()
        tag = f"weights.{phase}"
        if phase == "forward" or u.secondary is None:  # the primary (also in backward when s == w, unquantized)
            group, size, positions = self._group("weight", u)
            u.pending = WeightGather(u.primary, u.buf.params, group, size, positions, self.weight_quant, phase, tag)
        else:
            group, size, positions = self._group("secondary", u)
            if isinstance(u.secondary, torch.Tensor):
                chunk, pre = u.secondary, None
            else:
                chunk, pre = None, u.secondary
            quant = self.weight_quant if pre is None else (pre.bits, pre.block_size)
            u.pending = WeightGather(chunk, u.buf.params, group, size, positions, quant, phase, tag, prequantized=pre)
        u.pending.phase = phase

    def _finish_gather(self, u: _Unit) -> None:
        if u.pending is None:
            return
        pending, u.pending = u.pending, None
        chunks = pending.wait()
        u.gathered = True
        if pending.phase != "forward":
            return
        lay, p = u.family.layout, u.family.positions.secondary
        lo, hi = p * u.ns, (p + 1) * u.ns
        if self.weight_quant is not None and chunks is not None and lay.secondary_size > 1:
            u.secondary = slice_quantized(chunks, u.nw, lo, hi)  # what was gathered: no re-quantization
        elif lay.secondary_size != lay.weight_size:
            u.secondary = u.buf.params[lo:hi].clone()
        else:
            u.secondary = None  # the primary is gathered again

    def _layer(self, index: int) -> list[_Unit]:
        """The units hooked on the module of unit ``index`` (a layer's dense unit and its experts' unit)."""
        return self._on_module[id(self.units[index].module)]

    def _make_pre_forward(self, u: _Unit):
        def hook(module: nn.Module, args: Any) -> None:
            layer = self._layer(u.index)
            for v in layer:  # the layer's units travel together (its sibling's hook then finds them gathered)
                self._start_gather(v, "forward")
            for v in layer:
                self._finish_gather(v)
            following = layer[-1].index + 1
            if following < len(self.units):
                for v in self._layer(following):
                    self._start_gather(v, "forward")  # prefetch the next layer

        return hook

    def _make_post_forward(self, u: _Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            u.free()
            tensors = _tensors(output) if torch.is_grad_enabled() else []
            if tensors:
                register_multi_grad_hook(tensors, lambda grads: self._pre_backward(u), mode="any")

        return hook

    def _pre_backward(self, u: _Unit) -> None:
        layer = self._layer(u.index)
        for v in layer:
            self._start_gather(v, "backward")
        for v in layer:
            self._finish_gather(v)
            if v.trainable == 0:  # no gradient will release it: freed when the backward ends
                self._free_after_use(v)
        first = layer[0].index
        prev = first - 1 if first > 0 else len(self.units) - 1  # the root's head runs first, then the last layer
        if prev > 0:
            for v in self._layer(prev):
                self._start_gather(v, "backward")  # prefetch the previous layer

    # ----------------------------------------------------------- gradients
    def _on_grad(self, param: nn.Parameter) -> None:
        if self._synced:  # a backward after clip_grad_norm_ / global_grad_norm and before step: reduce it as well
            self._reopen_after_sync()
        u = self._unit_of[id(param)]
        if u.full_grad is None:
            u.full_grad = torch.zeros(u.buf.numel, dtype=u.state_dtype, device=u.buf.device)
        slot = u.slot_of[id(param)]
        u.full_grad[slot.start : slot.end].add_(param.grad.reshape(-1))
        param.grad = None
        u.ready += 1
        if u.ready == u.trainable:
            self._reduce(u)

    def _reduce(self, u: _Unit) -> None:
        group, size, positions = self._group("grad", u)
        quant = self.grad_quant if size > 1 else None
        u.grad_shard.add_(reduce_scatter_chunks(u.full_grad, group, size, positions, quant, "grads.reduce_scatter"))
        u.full_grad, u.ready = None, 0
        if u.pending is None:
            self._free_after_use(u)

    def _free_after_use(self, u: _Unit) -> None:
        """Free a unit whose trainable gradients have all arrived: now, unless it holds frozen parameters and a
        backward is running. A frozen weight may still be needed below its unit's last trainable gradient (a frozen
        input norm under a trainable attention computes the layer's input gradient after the attention's weight
        gradients arrived), so such a unit is freed when the backward ends (an autograd engine callback)."""
        if not (u.has_frozen and _in_backward()):
            u.free()
            return
        self._free_when_backward_ends.add(u.index)
        if not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._free_after_backward)

    def _free_after_backward(self) -> None:
        """End of a backward: free the units kept gathered for their frozen weights (see :meth:`_free_after_use`)."""
        self._backward_callback_queued = False
        for index in sorted(self._free_when_backward_ends):
            u = self.units[index]
            if u.pending is None and u.full_grad is None:
                u.free()
        self._free_when_backward_ends.clear()

    def _reopen_after_sync(self) -> None:
        """A gradient arrives after the shards were reduced across nodes and divided (``clip_grad_norm_``,
        ``global_grad_norm``) and before ``step``: keep each reduced (perhaps clipped) shard aside and start a new
        round, as DDP reduces a further backward's gradients and adds them to the ones it holds. Without this the new
        gradients would land in the reduced shard and ``step`` (seeing the sync done) would skip their all-reduce
        across nodes and their division by the world size."""
        self._synced = False
        for u in self.units:
            if u._grad_shard is not None:  # already holds any earlier banked shard (added at the end of the sync)
                u.banked, u._grad_shard = u._grad_shard, None

    @on_the_optimizer_itself
    def finish_grad_sync(self) -> None:
        """Reduce units still waiting, all-reduce gradient shards across nodes, divide by the world size once."""
        if self._synced:
            return
        self._synced = True
        for u in reversed(self.units):
            if u.full_grad is not None:
                self._reduce(u)
            elif u.gathered and u.pending is None:  # a unit of frozen parameters: gathered for its backward only
                u.free()
        for u in self.units:
            group, size, _ = self._group("grad_cross", u)
            all_reduce_(u.grad_shard, group, size, "grads.all_reduce")
            u.grad_shard.div_(self.layout.world_size)  # every rank's batch, the experts' included
            if u.banked is not None:  # reduced before a further backward reopened the sync
                u.grad_shard.add_(u.banked)
                u.banked = None

    def _owned_grads(self, u: _Unit) -> torch.Tensor:
        return u.grad_shard[u.grad_offset : u.grad_offset + u.no]

    # ------------------------------------------------------------------ step
    @on_the_optimizer_itself
    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (each element counted once); runs the pending reductions first."""
        self.finish_grad_sync()
        # each optimizer chunk is held by its family's replicas: counted once
        total = sum(self._owned_grads(u).pow(2).sum() / u.family.replicas for u in self.units)
        if is_distributed():
            all_reduce_(total, None, self.layout.world_size, "grads.norm")
        return total.sqrt()

    @on_the_optimizer_itself
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        norm = self.global_grad_norm()
        scale = clip_coefficient(norm, max_norm)  # no host sync: multiplied by exactly 1.0 when not clipping
        for u in self.units:
            u.grad_shard.mul_(scale)
        return norm

    @on_the_optimizer_itself
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.finish_grad_sync()
        self._step += 1
        mark_stepped(self)
        for u in self.units:
            group, size, positions = self._group("post_step", u)
            runs = [run for run in u.buf.runs if run[2] != FROZEN]  # frozen elements keep their values
            adamw_update_(u.master, self._owned_grads(u), u.exp_avg, u.exp_avg_sq, runs, self.param_groups, self._step)
            own = u.primary[u.opt_offset : u.opt_offset + u.no]
            if not u.master_is_primary:
                own.copy_(u.master)
            # own may be the input as it is: the chunks arrive in a buffer of their own and are copied into the
            # primary (own's range included, with its own values) only once the gather has finished
            all_gather_chunks(own, u.primary, group, size, positions, "weights.post_step")
            # the secondary chunk keeps its memory (Table V) and is overwritten by the next forward before any use
        self.zero_grad()
        return loss

    @on_the_optimizer_itself
    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units:
            u.grad_shard.zero_()
            u.full_grad, u.ready, u.banked = None, 0, None
            for p in u.params:
                p.grad = None
        self._synced = False

    # --------------------------------------------------------- inspection
    def checkpoint_layout(self, name: str, param: torch.Tensor) -> tuple[tuple[int, ...], list[tuple[Any, tuple]]]:
        """(single-device shape, ``[(index into the local tensor, its offsets there)]``) of a parameter this rank
        holds: an expert slice sits at rows ``ep_rank * E / ep`` of the layer's experts, anything else is whole."""
        local = tuple(param.shape)
        whole = tuple(slice(None) for _ in local)
        if self.ep_size > 1 and is_expert_param(name):
            return (local[0] * self.ep_size, *local[1:]), [(whole, (self.ep_rank * local[0], *(0,) * (len(local) - 1)))]
        return local, [(whole, (0,) * len(local))]

    @contextmanager
    def full_parameters(self):
        """Inside, every parameter holds its full unquantized value (from the primary chunks); freed on exit."""
        for u in self.units:
            group, size, positions = self._group("weight", u)
            u.allocate()
            WeightGather(u.primary, u.buf.params, group, size, positions, None, "step", "weights.summon").wait()
        try:
            yield
        finally:
            for u in self.units:
                u.free()

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes per state kind on this rank, from ``untyped_storage().nbytes()`` (the moments and gradient
        shards allocated on first use are allocated here if they were not yet)."""

        def nbytes(t: Any) -> int:
            if t is None:
                return 0
            if isinstance(t, torch.Tensor):
                return t.untyped_storage().nbytes()
            return t.payload.untyped_storage().nbytes() + t.scales.untyped_storage().nbytes()

        out = {"weights": 0, "secondary": 0, "grads": 0, "optimizer": 0}
        for u in self.units:
            out["weights"] += nbytes(u.primary)
            out["secondary"] += nbytes(u.secondary)
            out["grads"] += nbytes(u.grad_shard)
            out["optimizer"] += nbytes(u.exp_avg) + nbytes(u.exp_avg_sq)
            out["optimizer"] += 0 if u.master_is_primary else nbytes(u.master)
        return out


def _check_experts_cut(model: nn.Module, ep_size: int) -> None:
    """Every MoE block holds ``1 / ep_size`` of its experts (else the engine would take whole layers for slices)."""
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        total = getattr(module, "num_experts", None)
        weight = getattr(experts, "gate_up_proj", None)
        if isinstance(total, int) and weight is not None and weight.shape[0] * ep_size != total:
            raise ValueError(
                f"{logical_name(name)} holds {weight.shape[0]} of its {total} experts; ep_size {ep_size} needs them "
                f"cut to {total // ep_size} per rank first (apply_expert_parallel over groups of {ep_size} ranks)"
            )


def _family_groups(fam: _Family, cache: dict[tuple[int, ...], Any]) -> dict[str, tuple[Any, int, list[int]]]:
    """(group, size, chunk position per group index) of each kind for this rank in family ``fam``, the groups taken
    from ``cache`` (global ranks -> process group; None for a group of one)."""
    lay, r = fam.layout, fam.index
    pos = lay.positions
    post_step = lay.optimizer_size // lay.weight_size
    kinds = {
        "weight": (lay.weight_ranks(r), lambda q: pos(q).weight),
        "secondary": (lay.secondary_ranks(r), lambda q: pos(q).secondary),
        "grad": (lay.grad_ranks(r), lambda q: pos(q).grad),
        "grad_cross": (lay.grad_cross_ranks(r), lambda q: 0),
        "post_step": (lay.post_step_ranks(r), lambda q: pos(q).optimizer % post_step),
    }
    return {
        k: (cache.get(tuple(edp_ranks(rs, fam.offset, fam.stride))), len(rs), [f(q) for q in rs])
        for k, (rs, f) in kinds.items()
    }


def _root_module(model: nn.Module, params: list[nn.Parameter]) -> nn.Module:
    """The deepest module holding every use of every root-unit parameter (``MulaForCausalLM`` inside a
    LightningModule): its forward spans the whole use of the root weights, so its hooks gather and free them. A tied
    weight counts in each module that registers it (tied embeddings: the embedding and the LM head), so the root is
    not the inner model whose forward ends before the head runs."""
    wanted = {id(p) for p in params}

    def uses(module: nn.Module) -> Counter[int]:
        return Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False) if id(p) in wanted)

    everywhere = uses(model)
    best, depth = model, -1
    for name, module in model.named_modules():
        level = name.count(".") + bool(name)
        if level > depth and uses(module) == everywhere:
            best, depth = module, level
    return best


def _in_backward() -> bool:
    """Whether an autograd backward is running on this thread (a hook called from it)."""
    return torch._C._current_graph_task_id() != -1


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
