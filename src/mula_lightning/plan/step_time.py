"""Predicted step time of a layout: compute from FLOPs, the pipeline bubble, exposed communication; tokens/s and MFU.

A prediction with stated assumptions, not a measurement (``benchmarks/`` measures):

* **Compute.** Per micro-batch and pipeline stage, training FLOPs as :meth:`MulaConfig.flops_per_token` counts them
  (6 x the active matmul parameters of the stage's layers and head, 12 x ``q_dim`` x ``T`` per layer for attention)
  plus one more forward (a third) of every recomputed region; the experts' part scaled by the routing headroom (the
  busiest rank's rows gate the layer). Time at the cluster's ``peak_tflops`` x ``matmul_efficiency`` (a stated
  fraction of peak that dense bf16 GEMMs reach).
* **Pipeline bubble.** ``(m + (pp - 1) / v)`` micro-batch times of the slowest stage (1F1B and GPipe: ``v = 1``;
  interleaved 1F1B: ``v`` virtual stages), i.e. a bubble of ``(pp - 1) / v`` micro-batches.
* **Communication.** Each collective's bytes (:mod:`~mula_lightning.plan.comm`) over its link's per-rank bandwidth.
  Overlapped, and exposed only by what exceeds the compute they run beside: ``epso``'s gradient reductions
  (``optimizer.*`` reduce-scatter / all-reduce, issued bucket by bucket during the last micro-batch's backward:
  two thirds of a micro-batch's compute) and ``zero_topo``'s per-micro-batch weight prefetches and gradient
  reduce-scatters (beside the whole step's compute). Exposed in full: the token dispatch (on the critical path of
  every MoE layer), tensor parallelism's activation collectives (between every two of its matmuls), context
  parallelism's exchanges of keys and values (before every attention, and their gradients' after its backward),
  the weights' all-gather after the update, ``zero_topo``'s cross-node all-reduce and post-step gather, the gradient
  norm, and the pipeline's sends.
* **Context parallelism.** A rank computes ``1 / cp`` of every sequence's tokens, its queries over the whole
  sequence's keys (the causal load balance gives every rank the same attention work).
* **Optimizer step.** Muon's Newton-Schulz iteration on the busiest owner (:mod:`~mula_lightning.plan.muon`), at the
  same matmul rate, between the gradient reduction and the weights' gather: not overlapped. AdamW's element-wise
  update (memory-bound, a few milliseconds) is not counted.
* **MFU** = model FLOPs of the step (no recomputation) / (step time x ranks x peak).
"""

from __future__ import annotations

from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.activation_checkpointing import parse_activation_checkpointing
from mula_lightning.plan.clusters import Cluster
from mula_lightning.plan.comm import Batch, Collective
from mula_lightning.plan.states import layer_counts

#: collectives issued during the last micro-batch's backward (gradient accumulation syncs only then): they hide
#: behind that backward (two thirds of a micro-batch's compute)
LAST_BACKWARD = {
    ("optimizer.non_expert", "reduce_scatter"), ("optimizer.expert", "reduce_scatter"),
    ("optimizer.non_expert", "all_reduce"), ("optimizer.expert", "all_reduce"),
    ("optimizer.tensor_parallel", "reduce_scatter"), ("optimizer.tensor_parallel", "all_reduce"),
}  # fmt: skip
#: collectives of every micro-batch prefetched or reduced while it computes (zero_topo): they hide behind the compute
EVERY_MICRO_BATCH = {
    ("grads.reduce_scatter", "reduce_scatter"), ("grads.reduce_scatter", "all_to_all"),
    ("weights.forward", "all_gather"), ("weights.backward", "all_gather"),
}  # fmt: skip


def _layer_flops(config: MulaConfig, layer: int, tokens: int, seq_len: int, checkpointing: Any,
                 imbalance: float, tp: int = 1, sequence_parallel: bool = False) -> float:  # fmt: skip
    """Training FLOPs (forward, backward, recomputation) of one layer for ``tokens`` tokens on the busiest rank:
    with tensor parallelism attention and dense MLPs are ``1 / tp`` of it, the MoE block (router, shared and routed
    experts) works on this rank's tokens (every ``tp`` rank on all of them without sequence parallelism)."""
    h = config.hidden_size
    counts = layer_counts(config)[layer]
    parts = parse_activation_checkpointing(checkpointing) or ()
    attention = 6.0 * (counts.non_expert - 2 * h) + 12.0 * config.q_dim * seq_len  # no norms
    if counts.moe:  # the router and shared experts are in the non-expert count
        ffn_dense = config.num_experts * h + 3 * h * counts.shared_width
        attention -= 6.0 * ffn_dense
        ffn = 6.0 * ffn_dense + 6.0 * counts.expert_active * imbalance
        recomputed_ffn = parts == "full" or "moe" in parts
    else:
        ffn_params = 3 * h * config.dense_width
        attention -= 6.0 * ffn_params
        ffn = 6.0 * ffn_params
        recomputed_ffn = parts == "full" or "mlp" in parts
    recomputed_attention = parts == "full" or "attention" in parts
    attention /= tp
    ffn = ffn if counts.moe else ffn / tp
    moe_tokens = tokens / tp if counts.moe and sequence_parallel else tokens
    return tokens * attention * (4 / 3 if recomputed_attention else 1) + moe_tokens * ffn * (
        4 / 3 if recomputed_ffn else 1
    )


