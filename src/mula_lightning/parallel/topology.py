"""The DP x EP (x TP) process layout and the process groups each parameter family reduces over.

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

With tensor parallelism (``tp_size > 1``) the dense side of the same ranks is ``dense_dp x tp`` (tp innermost,
MoE parallel folding: the mesh's ``dp`` and ``tp``), and a third family appears:

* tensor-parallel parameters (DTensors sharded over ``tp``: attention, dense MLPs, embedding, LM head): rank r holds
  its ``1/tp`` slice -> replicated over its ``dense_dp`` group of ``world / tp`` ranks.

With expert tensor parallelism (``etp_size > 1``) the MoE side is ``dp x ep x etp`` (etp innermost): each expert
slice is further cut along its intermediate dimension over ``etp`` consecutive ranks, the ``ep x etp`` ranks of
one block form the ``expert_group`` the token dispatcher gathers over, and an expert part is replicated over ``dp``
(``world / (ep x etp)`` ranks).

With context parallelism (``cp_size > 1``) the dense side is ``dp x cp x tp``: the ``cp`` ranks of a group read one
batch and each holds two chunks of its sequences, so every dense weight is replicated over ``dp x cp`` ranks (the
``dense_dp`` group) while the gradients are averaged over the ``dp`` distinct batches only (each ``cp`` rank's gradient
is its chunks' share of its batch's); the MoE side is unchanged (``cp`` ranks serve as ``ep`` ranks: folding).

With pipeline parallelism (``pp_size > 1``) all of the above describes one pipeline *stage*: the world is
``pp`` consecutive blocks of ``stage_size`` ranks (pp outermost: stages cross nodes, the groups above stay inside
one), every stage holds different layers, so each family is replicated, sharded and broadcast within its stage
(``stage_group`` replaces the world for the non-expert family; ``stage_root`` is the stage's first rank). Only the
global gradient norm spans every stage (``world_group``), and the ``pp`` group links the ranks of equal
``stage_rank`` that pass activations to each other.

The groups come from one :class:`~mula_lightning.parallel.mesh.ParallelMesh` (``dp_size`` / ``dp_group`` here are
the mesh's ``edp``, the replicas of an expert slice; ``dense_dp_*`` and ``tp_*`` its dense side), built once by
every rank; a dimension of size 1 has no group (``None``), and every caller skips collectives over one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mula_lightning.parallel.mesh import ParallelDims, ParallelMesh, build_parallel_mesh
from mula_lightning.utils.dist import is_distributed


@dataclass
class MoETopology:
    """A DP x EP layout of the default process group, with the dense side's DP x TP folded over the same ranks.

    Attributes:
        dp_size: data-parallel degree of the experts (replicas of each expert slice; the mesh's ``edp``).
        ep_size: expert-parallel degree (ways the experts are split).
        rank: this process's global rank.
        etp_size: expert-tensor-parallel degree (ways each expert's intermediate dimension is split).
        tp_size: tensor-parallel degree of the dense layers (1: none).
        sequence_parallel: the residual stream is split over ``tp`` along the sequence (Megatron's SP).
        pp_size: pipeline stages the world is cut into (every size above is per stage).
        ep_group / dp_group / world_group / tp_group / dense_dp_group / expert_group / stage_group / pp_group: process
            groups (``None`` when not distributed or of size 1; ``world_group`` is the default group, every stage;
            ``stage_group`` this rank's stage, the default group without pipeline parallelism; ``expert_group`` is
            the ep x etp ranks the experts are split over, the ``ep_group`` itself without expert tensor
            parallelism).
        mesh: the :class:`ParallelMesh` the groups come from.
        cp_size / cp_group: context parallelism (:mod:`~mula_lightning.parallel.context_parallel`): ``cp`` consecutive
            ranks (after ``tp``) hold chunks of one batch's sequences; ``dense_dp_group`` is then the ``dp x cp``
            replicas of the dense weights, and :attr:`batches` the distinct batches a gradient is averaged over.
    """

    dp_size: int
    ep_size: int
    rank: int = 0
    ep_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)
    world_group: Any = field(default=None, repr=False)
    mesh: ParallelMesh | None = field(default=None, repr=False)
    tp_size: int = 1
    sequence_parallel: bool = False
    tp_group: Any = field(default=None, repr=False)
    dense_dp_group: Any = field(default=None, repr=False)
    etp_size: int = 1
    expert_group: Any = field(default=None, repr=False)
    pp_size: int = 1
    stage_group: Any = field(default=None, repr=False)
    pp_group: Any = field(default=None, repr=False)
    cp_size: int = 1
    cp_group: Any = field(default=None, repr=False)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (every rank without pipeline parallelism)."""
        return self.dp_size * self.ep_size * self.etp_size

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp_size

    @property
    def stage_rank(self) -> int:
        """This rank's index inside its pipeline stage."""
        return self.rank % self.stage_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (of ``pp_size``; with virtual stages, the first of its stages)."""
        return self.rank // self.stage_size

    @property
    def stage_root(self) -> int:
        """Global rank of this stage's first rank (the reader of its replicated tensors)."""
        return self.pp_rank * self.stage_size

    @property
    def dense_dp_size(self) -> int:
        """Replicas of the dense layers' weights (of a ``tp`` slice) in a stage: ``stage / tp``, the ``dp x cp``
        ranks of ``dense_dp_group``; without context parallelism the number of distinct batches per step."""
        return self.stage_size // self.tp_size

    @property
    def batches(self) -> int:
        """Distinct batches per step in a stage (``stage / (tp x cp)``): the ``tp`` ranks of a group read one batch,
        and the ``cp`` ranks hold parts of its sequences; the gradients' mean is over these."""
        return self.stage_size // (self.tp_size * self.cp_size)

    @property
    def batch_rank(self) -> int:
        """Index of this rank's batch (of :attr:`batches`)."""
        return self.stage_rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group (which chunks of the sequences it holds)."""
        return self.stage_rank // self.tp_size % self.cp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dense_dp_rank(self) -> int:
        """Index of this rank's batch: the ranks of one ``tp`` group (and of one ``pp`` group) read the same one."""
        return self.stage_rank // self.tp_size

    @property
    def tp_mesh(self) -> Any:
        """The one-dimensional ``tp`` DeviceMesh (DTensor placements of tensor-parallel weights), None at tp 1."""
        return self.mesh.submesh("tp") if self.mesh is not None else None

    @property
    def ep_rank(self) -> int:
        return self.rank // self.etp_size % self.ep_size

    @property
    def etp_rank(self) -> int:
        return self.rank % self.etp_size

    @property
    def dp_rank(self) -> int:
        return self.stage_rank // (self.ep_size * self.etp_size)

    @property
    def expert_root(self) -> int:
        """Global rank of the ``dp_rank == 0`` replica of this rank's expert part (the one that reads it)."""
        return self.stage_root + self.stage_rank % (self.ep_size * self.etp_size)

    def ep_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of the EP group of ``dp_rank`` in this stage (default: this rank's; without expert tensor
        parallelism)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [self.stage_root + d * self.ep_size + e for e in range(self.ep_size)]

    def dp_ranks(self, ep_rank: int | None = None) -> list[int]:
        """Global ranks of the DP group of ``ep_rank`` in this stage (default: this rank's; without expert tensor
        parallelism)."""
        e = self.ep_rank if ep_rank is None else ep_rank
        return [self.stage_root + d * self.ep_size + e for d in range(self.dp_size)]

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """Half-open range of global expert ids owned by this rank."""
        check_divisible(num_experts, self.ep_size, "num_experts", "ep_size")
        per = num_experts // self.ep_size
        return self.ep_rank * per, (self.ep_rank + 1) * per

    @property
    def device_mesh(self) -> Any:
        """The MoE side's ``DeviceMesh`` of this stage: dims ``("edp", "ep")``, less those of size 1 (None for one
        rank or when both are 1)."""
        if self.mesh is None or self.mesh.moe is None:
            return None
        names = tuple(n for n in self.mesh.moe.mesh_dim_names if n != "pp")
        if not names:
            return None
        return self.mesh.moe if len(names) == len(self.mesh.moe.mesh_dim_names) else self.mesh.moe[names]


def check_divisible(value: int, divisor: int, value_name: str, divisor_name: str) -> None:
    """Raise ``ValueError`` naming both values when ``divisor`` does not divide ``value``."""
    if divisor <= 0 or value % divisor:
        raise ValueError(f"{value_name} ({value}) must be divisible by {divisor_name} ({divisor})")


def build_topology(
    ep_size: int, tp_size: int = 1, sequence_parallel: bool = False, etp_size: int = 1, pp_size: int = 1,
    cp_size: int = 1,
) -> MoETopology:  # fmt: skip
    """The (PP x) DP x EP (x TP) layout of the default process group, its groups taken from one ParallelMesh
    (collective).

    Every rank must call this with the same sizes. Without an initialised process group (one process) the layout
    is DP = EP = TP = PP = 1 and no group is created.

    Raises:
        ValueError: when ``pp_size`` does not divide the world size, or ``ep_size``, ``tp_size`` or ``ep_size x
            etp_size`` does not divide a stage's ranks (naming them).
    """
    if not is_distributed():
        sizes = (("ep_size", ep_size), ("tp_size", tp_size), ("etp_size", etp_size), ("pp_size", pp_size),
                 ("cp_size", cp_size))  # fmt: skip
        for name, size in sizes:
            if size != 1:
                raise ValueError(f"{name} ({size}) > 1 needs an initialised process group of {name} ranks or more")
        return MoETopology(dp_size=1, ep_size=1, rank=0)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_divisible(world_size, pp_size, "world size", "pp_size")
    stage = world_size // pp_size
    check_divisible(stage, ep_size, "the ranks of a pipeline stage" if pp_size > 1 else "world size", "ep_size")
    check_divisible(stage, tp_size, "the ranks of a pipeline stage" if pp_size > 1 else "world size", "tp_size")
    mesh = build_parallel_mesh(ParallelDims(world_size, pp=pp_size, tp=tp_size, cp=cp_size, ep=ep_size, etp=etp_size))
    return MoETopology(
        dp_size=stage // (ep_size * etp_size),
        ep_size=ep_size,
        rank=rank,
        ep_group=mesh.group("ep"),
        dp_group=mesh.group("edp"),
        world_group=dist.group.WORLD,
        mesh=mesh,
        tp_size=tp_size,
        sequence_parallel=bool(sequence_parallel and tp_size > 1),
        tp_group=mesh.group("tp"),
        dense_dp_group=mesh.replica_group(),
        etp_size=etp_size,
        expert_group=mesh.expert_group(),
        pp_size=pp_size,
        stage_group=mesh.stage_group() if pp_size > 1 else dist.group.WORLD,
        pp_group=mesh.group("pp"),
        cp_size=cp_size,
        cp_group=mesh.group("cp"),
    )
