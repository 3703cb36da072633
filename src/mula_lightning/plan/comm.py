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
* pipeline parallelism: each micro-batch's activations sent forward and their gradients back, per stage boundary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import ring_bytes_sent
from mula_lightning.parallel.mesh import ParallelDims
from mula_lightning.parallel.pipeline import stage_layer_ranges
from mula_lightning.parallel.zero.layout import ZeroTopoLayout, expert_layout
from mula_lightning.parallel.zero.quantization import packed_bytes
from mula_lightning.plan.states import PRECISIONS, Layout, layer_counts, stage_params

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
) -> None:
    """The token dispatch of the MoE layers in ``layers`` over one step (see the module docstring)."""
    moe_layers = sum(layer_counts(config)[i].moe for i in layers)
    ep = len(ep_ranks)
    if ep < 2 or not moe_layers:
        return
    forward = moe_layers * micro_batches
    again = forward * (2 if _recomputes_moe(checkpointing) else 1)  # forward, and the recomputation's
    s, k, h = tokens, config.top_k, config.hidden_size
    if dispatcher == "allgather":
        rows.add("moe.token_count", "all_gather", ep_ranks, "ep", hw, again, (1 + ep) * 8)
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
) -> None:
    """Each family's gradient reduction and weight gather, once per step (the optimizer's table)."""
    expert = stage.expert // layout.ep
    families = [("optimizer.non_expert", stage.non_expert), ("optimizer.expert", expert)]
    for tag, numel in families:
        if not numel:
            continue
        is_expert = tag == "optimizer.expert"
        if layout.mode == "none":
            group = dp_ranks if is_expert else stage_ranks
            rows.add(tag, "all_reduce", group, None, hw, 1, numel * reduce_bytes)
            continue
        shard = dp_ranks if is_expert or layout.mode == "dp" else stage_ranks
        padded = _pad(numel, len(shard))
        rows.add(tag, "reduce_scatter", shard, None, hw, 1, padded * reduce_bytes)
        if layout.mode == "dp" and not is_expert:
            rows.add(tag, "all_reduce", ep_ranks, None, hw, 1, padded // len(shard) * reduce_bytes)
        rows.add(tag, "all_gather", shard, None, hw, 1, padded // len(shard) * param_bytes)


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
    param_bytes = PRECISIONS[layout.precision]
    dims = ParallelDims(layout.world_size, pp=layout.pp, ep=layout.ep)
    stage_size = dims.stage_size
    out = []
    layer_ranges = stage_layer_ranges(config.num_layers, layout.pp)
    levels: dict[tuple[int, ...], str] = {}
    for index, stage in enumerate(stage_params(config, layout.pp)):
        rows, first = _Rows(levels), index * stage_size
        ep_ranks = dims.ranks("ep", first)
        if layout.strategy == "zero_topo":
            _zero_topo(rows, config, layout, batch, param_bytes, hw)
        else:
            stage_ranks = list(range(first, first + stage_size))
            _epso_optimizer(rows, layout, stage, stage_ranks, dims.ranks("edp", first), ep_ranks,
                            REDUCE_BYTES[reduce_dtype], param_bytes, hw)  # fmt: skip
        _dispatch(rows, config, layer_ranges[index], batch.tokens, batch.micro_batches, ep_ranks, dispatcher,
                  param_bytes, checkpointing, hw)  # fmt: skip
        activation = batch.tokens * config.hidden_size * param_bytes
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