def stage_flops(config: MulaConfig, layers: list[int] | range, first: bool, last: bool, tokens: int, seq_len: int,
                checkpointing: Any, imbalance: float, tp: int = 1,
                sequence_parallel: bool = False) -> float:  # fmt: skip
    """Training FLOPs of one micro-batch on one rank of a stage (its layers, the head on the last)."""
    flops = sum(_layer_flops(config, i, tokens, seq_len, checkpointing, imbalance, tp, sequence_parallel)
                for i in layers)  # fmt: skip
    if last:
        flops += 6.0 * config.vocab_size * config.hidden_size * tokens / tp
    return flops


def flops_per_token(config: MulaConfig, seq_len: int) -> float:
    """:meth:`MulaConfig.flops_per_token` from the cached layer counts (equal to it; a search calls it per layout)."""
    counts = layer_counts(config)
    h = config.hidden_size
    dense = sum(c.non_expert + c.expert_active for c in counts) + h
    dense += 0 if config.tie_word_embeddings else config.vocab_size * h
    return 6.0 * dense + 12.0 * config.num_layers * config.q_dim * seq_len


def predict_step(config: MulaConfig, cluster: Cluster, world_size: int, pp: int, batches: int, batch: Batch,
                 stage_layers: list[list[int]], collectives: list[list[Collective]], checkpointing: Any,
                 imbalance: float, virtual: int = 1, tp: int = 1,
                 sequence_parallel: bool = False, optimizer_flops: float = 0.0,
                 cp: int = 1) -> dict[str, Any]:  # fmt: skip
    """Step time, its parts, tokens/s and MFU (see the module docstring).

    Args:
        stage_layers: the decoder layers of each pipeline rank.
        collectives: per pipeline stage, one step's collectives of a rank (:func:`~mula_lightning.plan.comm.
            comm_bytes`).
        batches: the distinct batches a step reads (``world / (pp x tp x cp)``: every rank of a stage, EP ranks
            included, reads its own, the ``tp x cp`` ranks of a group the same): the global batch is ``batches`` x
            the rank's.
        tp / sequence_parallel: the tensor-parallel degree and whether the sequence is split over it.
        optimizer_flops: the optimizer step's matmul FLOPs on its busiest rank (Muon's Newton-Schulz; 0: AdamW).
        cp: the context-parallel degree: a rank computes ``1 / cp`` of ``batch``'s tokens (its queries attend to
            the whole sequence's keys).
    """
    rate = cluster.peak_flops * cluster.matmul_efficiency
    per_stage = [
        stage_flops(config, layers, index == 0, index == pp - 1, batch.tokens // cp, batch.seq_len, checkpointing,
                    imbalance, tp, sequence_parallel) / rate
        for index, layers in enumerate(stage_layers)
    ]  # fmt: skip
    micro = max(per_stage)
    compute = micro * (batch.micro_batches + (pp - 1) / virtual)
    bubble = micro * (pp - 1) / virtual
    exposed = []
    for stage in collectives:
        seconds = {"exposed": 0.0, "last": 0.0, "every": 0.0}
        for c in stage:
            kind = "last" if (c.tag, c.op) in LAST_BACKWARD else "every" if (c.tag, c.op) in EVERY_MICRO_BATCH else ""
            seconds[kind or "exposed"] += c.bytes_sent / cluster.bandwidth(c.link)
        hidden_last = max(0.0, seconds["last"] - 2 / 3 * micro)
        exposed.append(seconds["exposed"] + hidden_last + max(0.0, seconds["every"] - (compute - bubble)))
    comm = max(exposed)
    optimizer = optimizer_flops / rate
    step = compute + comm + optimizer
    tokens = batches * batch.micro_batches * batch.tokens
    model_flops = flops_per_token(config, batch.seq_len) * tokens
    return {
        "step_time_s": step,
        "compute_s": compute - bubble,
        "bubble_s": bubble,
        "exposed_comm_s": comm,
        "optimizer_s": optimizer,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "mfu": model_flops / (step * world_size * cluster.peak_flops),
    }
