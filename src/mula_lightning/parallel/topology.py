"""The DP x EP process layout and the process groups each parameter family reduces over.

Ranks are laid out with expert parallelism innermost, so an EP group is a run of consecutive ranks (the
ranks of one node on a real machine, where all-gather / reduce-scatter of tokens is cheapest)::

    world = DP * EP,   rank = dp_rank * EP + ep_rank

    EP=2, DP=2:   ep groups  {0,1} {2,3}      (same dp_rank: they split the experts)
                  dp groups  {0,2} {1,3}      (same ep_rank: replicas of the same expert slice)

Parameter families and who holds a copy of each element:

* non-expert parameters (embeddings, attention, norms, router, LM head): every rank -> replicated over the
  whole ``world`` group of DP*EP ranks;
* expert parameters: rank r holds experts ``[ep_rank*E/EP, (ep_rank+1)*E/EP)`` -> replicated over its
  ``dp`` group of DP ranks.

The groups are the MoE side of one :class:`~mula_lightning.parallel.mesh.ParallelMesh` (its ``edp`` and ``ep``
dimensions; ``dp`` here is the mesh's ``edp``), built once by every rank; a dimension of size 1 has no group
(``None``), and every caller skips collectives over one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mula_lightning.parallel.mesh import ParallelDims, ParallelMesh, build_parallel_mesh
from mula_lightning.utils.dist import is_distributed


@dataclass
class MoETopology:
    """A DP x EP layout of the default process group.

    Attributes:
        dp_size: data-parallel degree (replicas of each expert slice).
        ep_size: expert-parallel degree (ways the experts are split).
        rank: this process's global rank.
        ep_group / dp_group / world_group: process groups (``None`` when not distributed or of size 1;
            ``world_group`` is the default group).
        mesh: the :class:`ParallelMesh` the groups come from.
    """

    dp_size: int
    ep_size: int
    rank: int = 0
    ep_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)
    world_group: Any = field(default=None, repr=False)
    mesh: ParallelMesh | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep_size

    def ep_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of the EP group of ``dp_rank`` (default: this rank's)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [d * self.ep_size + e for e in range(self.ep_size)]

    def dp_ranks(self, ep_rank: int | None = None) -> list[int]:
        """Global ranks of the DP group of ``ep_rank`` (default: this rank's)."""
        e = self.ep_rank if ep_rank is None else ep_rank
        return [d * self.ep_size + e for d in range(self.dp_size)]

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """Half-open range of global expert ids owned by this rank."""
        check_divisible(num_experts, self.ep_size, "num_experts", "ep_size")
        per = num_experts // self.ep_size
        return self.ep_rank * per, (self.ep_rank + 1) * per

    @property
    def device_mesh(self) -> Any:
        """The MoE side's ``DeviceMesh``: dims ``("edp", "ep")``, less those of size 1 (None for one rank)."""
        return self.mesh.moe if self.mesh is not None else None


def check_divisible(value: int, divisor: int, value_name: str, divisor_name: str) -> None:
    """Raise ``ValueError`` naming both values when ``divisor`` does not divide ``value``."""
    if divisor <= 0 or value % divisor:
        raise ValueError(f"{value_name} ({value}) must be divisible by {divisor_name} ({divisor})")


def build_topology(ep_size: int) -> MoETopology:
    """The DP x EP layout of the default process group, its groups taken from one ParallelMesh (collective).

    Every rank must call this with the same ``ep_size``. Without an initialised process group (one process)
    the layout is DP = EP = 1 and no group is created.

    Raises:
        ValueError: when ``ep_size`` does not divide the world size.
    """
    if not is_distributed():
        if ep_size != 1:
            raise ValueError(f"ep_size ({ep_size}) > 1 needs an initialised process group of ep_size ranks or more")
        return MoETopology(dp_size=1, ep_size=1, rank=0)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_divisible(world_size, ep_size, "world size", "ep_size")
    mesh = build_parallel_mesh(ParallelDims(world_size, ep=ep_size))
    return MoETopology(
        dp_size=world_size // ep_size,
        ep_size=ep_size,
        rank=rank,
        ep_group=mesh.group("ep"),
        dp_group=mesh.group("edp"),
        world_group=dist.group.WORLD,
        mesh=mesh,
    )
