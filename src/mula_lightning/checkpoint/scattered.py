"""DP-scattered checkpoint writes and load-once-and-broadcast reads for DP x EP runs (Aurora paper, Section 4).

Writes: every replicated item of a checkpoint (a non-expert weight held by all ranks, an expert slice held by
its DP replicas) must be written by exactly one of its holders. DCP's default planner gives each such item to
the least-loaded holder, which in practice concentrates the model on the first ranks (the first node). The paper
writes model-parallel shard ``m`` from data-parallel index ``m % DP``, so shards are written from different
nodes. :class:`DPScatteredSavePlanner` does that for our layout (rank = dp_rank * EP + ep_rank):

* expert slice of EP rank ``m`` (a DTensor chunk at dim-0 offset ``m * E/EP``): written by DP index ``m % DP``,
  i.e. global rank ``(m % DP) * EP + m``;
* a non-expert tensor (or any other item every rank holds): assigned to the model-parallel shard
  ``m = crc32(key) % EP`` (so the non-expert weights are split over the shards too), then written by DP index
  ``m % DP`` like that shard;
* anything else replicated (an unexpected holder set): the holder ``crc32(key) % len(holders)``.

Optimizer shards are written by their owners and are never replicated in the plans, so they are untouched.

Reads (:func:`load_model_once`): only one rank per model shard reads weights from storage - global rank 0 for
replicated tensors, the ``dp_rank == 0`` rank of each EP group for expert slices, the ``dense_dp_rank == 0`` rank of
each TP group for tensor-parallel slices - and the replicas receive them
by broadcast (the paper's "model broadcasting": N ranks reading one file in parallel can hang a shared
filesystem). Each owner still reads its own optimizer shard, which nobody else holds.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

from torch import nn
from torch.distributed.checkpoint.planner import SavePlan

from mula_lightning.checkpoint.dcp_format import NoCopySavePlanner
from mula_lightning.parallel.parallelize import broadcast_from_readers, reads_shard
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.dist import is_distributed


def _shard_index(fqn: str, offsets: Any, sizes: Any, ep_size: int) -> int:
    """The model-parallel (EP) shard an item belongs to: an expert slice's EP rank, else a hash of its key."""
    if offsets and sizes and sizes[0] and ".experts." in f".{fqn}":
        return int(offsets[0]) // int(sizes[0]) % ep_size  # expert slices are dim-0 chunks, one per EP rank
    return zlib.crc32(fqn.encode()) % ep_size


class DPScatteredSavePlanner(NoCopySavePlanner):
    """A DCP save planner that writes model-parallel shard ``m`` from DP index ``m % DP`` (see module docstring).

    Args:
        dp_size: data-parallel degree.
        ep_size: expert-parallel (model-parallel) degree; ranks are ``dp_rank * ep_size + ep_rank`` within a
            pipeline stage.
        stage_size: ranks of one pipeline stage (consecutive; the world without pipeline parallelism): an item is
            held by the ranks of one stage only, and its writer is chosen among them as above.
    """

    def __init__(self, dp_size: int, ep_size: int, stage_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dp_size, self.ep_size = int(dp_size), int(ep_size)
        self.stage_size = int(stage_size) if stage_size else self.dp_size * self.ep_size

    def writer_of(self, fqn: str, holders: list[int], offsets: Any = None, sizes: Any = None) -> int:
        """The rank (among ``holders``) that writes an item replicated on ``holders``."""
        if len(holders) == 1:
            return holders[0]
        m = _shard_index(fqn, offsets, sizes, self.ep_size)
        rank = min(holders) // self.stage_size * self.stage_size + (m % self.dp_size) * self.ep_size + m
        if rank in holders:
            return rank
        return holders[zlib.crc32(fqn.encode()) % len(holders)]

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        holders: dict[Any, list[int]] = {}
        items: dict[Any, Any] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                holders.setdefault(item.index, []).append(rank)
                items[item.index] = item
        keep: dict[Any, int] = {}
        for index, ranks in holders.items():
            chunk = getattr(items[index].tensor_data, "chunk", None)
            offsets = None if chunk is None else list(chunk.offsets)
            sizes = None if chunk is None else list(chunk.sizes)
            keep[index] = self.writer_of(index.fqn, sorted(ranks), offsets, sizes)
        return [
            dataclasses.replace(plan, items=[item for item in plan.items if keep[item.index] == rank])
            for rank, plan in enumerate(all_plans)
        ]


class SpreadReplicasSavePlanner(NoCopySavePlanner):
    """A DCP save planner for layouts without a DP x EP grid (``zero_topo``): an item every rank holds (buffers,
    optimizer step and hyper-parameters, the metadata item) is written by rank 0, so every rank finds all of them in
    one file at load; an item a subset of ranks holds (the replicas of a primary chunk's piece in the 3-level layout)
    by one of them chosen by a hash of its key and offset, so those writes spread over the holders instead of going
    to the least-loaded rank of each plan (DCP's default, which moves small replicated items from file to file)."""

    @staticmethod
    def writer_of(index: Any, holders: list[int], world: int) -> int:
        """The rank (among ``holders``, of ``world`` ranks) that writes the item ``index`` (a DCP ``MetadataIndex``)."""
        if len(holders) in (1, world):
            return min(holders)
        key = f"{index.fqn}@{tuple(index.offset) if index.offset is not None else ()}"
        return sorted(holders)[zlib.crc32(key.encode()) % len(holders)]

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        holders: dict[Any, list[int]] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                holders.setdefault(item.index, []).append(rank)
        keep = {index: self.writer_of(index, ranks, len(all_plans)) for index, ranks in holders.items()}
        return [
            dataclasses.replace(plan, items=[item for item in plan.items if keep[item.index] == rank])
            for rank, plan in enumerate(all_plans)
        ]


def reads_model_key(name: str, topology: MoETopology, tensor: Any = None) -> bool:
    """Whether this rank reads model tensor ``name`` (``tensor``: its logical value here, which tells a
    tensor-parallel slice) from storage, else it receives it by broadcast (:func:`broadcast_model`)."""
    return reads_shard(name, tensor, topology)


def broadcast_model(model: nn.Module, topology: MoETopology) -> None:
    """Send every model tensor from its reader (see :func:`reads_model_key`) to its replicas, in place."""
    broadcast_from_readers(model, topology)


def load_model_once(model_state: dict[str, Any], topology: MoETopology) -> dict[str, Any]:
    """The part of a logical model state dict this rank must read; call :func:`broadcast_model` after the load."""
    if not is_distributed() or topology.world_size == 1:
        return model_state
    return {k: v for k, v in model_state.items() if reads_model_key(k, topology, v)}


__all__ = [
    "DPScatteredSavePlanner",
    "SpreadReplicasSavePlanner",
    "broadcast_model",
    "load_model_once",
    "reads_model_key",
]
