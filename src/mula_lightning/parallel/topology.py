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

Every group is created with ``torch.distributed.new_group`` in the same order on every rank (a collective
requirement), and the layout is also exposed as a ``DeviceMesh`` (dims ``("dp", "ep")``) for code that wants one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mula_lightning.utils.dist import is_distributed


@dataclass
class MoETopology:
    """A DP x EP layout of the default process group.

    Attributes:
        dp_size: data-parallel degree (replicas of each expert slice).
        ep_size: expert-parallel degree (ways the experts are split).
        rank: this process's global rank.
        ep_group / dp_group / world_group: process groups (``None`` when not distributed; ``world_group`` is
            the default group).
    """

    dp_size: int
    ep_size: int
    rank: int = 0
    ep_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)
    world_group: Any = field(default=None, repr=False)
    _mesh: Any = field(default=None, repr=False)

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
        """A ``DeviceMesh`` of shape (dp, ep) over the default group (built lazily)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from mula_lightning.utils.device import accelerator_type

            self._mesh = init_device_mesh(accelerator_type(), (self.dp_size, self.ep_size), mesh_dim_names=("dp", "ep"))
        return self._mesh


def check_divisible(value: int, divisor: int, value_name: str, divisor_name: str) -> None:
    """Raise ``ValueError`` naming both values when ``divisor`` does not divide ``value``."""
    if divisor <= 0 or value % divisor:
        raise ValueError(f"{value_name} ({value}) must be divisible by {divisor_name} ({divisor})")


def build_topology(ep_size: int, world_size: int | None = None, rank: int | None = None) -> MoETopology:
    """Create the EP and DP groups of a DP x EP layout of the default process group.

    Every rank must call this with the same ``ep_size``. Without an initialised process group (one process)
    the layout is DP = EP = 1 and no group is created.

    Raises:
        ValueError: when ``ep_size`` does not divide the world size.
    """
    if not is_distributed():
        if ep_size != 1:
            raise ValueError(f"ep_size ({ep_size}) > 1 needs an initialised process group of ep_size ranks or more")
        return MoETopology(dp_size=1, ep_size=1, rank=0)
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    check_divisible(world_size, ep_size, "world size", "ep_size")
    topo = MoETopology(dp_size=world_size // ep_size, ep_size=ep_size, rank=rank, world_group=dist.group.WORLD)
    for d in range(topo.dp_size):  # all ranks create all groups, in the same order
        group = dist.new_group(topo.ep_ranks(d))
        if d == topo.dp_rank:
            topo.ep_group = group
    for e in range(topo.ep_size):
        group = dist.new_group(topo.dp_ranks(e))
        if e == topo.ep_rank:
            topo.dp_group = group
    return topo
