"""Bytes per collective per optimizer step of one rank, in the communication ledger's conventions.

Every row is what :class:`~mula_lightning.parallel.ledger.CommLedger` records for the same step on that rank: its
``tag``, ``op``, ``level`` (the ledger's label: a hardware level, or ``"ep"`` for the token dispatch, which labels
itself) and ``bytes_sent`` summed over the step's calls (ring convention: ``(d - 1) / d`` of the larger side for
all-gather and reduce-scatter, twice that for all-reduce, the pairs leaving the rank for all-to-all). ``link`` is the
hardware level the bytes cross whatever the label (what a step time needs); rows the ledger does not see (pipeline
point-to-point sends, tagged ``pp.*``) are marked ``ledger=False``.

What is counted, per optimizer step of ``A`` micro-batches (``pp_microbatches`` with pipeline parallelism) of
``S`` tokens per rank each:

* ``epso`` (:mod:`~mula_lightning.parallel.sharded_optimizer`'s table): per family once per step, the gradient
  reduction in ``reduce_dtype`` (reduce-scatter over the shard group, or all-reduce without sharding; ``dp`` mode adds
  the all-reduce of the owned shard over ``ep``) and the weights' all-gather in the parameters' dtype. Each family is
  padded to a multiple of its shard group, as one bucket of a :class:`~mula_lightning.parallel.flat_buffer.FlatBuffer`
  is (with several buckets each pads: at most ``shard group - 1`` elements more per bucket).
* the token dispatch of every MoE layer, per micro-batch, at balanced routing (each rank receives ``S x K`` pairs,
  ``(EP - 1) / EP`` of its own pairs leave it; capacity drops are not subtracted): the all-gather dispatcher's token
  counts (int64), tokens (parameter dtype), routing weights (float32) and expert indices (int64) gathered, the
  combined outputs reduce-scattered, and the backward's mirror images; the all-to-all dispatcher's counts, pairs,
  indices and outputs. A recomputed MoE block (``activation_checkpointing`` ``"full"`` or with ``"moe"``) repeats its
  dispatch in backward; the recomputation stops after the last tensor backward needs, so the all-gather
  dispatcher's combine (which saves nothing) is not repeated, the all-to-all's is.
* ``zero_topo`` (:mod:`~mula_lightning.parallel.zero.engine`): per unit (the embedding, final norm and head; each
  layer's dense part; each MoE layer's expert slice), padded as the engine pads (``block_size x lcm(o, s)``
  elements), per micro-batch the forward and backward weight gathers and the gradient reduce-scatter, per step the
  cross-node all-reduce of the gradient shard, the post-step gather and the scalar all-reduce of the gradient norm
  (the recipes clip).
* tensor parallelism (``tp``; DTensor's collectives, which the ledger tags ``"dtensor"`` under
  :func:`~mula_lightning.parallel.ledger.record_functional_collectives`, and the package's own ``tp.*``), per
  micro-batch: each row-parallel output (attention's ``o_proj``, a dense MLP's ``down_proj``, the embedding) reduced
  in forward, each column-parallel input's gradient (attention, MLP, LM head) reduced in backward: an all-reduce of
  the ``S x H`` activation, or under sequence parallelism a reduce-scatter of it and an all-gather of its ``S / tp``
  part for each (the column inputs in forward, the row outputs' gradients in backward); the full-width q/k norms'
  sums of squares (``tp.qk_norm``, forward and backward), the vocabulary-parallel loss's three per-token statistics
  (``tp.ce.*``) and under sequence parallelism each MoE layer's router statistics (``tp.sp.router``, ``2E + 2``
  float32). A recomputation stops after the last tensor backward needs: a recomputed attention block or MLP repeats
  only the q/k norms' sums (its output's reduction follows its last saved input; its input's gather runs in the
  module's input hook, outside it); a recomputed whole layer also gathers both blocks' inputs and reduces
  attention's output again.
  Without sequence parallelism every ``tp`` rank routes the whole sequence (its ``S`` tokens dispatched); with it,
  ``S / tp``. Expert tensor parallelism dispatches over the ``EP x ETP`` ranks of a block.
* context parallelism (``cp``, :mod:`~mula_lightning.parallel.context_parallel`): each rank computes ``S / cp``
  tokens of every sequence (the token dispatch and tensor parallelism's collectives above carry those), and per
  micro-batch every attention all-gathers this rank's keys and values together over ``cp`` (``cp.kv``, again when
  attention is recomputed) and reduce-scatters their gradients in backward; every MoE layer sums its router's
  statistics over ``cp`` (``cp.router``, ``2E + 2`` float32, again when the block is recomputed) and without
  pipelining the loss is summed (``cp.loss``, one float32); a pipeline's stages send ``S / cp`` tokens' activations.
* pipeline parallelism: each micro-batch's activations sent forward and their gradients back, per stage boundary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.activation_checkpointing import parse_activation_checkpointing
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import ring_bytes_sent
from mula_lightning.parallel.mesh import ParallelDims
from mula_lightning.parallel.pipeline import stage_layer_ranges
from mula_lightning.parallel.zero.layout import ZeroTopoLayout, expert_layout
from mula_lightning.parallel.zero.quantization import packed_bytes
from mula_lightning.plan.states import PRECISIONS, Layout, epso_families, layer_counts, stage_params

#: bytes of the gradient reduction's dtype
REDUCE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Collective:
    """One collective of one rank over a step: the ledger's keys and the bytes it sends."""

    tag: str
    op: str
    group_size: int
    level: str  # as the ledger labels it
    link: str  # the hardware level crossed
    calls: int
    bytes_sent: int
    ledger: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Batch:
    """What one rank computes per optimizer step: ``micro_batches`` of ``micro_batch_size`` sequences of
    ``seq_len`` tokens (with pipeline parallelism, the micro-batches the schedule cuts the batch into)."""

    micro_batch_size: int = 1
    seq_len: int = 2048
    micro_batches: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.micro_batch_size * self.seq_len


