"""``mula plan --search``: every layout of a model on a cluster at a node count, planned, ranked by predicted step time.

The candidates (all at the same global batch, so that their step times compare):

* pipeline stages ``pp`` dividing the layers and the world (1F1B, one sequence per micro-batch: each pipeline's
  ``global batch / (world / pp)`` sequences are its micro-batches, at least ``pp`` of them);
* expert-parallel degrees ``ep`` dividing the experts and a stage's ranks (1 for a dense model);
* ``epso`` in each ``sharded_optimizer`` mode; ``epso`` ``ep_aware`` with tensor parallelism ``tp`` over a divisor of
  the node's devices that divides the heads and the vocabulary, with sequence parallelism (its activations are
  ``1 / tp`` of the norms' and MoE blocks' for the same bytes on the links), folded over the same ranks as ``ep``;
  and ``zero_topo`` (its default 3-level sizes from the node) without
  pipelining, where ``ep`` divides a node;
* context parallelism for long sequences: ``epso`` ``ep_aware`` with each ``cp`` dividing a stage's ranks for which
  each of a sequence's ``2 cp`` chunks keeps at least :data:`CP_MIN_CHUNK` tokens (at 2,048 tokens and below no CP;
  8K: CP 2; 32K: up to 8), alone and beside tensor and sequence parallelism, folded over the same ranks as ``ep``;
* with ``optimizer="muon"``: ``epso`` without tensor parallelism only (what Muon runs under);
* recomputation: none, the FFN blocks (``moe`` or ``mlp``), norms + attention + FFN (the paper's 220B choice), whole
  layers; without pipelining one sequence per forward, the rest accumulated.

A candidate that cannot run (sizes that do not divide, too few micro-batches) or does not fit the device is kept with
its reason; the others are ranked by :mod:`~mula_lightning.plan.step_time`'s prediction.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.tensor_parallel import check_tensor_parallel
from mula_lightning.plan.clusters import Cluster
from mula_lightning.plan.planner import Training, plan_layout
from mula_lightning.plan.states import EPSO_MODES, Layout

#: the fewest tokens of a context-parallel chunk the search tries (a rank's two chunks then keep its matmuls as large
#: as a 4,096-token sequence's; shorter sequences are searched without CP)
CP_MIN_CHUNK = 2048


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def recomputation_choices(config: MulaConfig) -> list[Any]:
    """None, the FFN blocks, norms + attention + FFN, whole layers."""
    ffn = "moe" if config.is_moe else "mlp"
    return [None, [ffn], ["norm", "attention", ffn], "full"]


def candidates(config: MulaConfig, cluster: Cluster, nodes: int, precision: str = "bf16-true",
               max_pp: int = 16, seq_len: int | None = None, optimizer: str = "adamw") -> Iterator[Layout]:  # fmt: skip
    """Every (strategy, mode, pp, ep, tp, cp) layout of ``nodes`` nodes (see the module docstring); ``seq_len``: only
    the ``tp`` degrees sequence parallelism can split it over, the ``cp`` degrees its length calls for."""
    world = nodes * cluster.devices_per_node
    common = dict(
        world_size=world,
        precision=precision,
        optimizer=optimizer,
        ranks_per_node=cluster.devices_per_node,
        ranks_per_gpu=cluster.devices_per_gpu,
    )
    tensor_parallel = []
    for tp in _divisors(cluster.devices_per_node)[1:] if optimizer == "adamw" else []:
        try:
            check_tensor_parallel(config, tp)
        except ValueError:
            continue
        if seq_len is None or seq_len % tp == 0:
            tensor_parallel.append(tp)
    context_parallel = [cp for cp in _divisors(world)[1:]
                        if seq_len and seq_len % (2 * cp) == 0 and seq_len // (2 * cp) >= CP_MIN_CHUNK]  # fmt: skip
    for pp in _divisors(config.num_layers, min(max_pp, config.num_layers)):
        if world % pp:
            continue
        for ep in _divisors(config.num_experts) if config.is_moe else [1]:
            if (world // pp) % ep:
                continue
            for mode in EPSO_MODES:
                yield Layout(strategy="epso", ep=ep, pp=pp, mode=mode, **common)
            for tp in tensor_parallel:
                if (world // pp) % tp == 0:
                    yield Layout(strategy="epso", ep=ep, pp=pp, tp=tp, sp=True, **common)
            if pp == 1 and cluster.devices_per_node % ep == 0 and optimizer == "adamw":
                yield Layout(strategy="zero_topo", ep=ep, **common)
            for cp in context_parallel:
                for tp in [1] + tensor_parallel:
                    if world % (pp * cp * tp) == 0 and seq_len // cp % tp == 0:
                        yield Layout(strategy="epso", ep=ep, pp=pp, cp=cp, tp=tp, sp=tp > 1, **common)


def search(config: MulaConfig, cluster: Cluster, nodes: int, global_batch: int | None = None, seq_len: int = 2048,
           precision: str = "bf16-true", training: Training | None = None,
           optimizer: str = "adamw") -> dict[str, Any]:  # fmt: skip
    """Plan every candidate; ``{"layouts": fitting ones by step time, "rejected": [{..., "reason"}]}``.

    Args:
        global_batch: sequences per optimizer step (default: one per rank, the Aurora recipes' 3072 on 256 nodes).
        training: dispatcher, gradient reduction dtype and routing headroom (its batch fields are set per layout).
        optimizer: ``"adamw"`` or ``"muon"`` (the layouts it runs under).
    """
    world = nodes * cluster.devices_per_node
    global_batch = global_batch or world
    base = training or Training()
    fitting, rejected = [], []
    hw = HardwareTopology.uniform(world, cluster.devices_per_node, cluster.devices_per_gpu)
    for layout in candidates(config, cluster, nodes, precision, seq_len=seq_len, optimizer=optimizer):
        batches = layout.batches
        for checkpointing in recomputation_choices(config):
            summary = {
                "strategy": layout.strategy,
                "mode": layout.mode if layout.strategy == "epso" else None,
                "dp": layout.dp,
                "ep": layout.ep,
                "pp": layout.pp,
                "tp": layout.tp,
                "cp": layout.cp,
                "activation_checkpointing": checkpointing,
            }
            if global_batch % batches:
                rejected.append(
                    {
                        **summary,
                        "reason": f"the global batch ({global_batch}) does not divide into "
                        f"{batches} batches (world {world} / (pp {layout.pp} x tp {layout.tp}"
                        + (f" x cp {layout.cp}" if layout.cp > 1 else "")
                        + "))",
                    }
                )
                continue
            sequences = global_batch // batches
            micro = replace(
                base,
                micro_batch_size=sequences if layout.pp > 1 else 1,
                seq_len=seq_len,
                micro_batches=sequences,
                checkpointing=checkpointing,
                schedule="1f1b",
                virtual=1,
            )
            try:
                planned = plan_layout(config, layout, cluster, micro, hw)
            except ValueError as error:
                rejected.append({**summary, "reason": str(error)})
                continue
            if planned["fits"]:
                fitting.append(planned)
            else:
                rejected.append({**summary, "reason": planned["reason"]})
    fitting.sort(key=lambda p: p["step_time_s"])
    return {"layouts": fitting, "rejected": rejected, "global_batch": global_batch, "seq_len": seq_len,
            "optimizer": optimizer}  # fmt: skip
