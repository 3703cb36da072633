"""Where ranks live: which node and which physical GPU holds every global rank, and the bandwidth level of a group.

One description of the hardware for everything that cares (the communication ledger's levels, the hierarchical ZeRO
layout's group sizes), parsed from the launcher's environment in one place (:func:`env_sizes`) or discovered with
one collective. It is beside, not part of, the process-group topologies (:class:`~mula_lightning.parallel.topology.
MoETopology`, :class:`~mula_lightning.parallel.zero.layout.ZeroTopoLayout`), which say how ranks are grouped.

Levels, from the ZeRO-topo paper's three bandwidth tiers: ``"gcd"`` (ranks on one physical GPU: the two GCDs of an
MI250X, the two tiles of an Intel Max GPU), ``"intra_node"``, ``"inter_node"``; ``"self"`` for a group of one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["LEVELS", "HardwareTopology", "env_sizes"]

#: Topology levels, narrowest first.
LEVELS = ("self", "gcd", "intra_node", "inter_node")


def env_sizes(world_size: int | None = None) -> tuple[int, int, int]:
    """``(world_size, ranks_per_node, ranks_per_gpu)`` from the launcher's variables, without communication.

    The world size is the argument, else the default group's, else ``WORLD_SIZE``, else 1; ranks per node come from
    ``MULA_RANKS_PER_NODE``, else ``LOCAL_WORLD_SIZE``, else every rank is on one node; ranks per GPU from
    ``MULA_RANKS_PER_GPU`` (default 1).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("MULA_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    per_gpu = int(os.environ.get("MULA_RANKS_PER_GPU") or 1)
    return world_size, per_node, per_gpu


@dataclass(frozen=True)
class HardwareTopology:
    """Which node and which physical GPU each global rank lives on.

    Attributes:
        nodes: node index of every global rank.
        gpus: global physical-GPU index of every global rank (ranks sharing a GPU share the index).
    """

    nodes: tuple[int, ...]
    gpus: tuple[int, ...]

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int, ranks_per_gpu: int = 1) -> HardwareTopology:
        """Consecutive ranks fill a GPU, then a node (the layout torchrun, SLURM and ``run_distributed_test`` use)."""
        if ranks_per_node < 1 or world_size % ranks_per_node or ranks_per_gpu < 1 or ranks_per_node % ranks_per_gpu:
            raise ValueError(
                f"ranks_per_node ({ranks_per_node}) must divide world_size ({world_size}) and ranks_per_gpu "
                f"({ranks_per_gpu}) must divide ranks_per_node"
            )
        return cls(
            nodes=tuple(r // ranks_per_node for r in range(world_size)),
            gpus=tuple(r // ranks_per_gpu for r in range(world_size)),
        )

    @classmethod
    def from_env(cls, world_size: int | None = None) -> HardwareTopology:
        """The uniform layout described by the launcher's variables, without any communication.

        Ranks per node come from ``MULA_RANKS_PER_NODE``, else ``LOCAL_WORLD_SIZE``, else everything is one node;
        ranks per GPU from ``MULA_RANKS_PER_GPU`` (default 1). The world size is the default group's, else
        ``WORLD_SIZE``, else 1.
        """
        return cls.uniform(*env_sizes(world_size))

    @classmethod
    def discover(cls, group: Any = None) -> HardwareTopology:
        """Learn the layout by all-gathering every rank's node name and local rank (a collective: call on all ranks).

        Works for any rank placement. The node name is ``MULA_NODE_NAME`` if set (simulated nodes), else the host
        name; nodes are numbered in order of their first rank. Communication: one ``all_gather_object`` of a short
        string and two ints per rank.
        """
        name = os.environ.get("MULA_NODE_NAME") or socket.gethostname()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        per_gpu = int(os.environ.get("MULA_RANKS_PER_GPU") or 1)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (name, local_rank, per_gpu), group=group)
        node_ids: dict[str, int] = {}
        nodes, gpus, gpu_ids = [], [], {}
        for node_name, local, rpg in gathered:
            node = node_ids.setdefault(node_name, len(node_ids))
            nodes.append(node)
            gpus.append(gpu_ids.setdefault((node, local // rpg), len(gpu_ids)))
        return cls(nodes=tuple(nodes), gpus=tuple(gpus))

    def level_of(self, ranks: Sequence[int]) -> str:
        """The narrowest level holding all ``ranks`` (global ranks): self, gcd, intra_node or inter_node."""
        if len(set(ranks)) <= 1:
            return "self"
        if len({self.gpus[r] for r in ranks}) == 1:
            return "gcd"
        if len({self.nodes[r] for r in ranks}) == 1:
            return "intra_node"
        return "inter_node"