def _pad(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


class _Rows:
    """Collectives accumulated by (tag, op, level); a collective over one rank sends nothing and is skipped."""

    def __init__(self, levels: dict[tuple[int, ...], str] | None = None) -> None:
        self.rows: dict[tuple[str, str, str], Collective] = {}
        self.levels = {} if levels is None else levels  # a group's hardware level, shared by a plan's stages

    def add(
        self,
        tag: str,
        op: str,
        ranks: list[int],
        level: str | None,
        hw: HardwareTopology,
        calls: int,
        bytes_in: int,
        self_bytes: int = 0,
        ledger: bool = True,
    ) -> None:
        if len(ranks) < 2 or calls == 0:
            return
        key = tuple(ranks)
        link = self.levels.get(key) or self.levels.setdefault(key, hw.level_of(ranks))
        label = level or link
        sent = calls * ring_bytes_sent(op, len(ranks), bytes_in, self_bytes)
        key = (tag, op, label)
        old = self.rows.get(key)
        if old is not None:
            calls, sent = calls + old.calls, sent + old.bytes_sent
        self.rows[key] = Collective(tag, op, len(ranks), label, link, calls, sent, ledger)


def _recomputes_moe(checkpointing: Any) -> bool:
    return checkpointing == "full" or (isinstance(checkpointing, (list, tuple)) and "moe" in checkpointing)


def _dispatch(
    rows: _Rows,
    config: MulaConfig,
    layers: range,
    tokens: int,
    micro_batches: int,
    ep_ranks: list[int],
    dispatcher: str,
    param_bytes: int,
    checkpointing: Any,
    hw: HardwareTopology,
    ep_size: int | None = None,
) -> None:
    """The token dispatch of the MoE layers in ``layers`` over one step (see the module docstring); ``ep_ranks``
    is the group the dispatcher gathers over (``EP x ETP`` ranks), ``ep_size`` the experts' split (default: all)."""
    moe_layers = sum(layer_counts(config)[i].moe for i in layers)
    ep = len(ep_ranks)
    if ep < 2 or not moe_layers:
        return
    forward = moe_layers * micro_batches
    again = forward * (2 if _recomputes_moe(checkpointing) else 1)  # forward, and the recomputation's
    s, k, h = tokens, config.top_k, config.hidden_size
    if dispatcher == "allgather":
        rows.add("moe.token_count", "all_gather", ep_ranks, "ep", hw, again, (1 + (ep_size or ep)) * 8)
        rows.add("moe.dispatch.x", "all_gather", ep_ranks, "ep", hw, again, s * h * param_bytes)
        rows.add("moe.dispatch.w", "all_gather", ep_ranks, "ep", hw, again, s * k * 4)
        rows.add("moe.dispatch.idx", "all_gather", ep_ranks, "ep", hw, again, s * k * 8)
        rows.add("moe.combine", "reduce_scatter", ep_ranks, "ep", hw, forward, ep * s * h * param_bytes)
        rows.add("moe.combine", "all_gather", ep_ranks, "ep", hw, forward, s * h * param_bytes)
        rows.add("moe.dispatch.w", "reduce_scatter", ep_ranks, "ep", hw, forward, ep * s * k * 4)
        rows.add("moe.dispatch.x", "reduce_scatter", ep_ranks, "ep", hw, forward, ep * s * h * param_bytes)
        return
    pairs = s * k  # sent and received per rank at balanced routing; 1 / ep of them stay
    kept = pairs // ep
    rows.add("moe.a2a.counts", "all_to_all", ep_ranks, "ep", hw, again, ep * 8, 8)
    rows.add("moe.a2a.idx", "all_to_all", ep_ranks, "ep", hw, again, pairs * 8, kept * 8)
    for tag in ("moe.a2a.x", "moe.a2a.y"):  # forward (and recomputed) and the backward's way back
        row_bytes = h * param_bytes
        rows.add(tag, "all_to_all", ep_ranks, "ep", hw, again + forward, pairs * row_bytes, kept * row_bytes)


def _epso_optimizer(
    rows: _Rows,
    layout: Layout,
    stage: Any,
    stage_ranks: list[int],
    dp_ranks: list[int],
    ep_ranks: list[int],
    reduce_bytes: int,
    param_bytes: int,
    hw: HardwareTopology,
    dense_dp_ranks: list[int],
) -> None:
    """Each family's gradient reduction and weight gather, once per step (the optimizer's table): ``non_expert``
    over the stage, ``tensor_parallel`` over the ``dense_dp`` ranks holding the same shard, ``expert`` over ``dp``."""
    replicas = {"optimizer.non_expert": stage_ranks, "optimizer.tensor_parallel": dense_dp_ranks,
                "optimizer.expert": dp_ranks}  # fmt: skip
    for family, numel in epso_families(stage, layout).items():
        tag, numel = f"optimizer.{family}", round(numel)
        if not numel:
            continue
        is_expert = tag == "optimizer.expert"
        if layout.mode == "none":
            rows.add(tag, "all_reduce", replicas[tag], None, hw, 1, numel * reduce_bytes)
            continue
        shard = dp_ranks if is_expert or layout.mode == "dp" else replicas[tag]
        padded = _pad(numel, len(shard))
        rows.add(tag, "reduce_scatter", shard, None, hw, 1, padded * reduce_bytes)
        if layout.mode == "dp" and not is_expert:
            rows.add(tag, "all_reduce", ep_ranks, None, hw, 1, padded // len(shard) * reduce_bytes)
        rows.add(tag, "all_gather", shard, None, hw, 1, padded // len(shard) * param_bytes)


def _tensor_parallel(
    rows: _Rows,
    config: MulaConfig,
    layout: Layout,
    layers: range,
    first: bool,
    last: bool,
    batch: Batch,
    tp_ranks: list[int],
    param_bytes: int,
    checkpointing: Any,
    hw: HardwareTopology,
) -> None:
    """Tensor parallelism's collectives of a stage over one step (see the module docstring)."""
    if len(tp_ranks) < 2:
        return
    parts = parse_activation_checkpointing(checkpointing) or ()
    tp, sp, m, s = layout.tp, layout.sp, batch.micro_batches, batch.tokens
    activation = s * config.hidden_size * param_bytes
    counts = layer_counts(config)
    full = parts == "full"

    def block(calls: int, outputs_again: int, inputs_again: int) -> None:
        """``calls`` column-input / row-output pairs per micro-batch, of which the recomputation repeats
        ``outputs_again`` output reductions and ``inputs_again`` input gathers."""
        if not sp:
            rows.add("dtensor", "all_reduce", tp_ranks, None, hw, m * (2 * calls + outputs_again), activation)
            return
        rows.add("dtensor", "reduce_scatter", tp_ranks, None, hw, m * (2 * calls + outputs_again), activation)
        rows.add("dtensor", "all_gather", tp_ranks, None, hw, m * (2 * calls + inputs_again), activation // tp)

    # A recomputation stops after the last tensor backward needs: a region's own output reduction comes after its
    # last matmul saved its input (not repeated), and its input's gather is outside it (the module's input hook);
    # a recomputed whole layer gathers both blocks' inputs again and reduces attention's output, which its second
    # block reads, again.
    dense = sum(not counts[i].moe for i in layers)
    moe = len(layers) - dense
    block(len(layers), len(layers) if full else 0, len(layers) if full else 0)  # attention
    block(dense, 0, dense if full else 0)  # dense MLPs
    if first or last:  # the embedding's output, the head's input: one collective each way
        rows.add("dtensor", "all_reduce" if not sp else "reduce_scatter", tp_ranks, None, hw, m * (first + last),
                 activation)  # fmt: skip
        if sp:
            rows.add("dtensor", "all_gather", tp_ranks, None, hw, m * (first + last), activation // tp)
    if config.qk_norm and not config.qk_norm_per_head:  # sums of squares of q and k over the full width
        again = len(layers) if full or "attention" in parts else 0
        rows.add("tp.qk_norm", "all_reduce", tp_ranks, None, hw, m * 2 * (len(layers) + again), s * 4)
        rows.add("tp.qk_norm.backward", "all_reduce", tp_ranks, None, hw, m * 2 * len(layers), s * 4)
    if last:
        for tag in ("tp.ce.max", "tp.ce.target", "tp.ce.sum_exp"):
            rows.add(tag, "all_reduce", tp_ranks, None, hw, m, s * 4)
    if sp and moe:
        again = moe if _recomputes_moe(checkpointing) else 0
        rows.add("tp.sp.router", "all_reduce", tp_ranks, None, hw, m * (moe + again), (2 * config.num_experts + 2) * 4)


def _context_parallel(
    rows: _Rows,
    config: MulaConfig,
    layout: Layout,
    layers: range,
    last: bool,
    batch: Batch,
    cp_ranks: list[int],
    param_bytes: int,
    checkpointing: Any,
    hw: HardwareTopology,
) -> None:
    """Context parallelism's own collectives of a stage over one step (see the module docstring); ``batch`` is the
    whole sequences' (each rank holds ``1 / cp`` of their tokens)."""
    if len(cp_ranks) < 2:
        return
    parts = parse_activation_checkpointing(checkpointing) or ()
    m, n, cp = batch.micro_batches, len(layers), layout.cp
    kv = batch.tokens // cp * 2 * (config.kv_dim // layout.tp) * param_bytes  # this rank's K and V, one exchange
    again = n if parts == "full" or "attention" in parts else 0
    rows.add("cp.kv", "all_gather", cp_ranks, None, hw, m * (n + again), kv)
    rows.add("cp.kv", "reduce_scatter", cp_ranks, None, hw, m * n, cp * kv)
    moe = sum(layer_counts(config)[i].moe for i in layers)
    if moe:
        again = moe if _recomputes_moe(checkpointing) else 0
        rows.add("cp.router", "all_reduce", cp_ranks, None, hw, m * (moe + again), (2 * config.num_experts + 2) * 4)
    if last and layout.pp == 1:  # (a pipeline sums its step's loss once, outside the ledger, as it does over pp)
        rows.add("cp.loss", "all_reduce", cp_ranks, None, hw, m, 4)


def _zero_units(config: MulaConfig, layout: Layout) -> list[tuple[int, ZeroTopoLayout, list[int]]]:
    """``(elements, family layout, global ranks of the family's index space)`` of every unit of the engine."""
    dense, experts = layout.zero_layout(), expert_layout(layout.zero_layout(), layout.ep)
    (stage,) = stage_params(config, 1)
    counts = layer_counts(config)
    layer_dense = [c.non_expert for c in counts]
    root = stage.non_expert - sum(layer_dense)
    dense_ranks = list(range(layout.world_size))
    expert_ranks = [layout.ep * k for k in range(experts.world_size)]  # rank 0's edp ranks
    units = [(root, dense, dense_ranks)]
    for i in range(config.num_layers):
        units.append((layer_dense[i], dense, dense_ranks))
        if counts[i].moe:
            units.append((counts[i].expert // layout.ep, experts, expert_ranks))
    return units


def _zero_topo(
    rows: _Rows, config: MulaConfig, layout: Layout, batch: Batch, param_bytes: int, hw: HardwareTopology
) -> None:
    quant_w, quant_g = layout.extra.get("quantize_weights", False), layout.extra.get("quantize_grads", False)
    bits_w, bits_g = layout.extra.get("weight_bits", 8), layout.extra.get("grad_bits", 4)
    block = layout.extra.get("block_size", 256)
    a = batch.micro_batches
    for numel, lay, ranks in _zero_units(config, layout):
        w, s, g, o = lay.weight_size, lay.secondary_size, lay.grad_size, lay.optimizer_size
        n = _pad(numel, block * (o * s // math.gcd(o, s)))

        def group(members: list[int], ranks: list[int] = ranks) -> list[int]:
            return [ranks[i] for i in members]

        wbytes = packed_bytes(n // w, bits_w, block) if quant_w and w > 1 else n // w * param_bytes
        rows.add("weights.forward", "all_gather", group(lay.weight_ranks(0)), None, hw, a, wbytes)
        if quant_w or s != w:
            sbytes = packed_bytes(n // s, bits_w, block) if quant_w else n // s * param_bytes
            rows.add("weights.backward", "all_gather", group(lay.secondary_ranks(0)), None, hw, a, sbytes)
        else:
            rows.add("weights.backward", "all_gather", group(lay.weight_ranks(0)), None, hw, a, wbytes)
        if quant_g and g > 1:  # INT4 chunks by all-to-all, each rank keeping its own
            chunk = packed_bytes(n // g, bits_g, block)
            rows.add("grads.reduce_scatter", "all_to_all", group(lay.grad_ranks(0)), None, hw, a, g * chunk, chunk)
        else:
            rows.add("grads.reduce_scatter", "reduce_scatter", group(lay.grad_ranks(0)), None, hw, a, n * 4)
        rows.add("grads.all_reduce", "all_reduce", group(lay.grad_cross_ranks(0)), None, hw, 1, n // g * 4)
        rows.add("weights.post_step", "all_gather", group(lay.post_step_ranks(0)), None, hw, 1, n // o * param_bytes)
    rows.add("grads.norm", "all_reduce", list(range(layout.world_size)), None, hw, 1, 4)


def comm_bytes(
    config: MulaConfig,
    layout: Layout,
    batch: Batch,
    hw: HardwareTopology,
    dispatcher: str = "allgather",
    reduce_dtype: str = "float32",
    checkpointing: Any = None,
) -> list[list[Collective]]:
    """Per pipeline stage, the collectives of the stage's first rank over one optimizer step.

    Args:
        config: the model.
        layout: the ranks' use (:class:`~mula_lightning.plan.states.Layout`).
        batch: micro-batches per step and their size.
        hw: which node and GPU each rank is on (:meth:`HardwareTopology.uniform`).
        dispatcher: the MoE token dispatcher, ``"allgather"`` or ``"alltoall"``.
        reduce_dtype: ``epso``'s gradient reduction dtype, ``"float32"`` or ``"bfloat16"``.
        checkpointing: the strategy's ``activation_checkpointing`` (a recomputed MoE block dispatches again).
    """
    layout.check(config)
    if dispatcher not in ("allgather", "alltoall"):
        raise ValueError(f"dispatcher ({dispatcher!r}) must be 'allgather' or 'alltoall'")
    if reduce_dtype not in REDUCE_BYTES:
        raise ValueError(f"reduce_dtype ({reduce_dtype!r}) must be one of {sorted(REDUCE_BYTES)}")
    if layout.etp > 1 and dispatcher != "allgather":
        raise ValueError(f"etp ({layout.etp}) > 1 needs the all-gather dispatcher (got {dispatcher!r})")
    param_bytes = PRECISIONS[layout.precision]
    dims = ParallelDims(layout.world_size, pp=layout.pp, ep=layout.ep, tp=layout.tp, etp=layout.etp, cp=layout.cp)
    stage_size = dims.stage_size
    out = []
    layer_ranges = stage_layer_ranges(config.num_layers, layout.pp)
    levels: dict[tuple[int, ...], str] = {}
    whole, batch = batch, Batch(batch.micro_batch_size, batch.seq_len // layout.cp, batch.micro_batches)  # this rank's
    moe_tokens = batch.tokens // layout.sequence_split  # each tp rank routes its part of the sequence under SP
    for index, stage in enumerate(stage_params(config, layout.pp)):
        rows, first = _Rows(levels), index * stage_size
        ep_ranks = dims.ranks("ep", first)
        expert_ranks = list(range(first, first + layout.ep * layout.etp))  # the block of EP x ETP ranks
        if layout.strategy == "zero_topo":
            _zero_topo(rows, config, layout, batch, param_bytes, hw)
        else:
            stage_ranks = list(range(first, first + stage_size))
            replicas = [first + i * layout.tp for i in range(layout.dense_dp)]  # the dp x cp ranks of a tp slice
            _epso_optimizer(rows, layout, stage, stage_ranks, dims.ranks("edp", first), ep_ranks,
                            REDUCE_BYTES[reduce_dtype], param_bytes, hw, replicas)  # fmt: skip
        _dispatch(rows, config, layer_ranges[index], moe_tokens, batch.micro_batches, expert_ranks, dispatcher,
                  param_bytes, checkpointing, hw, layout.ep)  # fmt: skip
        _tensor_parallel(rows, config, layout, layer_ranges[index], index == 0, index == layout.pp - 1, batch,
                         dims.ranks("tp", first), param_bytes, checkpointing, hw)  # fmt: skip
        _context_parallel(rows, config, layout, layer_ranges[index], index == layout.pp - 1, whole,
                          dims.ranks("cp", first), param_bytes, checkpointing, hw)  # fmt: skip
        activation = batch.tokens // layout.sequence_split * config.hidden_size * param_bytes
        for tag, neighbour in (("pp.send_forward", index + 1), ("pp.send_backward", index - 1)):
            if 0 <= neighbour < layout.pp:  # a point-to-point send, as a 2-rank all-to-all keeping nothing
                pair = [first, neighbour * stage_size]
                rows.add(tag, "all_to_all", pair, None, hw, batch.micro_batches, activation, ledger=False)
        out.append(list(rows.rows.values()))
    return out


def bytes_per_link(collectives: list[Collective]) -> dict[str, int]:
    """Bytes sent per hardware level (``gcd``, ``intra_node``, ``inter_node``) over a step."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.link] = out.get(c.link, 0) + c.bytes_sent
    return out
