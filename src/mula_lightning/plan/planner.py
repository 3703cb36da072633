"""One layout planned: memory by kind per pipeline stage (worst rank), whether it fits, bytes per collective per link,
predicted step time (:mod:`~mula_lightning.plan.step_time`).

Puts :mod:`~mula_lightning.plan.states` (model states), :mod:`~mula_lightning.plan.activations` (what a micro-batch
keeps, times what the schedule holds) and :mod:`~mula_lightning.plan.comm` (the ledger's bytes) together with the
communication buffers of the strategy and the cluster's reserved memory. ``mula plan`` prints what this returns.

Communication buffers and the step's other transients (compared with a measured step in ``benchmarks/memory.py``):

* ``epso``: the larger of backward's (the gradient reduction's output shards, ``owned x reduce bytes``; when
  gradients travel in another dtype than their float32 buffers, ``reduce_dtype=bfloat16``, the cast copies of the
  buckets whose reductions are in flight, at most ``COPIES_IN_FLIGHT`` of the sharded optimizer's; the largest
  parameter's whole gradient before its hook adds it to the buffer) and the optimizer step's (nothing where the
  library gathers in place, else a temporary of every bucket's gathered weights, all in flight together: gloo);
* ``zero_topo``: the root unit (embedding, final norm, head) gathered from the model's forward to the end of its
  backward with its float32 gradient, a layer and the previous one (prefetched) gathered with that layer's float32
  gradient, and the largest parameter's whole gradient.

The reserved memory (:attr:`~mula_lightning.plan.clusters.Cluster.reserved_bytes`: the runtime's context, the
collective library's own buffers, the allocator's fragmentation) is subtracted from the device before "fits".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.pipeline import stage_layer_ranges
from mula_lightning.parallel.sharded_optimizer import COPIES_IN_FLIGHT
from mula_lightning.plan.activations import rank_layers, stage_activation_bytes
from mula_lightning.plan.clusters import GB, Cluster
from mula_lightning.plan.comm import REDUCE_BYTES, Batch, bytes_per_link, comm_bytes
from mula_lightning.plan.muon import stage_muon
from mula_lightning.plan.states import PRECISIONS, Layout, epso_families, layer_counts, stage_params, state_bytes
from mula_lightning.plan.step_time import predict_step

MEMORY_KINDS = ("weights", "gradients", "master", "moments", "activations", "buffers", "total")


@dataclass(frozen=True)
class Training:
    """What a step computes and how (the ``mula fit`` YAML's data, trainer and strategy settings).

    Attributes:
        micro_batch_size: sequences per rank per forward (with pipelining: per rank per step, cut into
            ``micro_batches`` by the schedule).
        seq_len: tokens per sequence.
        micro_batches: ``accumulate_grad_batches``, or the pipeline's ``pp_microbatches``.
        checkpointing: ``activation_checkpointing`` (None, ``"full"`` or a list of parts).
        dispatcher: ``"allgather"`` or ``"alltoall"``.
        reduce_dtype: ``epso``'s gradient reduction dtype.
        schedule / virtual: the pipeline schedule and virtual stages per rank.
        imbalance: routing headroom: rows the busiest rank's experts compute, over the balanced ``S x K``.
        bucket_numel: ``epso``'s elements per communication bucket (None: one bucket per family).
    """

    micro_batch_size: int = 1
    seq_len: int = 2048
    micro_batches: int = 1
    checkpointing: Any = None
    dispatcher: str = "allgather"
    reduce_dtype: str = "float32"
    schedule: str = "1f1b"
    virtual: int = 1
    imbalance: float = 1.25
    bucket_numel: int | None = 40_000_000

    def batch(self, pp: int) -> Batch:
        """The micro-batches one rank computes per step."""
        if pp > 1:
            if self.schedule != "gpipe" and self.micro_batches < pp:
                raise ValueError(
                    f"pp_microbatches ({self.micro_batches}) must be at least pp_size ({pp}) for {self.schedule}"
                )
            if self.micro_batch_size % self.micro_batches:
                raise ValueError(
                    f"pp_microbatches ({self.micro_batches}) must divide the micro_batch_size "
                    f"({self.micro_batch_size}) the schedule cuts"
                )
            return Batch(self.micro_batch_size // self.micro_batches, self.seq_len, self.micro_batches)
        return Batch(self.micro_batch_size, self.seq_len, self.micro_batches)


def _largest_parameter(config: MulaConfig, layout: Layout, stage: int) -> int:
    """Elements of the largest gradient a pipeline stage's backward holds whole for a moment before the hooks take it
    into the flat buffers: the embedding's, the head's, or a layer's experts' (the grouped backward produces the
    gate / up and down projections' gradients together)."""
    h, counts = config.hidden_size, layer_counts(config)
    layers = stage_layer_ranges(config.num_layers, layout.pp)[stage]
    largest = config.vocab_size // layout.tp * h if stage in (0, layout.pp - 1) else 0
    if any(counts[i].moe for i in layers):
        experts = config.num_experts // layout.ep * 3 * config.intermediate_size // layout.etp * h
        largest = max(largest, experts)
    if any(not counts[i].moe for i in layers):
        largest = max(largest, config.dense_width // layout.tp * h)
    return largest


def _buffers(config: MulaConfig, layout: Layout, cluster: Cluster, states: dict[str, int], stage: Any, index: int,
             training: Training, muon_elements: int = 0) -> int:  # fmt: skip
    param_bytes = PRECISIONS[layout.precision]
    largest = _largest_parameter(config, layout, index) * param_bytes
    if layout.strategy == "epso":
        reduce = REDUCE_BYTES[training.reduce_dtype]
        owned = (states["moments"] - 4 * muon_elements) // 8 + muon_elements  # Muon's momentum: 4 bytes an element
        local = round(sum(epso_families(stage, layout).values()))
        copies = min(local, COPIES_IN_FLIGHT * training.bucket_numel) if training.bucket_numel else local
        backward = owned * reduce + (copies * reduce if reduce != 4 else 0) + largest
        step = 0 if cluster.inplace_all_gather else local * param_bytes  # every bucket's gather in flight at once
        return max(backward, step)
    layers = layer_counts(config)
    layer = max(c.non_expert + c.expert // layout.ep for c in layers)
    root = stage.non_expert - sum(c.non_expert for c in layers)
    # in backward: the root unit (embedding, final norm, head) stays gathered from the model's forward to the end of
    # its backward, its float32 gradient accumulating until the embedding's arrives; a layer and the previous one
    # (prefetched) gathered, that layer's float32 gradient, and one parameter's whole gradient before its hook
    return root * (param_bytes + 4) + layer * (2 * param_bytes + 4) + largest


def plan_layout(config: MulaConfig, layout: Layout, cluster: Cluster, training: Training,
                hw: HardwareTopology | None = None) -> dict[str, Any]:  # fmt: skip
    """The plan of one layout: per pipeline stage memory by kind, the worst stage, fits (and why not), the bytes
    per collective and per link of the worst stage's first rank, the predicted step (JSON-ready). ``hw``: the
    cluster's ranks at the layout's world size, when the caller has it already."""
    layout.check(config)
    if training.dispatcher not in ("allgather", "alltoall"):
        raise ValueError(f"dispatcher ({training.dispatcher!r}) must be 'allgather' or 'alltoall'")
    if layout.cp > 1:
        from mula_lightning.parallel.context_parallel import check_sequence_length

        check_sequence_length(training.seq_len, layout.cp)
    if layout.sp and training.seq_len // layout.cp % layout.tp:
        cut = f" / cp ({layout.cp}) = {training.seq_len // layout.cp}" if layout.cp > 1 else ""
        raise ValueError(
            f"sequence parallelism splits each sequence over tp ({layout.tp}) ranks: the sequence length "
            f"({training.seq_len}){cut} must be divisible by it"
        )
    batch = training.batch(layout.pp)
    param_bytes = PRECISIONS[layout.precision]
    hw = hw or HardwareTopology.uniform(layout.world_size, cluster.devices_per_node, cluster.devices_per_gpu)
    states = state_bytes(config, layout)
    activations = stage_activation_bytes(
        config, layout.pp, batch.micro_batch_size, batch.seq_len, batch.micro_batches, param_bytes, layout.ep,
        training.dispatcher, training.checkpointing, training.imbalance, training.schedule, training.virtual,
        layout.tp, layout.sp, layout.etp, layout.cp,
    )  # fmt: skip
    comms = comm_bytes(config, layout, batch, hw, training.dispatcher, training.reduce_dtype, training.checkpointing)
    muon = None
    if layout.optimizer == "muon":  # the busiest owner of each stage: its Muon elements and Newton-Schulz FLOPs
        shares = stage_muon(config, layout.pp, layout.stage_size, layout.ep, layout.mode)
        worst = [share.worst(layout.stage_size) for share in shares]
        muon = {"elements": [w[0] for w in worst], "newton_schulz_flops": [w[1] for w in worst]}
    stages = []
    for state, act, stage in zip(states, activations, stage_params(config, layout.pp)):
        row = {k: state[k] for k in ("weights", "gradients", "master", "moments")}
        row["activations"] = act["activations"]
        row["buffers"] = _buffers(config, layout, cluster, state, stage, len(stages), training,
                                  muon["elements"][len(stages)] if muon else 0)  # fmt: skip
        row["total"] = sum(row.values())
        stages.append(row)
    layers = [rank_layers(config, layout.pp, training.virtual, rank) for rank in range(layout.pp)]
    batches = layout.batches  # every tp x cp group of a stage reads its own batch (EP ranks too)
    time = predict_step(config, cluster, layout.world_size, layout.pp, batches, batch, layers, comms,
                        training.checkpointing, training.imbalance, training.virtual, layout.tp, layout.sp,
                        max(muon["newton_schulz_flops"]) if muon else 0.0, layout.cp)  # fmt: skip
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    usable = cluster.memory_bytes - cluster.reserved_bytes
    fits = stages[worst]["total"] <= usable
    reason = None
    if not fits:
        reason = (
            f"stage {worst} needs {stages[worst]['total'] / GB:.1f} GB per rank; the device has {usable / GB:.1f} GB "
            f"({cluster.memory_bytes / GB:.0f} GB less {cluster.reserved_bytes / GB:.0f} GB reserved)"
        )
    return {
        "dp": layout.dp, "ep": layout.ep, "etp": layout.etp, "tp": layout.tp, "pp": layout.pp,
        "sp": layout.sp, "cp": layout.cp, "dense_dp": layout.dense_dp,
        "strategy": layout.strategy, "mode": layout.mode if layout.strategy == "epso" else None,
        "optimizer": layout.optimizer, "muon": muon,
        "precision": layout.precision, "micro_batch_size": training.micro_batch_size, "seq_len": training.seq_len,
        "sequences_per_micro_batch": batch.micro_batch_size,
        "micro_batches": training.micro_batches, "activation_checkpointing": training.checkpointing,
        "dispatcher": training.dispatcher, "imbalance": training.imbalance,
        "fits": fits, "reason": reason, "worst_stage": worst,
        "memory_bytes": stages[worst], "stages": stages,
        "activations": activations,
        "comm_bytes": bytes_per_link(comms[worst]),
        "collectives": [c.as_dict() for c in comms[worst]],
        "step_time_s": time["step_time_s"], "tokens_per_s": time["tokens_per_s"], "mfu": time["mfu"],
        "time": time,
    }  # fmt: skip
