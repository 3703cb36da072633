"""One rank layout for every parallel dimension, dense and MoE folded over the same ranks, as DeviceMeshes.

MoE parallel folding (the Llama-3 upcycling paper, Megatron-Core): the dense layers (attention, dense MLPs, norms,
embeddings) and the MoE layers are laid out independently over the ranks of one pipeline stage::

    world = pp * stage,   stage = dp * cp * tp   (dense)   = edp * ep * etp   (MoE)

    dense rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i          # tp innermost
    MoE rank   = ((pp_i * edp + edp_i) * ep + ep_i) * etp + etp_i      # etp innermost, then ep

Innermost dimensions are consecutive ranks, the ranks of one node on a real machine, so the communication-heavy
groups of both sides (TP's activation all-reduces, EP's token all-gathers / all-to-alls) stay inside a node while
the gradient reductions (dp, edp) cross nodes. Expert parallelism borrows its ranks from dp and tp: ``ep`` is not
a factor of the world size beside them, and ``edp`` is whatever is left of the stage.

Each side is one ``DeviceMesh`` (``init_device_mesh``) whose dimensions are the sizes above that are larger than 1
(a size-1 dimension creates no process group: :meth:`ParallelMesh.group` returns None for it, and callers skip
collectives of one rank). The communication ledger derives each group's level (GCD pair / node / inter-node) from
its ranks, so it needs nothing from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mula_lightning.utils.dist import is_distributed

DENSE_DIMS = ("pp", "dp", "cp", "tp")
MOE_DIMS = ("pp", "edp", "ep", "etp")

__all__ = ["DENSE_DIMS", "MOE_DIMS", "ParallelDims", "ParallelMesh", "build_parallel_mesh"]


@dataclass(frozen=True)
class ParallelDims:
    """The size of every parallel dimension over ``world_size`` ranks; ``dp`` and ``edp`` are what is left.

    Raises:
        ValueError: naming the sizes that do not divide (checked at construction, before any group exists).
    """

    world_size: int
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        sizes = {"world size": self.world_size, "pp": self.pp, "tp": self.tp, "cp": self.cp, "ep": self.ep,
                 "etp": self.etp}  # fmt: skip
        bad = [f"{k}={v}" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"parallel sizes must be positive integers, got {', '.join(bad)}")
        if self.world_size % self.pp:
            raise ValueError(f"pp ({self.pp}) must divide the world size ({self.world_size})")
        stage = self.world_size // self.pp
        if stage % (self.cp * self.tp):
            raise ValueError(
                f"cp x tp ({self.cp} x {self.tp} = {self.cp * self.tp}) must divide the ranks of a pipeline stage "
                f"({stage} = world size {self.world_size} / pp {self.pp})"
            )
        if stage % (self.ep * self.etp):
            raise ValueError(
                f"ep x etp ({self.ep} x {self.etp} = {self.ep * self.etp}) must divide the ranks of a pipeline "
                f"stage ({stage} = world size {self.world_size} / pp {self.pp}): the MoE layers fold edp x ep x etp "
                "over the same ranks as the dense layers' dp x cp x tp"
            )

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of every dense parameter (within a stage, beside cp and tp)."""
        return self.stage_size // (self.cp * self.tp)

    @property
    def edp(self) -> int:
        """Data-parallel replicas of every expert parameter (within a stage, beside ep and etp)."""
        return self.stage_size // (self.ep * self.etp)

    def sizes(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in dims)

    def side(self, name: str) -> tuple[str, ...]:
        """The dims of the side (dense or MoE) that has dimension ``name`` (``pp`` is in both: dense)."""
        if name in DENSE_DIMS:
            return DENSE_DIMS
        if name in MOE_DIMS:
            return MOE_DIMS
        raise KeyError(f"unknown parallel dimension {name!r}; the dimensions are {DENSE_DIMS} and {MOE_DIMS}")

    def _stride(self, name: str) -> tuple[int, int]:
        """(stride, size) of dimension ``name`` in its side's row-major grid of the world's ranks."""
        dims = self.side(name)
        sizes = self.sizes(dims)
        index = dims.index(name)
        return math.prod(sizes[index + 1 :]), sizes[index]

    def coordinate(self, name: str, rank: int) -> int:
        """The index of ``rank`` along dimension ``name``."""
        stride, size = self._stride(name)
        return (rank // stride) % size

    def ranks(self, name: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along dimension ``name`` (the closed form of the layout above: the
        ranks of the row-major grid that differ from ``rank`` in this coordinate only)."""
        stride, size = self._stride(name)
        first = rank - ((rank // stride) % size) * stride
        return [first + i * stride for i in range(size)]


@dataclass
class ParallelMesh:
    """The dense and MoE DeviceMeshes of :class:`ParallelDims` for this rank (None where no dimension exceeds 1)."""

    dims: ParallelDims
    rank: int = 0
    dense: Any = field(default=None, repr=False)
    moe: Any = field(default=None, repr=False)
    expert: Any = field(default=None, repr=False)  # the ep x etp group when both exceed 1 (see expert_group)
    stage: Any = field(default=None, repr=False)  # this rank's pipeline stage when pp > 1 (see stage_group)
    dense_replicas: Any = field(default=None, repr=False)  # the dp x cp ranks when both exceed 1 (see replica_group)

    def size(self, name: str) -> int:
        return getattr(self.dims, name)

    def coordinate(self, name: str) -> int:
        """This rank's index along ``name``."""
        return self.dims.coordinate(name, self.rank)

    def ranks(self, name: str) -> list[int]:
        """This rank's group along ``name``, as global ranks."""
        return self.dims.ranks(name, self.rank)

    def group(self, name: str) -> Any:
        """The process group of this rank along ``name``, or None when that dimension has size 1."""
        mesh = self.submesh(name)
        return None if mesh is None else mesh.get_group()

    def expert_group(self) -> Any:
        """The process group of the ``ep x etp`` ranks that split the experts between them (this rank's, consecutive
        ranks), which the expert dispatchers gather over; None when both are 1."""
        if self.dims.ep * self.dims.etp == 1:
            return None
        if self.dims.etp == 1:
            return self.group("ep")
        return self.group("etp") if self.dims.ep == 1 else self.expert

    def replica_group(self) -> Any:
        """The process group of the ``dp x cp`` ranks of this rank's stage that hold the same ``tp`` slice of the
        dense weights (context-parallel ranks hold parts of one batch, data-parallel ranks other batches; both
        replicate the weights); None when both are 1."""
        if self.dims.dp * self.dims.cp == 1:
            return None
        if self.dims.cp == 1:
            return self.group("dp")
        return self.group("cp") if self.dims.dp == 1 else self.dense_replicas

    def stage_group(self) -> Any:
        """The process group of this rank's pipeline stage (``world / pp`` consecutive ranks, every dimension but
        ``pp``); None when a stage is one rank. Without pipeline parallelism the stage is the world: use the default
        group."""
        if self.dims.pp == 1:
            raise ValueError("stage_group() is for pipeline-parallel layouts (pp > 1); the stage is the world")
        return self.stage

    def submesh(self, name: str) -> Any:
        """The one-dimensional DeviceMesh along ``name`` (for DTensor placements), or None at size 1."""
        side = self.dims.side(name)  # an unknown name raises here, naming the dimensions
        if self.size(name) == 1:
            return None
        return (self.dense if side == DENSE_DIMS else self.moe)[name]


def _side_mesh(device_type: str, dims: ParallelDims, names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    kept = tuple(n for n in names if getattr(dims, n) > 1)
    if not kept:
        return None
    return init_device_mesh(device_type, dims.sizes(kept), mesh_dim_names=kept)


def build_parallel_mesh(dims: ParallelDims, device_type: str | None = None) -> ParallelMesh:
    """The meshes of ``dims`` over the default process group (collective: every rank calls it with equal dims).

    Without an initialised process group the world is one process and nothing is built.

    Raises:
        ValueError: when ``dims.world_size`` is not the process group's size.
    """
    if not is_distributed():
        if dims.world_size != 1:
            raise ValueError(f"a layout of {dims.world_size} ranks needs an initialised process group of that size")
        return ParallelMesh(dims)
    import torch.distributed as dist

    from mula_lightning.utils.device import accelerator_type

    if dims.world_size != dist.get_world_size():
        raise ValueError(f"the layout is for {dims.world_size} ranks, the process group has {dist.get_world_size()}")
    device_type = device_type or accelerator_type()
    mesh = ParallelMesh(dims, rank=dist.get_rank())
    mesh.dense = _side_mesh(device_type, dims, DENSE_DIMS)
    mesh.moe = _side_mesh(device_type, dims, MOE_DIMS)
    if dims.ep > 1 and dims.etp > 1:  # every rank creates every block's group, in one order
        size = dims.ep * dims.etp
        blocks = [list(range(first, first + size)) for first in range(0, dims.world_size, size)]
        mesh.expert, _ = dist.new_subgroups_by_enumeration(blocks)
    if dims.dp > 1 and dims.cp > 1:  # the dp x cp replicas of each tp slice, every group in one order
        stride = dims.tp
        blocks = [
            [first + i * stride for i in range(dims.dp * dims.cp)]
            for stage in range(0, dims.world_size, dims.stage_size)
            for first in range(stage, stage + dims.tp)
        ]
        mesh.dense_replicas, _ = dist.new_subgroups_by_enumeration(blocks)
    if dims.pp > 1 and dims.stage_size > 1:  # the stages: pp consecutive blocks (pp is the outermost dimension)
        blocks = [list(range(first, first + dims.stage_size)) for first in range(0, dims.world_size, dims.stage_size)]
        mesh.stage, _ = dist.new_subgroups_by_enumeration(blocks)
    return mesh
