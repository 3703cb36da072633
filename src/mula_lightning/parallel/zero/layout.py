"""Group sizes of hierarchical ZeRO (ZeRO-topo paper, Section V), their validation and the shard nesting.

Notation (Table III): ``N`` nodes of ``P`` ranks each (a rank is a GCD / GPU tile), ``G`` ranks per physical GPU.
Three state kinds are sharded over groups of consecutive ranks (consecutive ranks share a GPU, then a node):

* weights over ``w`` ranks (paper: 2, the GCDs of one MI250X), all-gathered before forward;
* a secondary copy of the weights over ``s`` ranks, ``s in {w, P}`` (Table V "Sec-Degree"), all-gathered before
  backward; it is cut from the forward all-gather, so it costs no extra communication;
* gradients over ``g`` ranks (paper: a node), reduce-scattered inside the group, then all-reduced over the
  ``world / g`` ranks that hold the same gradient shard on the other nodes;
* optimizer states over ``o`` ranks (paper: all ranks), replicated ``world / o`` times; after the update the
  ``o / w`` ranks whose optimizer shards tile one weight shard all-gather it ("post-step" group).

Dependency rule (paper, after [11]): with ``P_x = min(x, P)`` and ``N_x = x / P_x`` (every size divides ``P`` or is
a multiple of it), ``N >= N_os >= N_g >= N_w`` and ``P >= P_os >= P_g >= P_w``, and ``w | g | o | world``.

Nesting (:func:`shard_positions`, the one place it is computed): every flat buffer is cut into ``w``, ``g`` and
``o`` equal chunks; a rank's optimizer chunk lies inside its gradient chunk, which lies inside its weight chunk.
With ``l = rank % g`` and ``m = rank % o`` (positions inside its gradient / optimizer group)::

    weight chunk    p_w = rank % w
    gradient chunk  p_g = (l % w) * (g / w) + l // w          (inside weight chunk l % w = rank % w)
    optimizer chunk p_o = p_g(m % g) * (o / g) + m // g        (inside gradient chunk p_g(m % g) = p_g)
    secondary chunk p_s = rank % s

Baselines as configurations: ZeRO-3 is ``w = g = o = s = world``; ZeRO++ (hpZ) is ``w = g = o = world, s = P``;
ZeRO-topo is ``w = G, g = P, o = world, s = w``.

Expert parallelism (:func:`expert_layout`): with ``ep`` consecutive ranks splitting the experts (``ep | P``, so an EP
group stays inside a node), an expert slice is replicated over its ``world / ep`` *edp* ranks (``rank % ep`` equal,
global rank ``ep_rank + ep * k`` for edp index ``k``). They are sharded by the same three levels, each group being the
edp ranks inside the dense group of that level: ``x / ep`` of them where ``ep | x``, one (no sharding at that level)
where ``x | ep``. So an expert weight is gathered inside the same GPU / node as a dense weight of its level, never
further; the edp layout is an ordinary :class:`ZeroTopoLayout` of ``world / ep`` ranks, ``P / ep`` per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from mula_lightning.parallel.hardware import env_sizes


@dataclass(frozen=True)
class ShardPositions:
    """Chunk indices of one rank (chunk ``i`` of ``k`` is elements ``[i n / k, (i + 1) n / k)`` of a buffer)."""

    weight: int
    grad: int
    optimizer: int
    secondary: int


def _grad_position(local: int, w: int, g: int) -> int:
    return (local % w) * (g // w) + local // w


def shard_positions(rank: int, w: int, g: int, o: int, s: int) -> ShardPositions:
    """The nested chunk positions of ``rank`` (see the module docstring); sizes must satisfy ``w | g | o``."""
    if g % w or o % g:
        raise ValueError(f"shard nesting needs w | g | o, got w={w}, g={g}, o={o}")
    m = rank % o
    return ShardPositions(
        weight=rank % w,
        grad=_grad_position(rank % g, w, g),
        optimizer=_grad_position(m % g, w, g) * (o // g) + m // g,
        secondary=rank % s,
    )


def expert_layout(layout: ZeroTopoLayout, ep_size: int) -> ZeroTopoLayout:
    """The layout of the expert slices' edp ranks (see the module docstring); ``layout`` itself when ``ep_size`` is 1.

    Raises:
        ValueError: when ``ep_size`` does not divide the ranks of a node, or a group size neither divides ``ep_size``
            nor is a multiple of it (naming them).
    """
    if ep_size == 1:
        return layout
    per_node = layout.ranks_per_node
    if ep_size < 1 or per_node % ep_size:
        raise ValueError(
            f"ep_size ({ep_size}) must divide the ranks of a node ({per_node}): an expert-parallel group stays inside "
            "one node"
        )
    sizes = {
        "weight_size": layout.weight_size,
        "grad_size": layout.grad_size,
        "optimizer_size": layout.optimizer_size,
        "secondary_size": layout.secondary_size,
    }
    out = {}
    for name, size in sizes.items():
        if size % ep_size and ep_size % size:
            raise ValueError(f"{name} ({size}) must divide ep_size ({ep_size}) or be a multiple of it")
        out[name] = max(1, size // ep_size)
    per_gpu = layout.ranks_per_gpu // ep_size if layout.ranks_per_gpu % ep_size == 0 else 1
    return ZeroTopoLayout(layout.world_size // ep_size, per_node // ep_size, per_gpu, **out)


def expert_weight_replica_groups(layout: ZeroTopoLayout, ep_size: int) -> list[list[int]]:
    """The global ranks holding the same weight chunk of the same expert slice, one list per (EP rank, chunk)."""
    experts = expert_layout(layout, ep_size)
    return [edp_ranks(g, e, ep_size) for e in range(ep_size) for g in experts.weight_replica_groups()]


def edp_ranks(local_ranks: list[int], ep_rank: int, ep_size: int) -> list[int]:
    """Global ranks of edp indices ``local_ranks`` of the experts of ``ep_rank``."""
    return [ep_rank + ep_size * k for k in local_ranks]


def _split(size: int, per_node: int, name: str) -> tuple[int, int]:
    """(N_x, P_x) of a group size; raises unless the size divides the node or is a multiple of it."""
    if size <= per_node:
        if per_node % size:
            raise ValueError(f"{name} ({size}) must divide the ranks per node ({per_node}) or be a multiple of it")
        return 1, size
    if size % per_node:
        raise ValueError(f"{name} ({size}) must divide the ranks per node ({per_node}) or be a multiple of it")
    return size // per_node, per_node


@dataclass(frozen=True)
class ZeroTopoLayout:
    """Validated group sizes of a hierarchical ZeRO run (see the module docstring).

    Args:
        world_size: ranks in the run.
        ranks_per_node: ``P``.
        ranks_per_gpu: ``G`` (only for the defaults and the ledger's ``gcd`` level).
        weight_size: ``w`` (default ``G``).
        grad_size: ``g`` (default ``P``).
        optimizer_size: ``o`` (default ``world_size``).
        secondary_size: ``s`` (default ``w``); must be ``w`` or ``P``.
    """

    world_size: int
    ranks_per_node: int
    ranks_per_gpu: int = 1
    weight_size: int = 0
    grad_size: int = 0
    optimizer_size: int = 0
    secondary_size: int = 0

    def __post_init__(self) -> None:
        world, per_node, per_gpu = self.world_size, self.ranks_per_node, self.ranks_per_gpu
        if world < 1 or per_node < 1 or world % per_node or per_gpu < 1 or per_node % per_gpu:
            raise ValueError(
                f"ranks_per_node ({per_node}) must divide world_size ({world}) and ranks_per_gpu ({per_gpu}) must "
                "divide ranks_per_node"
            )
        defaults = dict(weight_size=per_gpu, grad_size=per_node, optimizer_size=world)
        for key, value in defaults.items():
            if getattr(self, key) == 0:
                object.__setattr__(self, key, value)
        if self.secondary_size == 0:
            object.__setattr__(self, "secondary_size", self.weight_size)
        w, g, o, s = self.weight_size, self.grad_size, self.optimizer_size, self.secondary_size
        if min(w, g, o, s) < 1:
            raise ValueError(f"group sizes must be >= 1, got weight {w}, grad {g}, optimizer {o}, secondary {s}")
        (n_w, p_w), (n_g, p_g) = _split(w, per_node, "weight_size"), _split(g, per_node, "grad_size")
        n_o, p_o = _split(o, per_node, "optimizer_size")
        nodes = world // per_node
        if not (nodes >= n_o >= n_g >= n_w and per_node >= p_o >= p_g >= p_w):
            raise ValueError(
                "the dependency rule N >= N_os >= N_g >= N_w, P >= P_os >= P_g >= P_w does not hold: "
                f"N={nodes}, N_os={n_o}, N_g={n_g}, N_w={n_w}; P={per_node}, P_os={p_o}, P_g={p_g}, P_w={p_w}"
            )
        if world % o or o % g or g % w:
            raise ValueError(
                f"group sizes must nest: weight_size ({w}) | grad_size ({g}) | optimizer_size ({o}) | world_size "
                f"({world})"
            )
        if s not in (w, per_node) or world % s:
            raise ValueError(
                f"secondary_size ({s}) must be the weight_size ({w}) or the ranks per node ({per_node}), and divide "
                f"world_size ({world})"
            )

    @classmethod
    def from_env(cls, world_size: int | None = None, **sizes: int) -> ZeroTopoLayout:
        """Ranks per node from ``MULA_RANKS_PER_NODE`` / ``LOCAL_WORLD_SIZE``, per GPU from ``MULA_RANKS_PER_GPU``."""
        return cls(*env_sizes(world_size), **{k: v for k, v in sizes.items() if v})

    @classmethod
    def preset(cls, name: str, world_size: int, ranks_per_node: int, ranks_per_gpu: int = 1) -> ZeroTopoLayout:
        """``"zero3"``, ``"hpz"`` (ZeRO++ secondary partition in the node) or ``"zero_topo"``."""
        w, p = world_size, ranks_per_node
        sizes = {"zero3": (w, w, w, w), "hpz": (w, w, w, p), "zero_topo": (0, 0, 0, 0)}
        if name not in sizes:
            raise ValueError(f"unknown layout preset {name!r}; known: {sorted(sizes)}")
        return cls(world_size, ranks_per_node, ranks_per_gpu, *sizes[name])

    def positions(self, rank: int) -> ShardPositions:
        """:func:`shard_positions` of ``rank`` for these sizes."""
        return shard_positions(rank, self.weight_size, self.grad_size, self.optimizer_size, self.secondary_size)

    @staticmethod
    def _block(rank: int, size: int) -> list[int]:
        start = rank - rank % size
        return list(range(start, start + size))

    def weight_ranks(self, rank: int) -> list[int]:
        return self._block(rank, self.weight_size)

    def secondary_ranks(self, rank: int) -> list[int]:
        return self._block(rank, self.secondary_size)

    def grad_ranks(self, rank: int) -> list[int]:
        return self._block(rank, self.grad_size)

    def grad_cross_ranks(self, rank: int) -> list[int]:
        """Ranks holding the same gradient chunk in the other gradient groups (the all-reduce group)."""
        return list(range(rank % self.grad_size, self.world_size, self.grad_size))

    def weight_replica_groups(self) -> list[list[int]]:
        """The ranks holding the same weight chunk, one list per chunk position (every weight group's member at
        that position): where a chunk is read once and broadcast at setup."""
        return [list(range(p, self.world_size, self.weight_size)) for p in range(self.weight_size)]

    def post_step_ranks(self, rank: int) -> list[int]:
        """Ranks of this optimizer group whose optimizer chunks tile this rank's weight chunk."""
        start = rank - rank % self.optimizer_size  # a multiple of weight_size, which divides optimizer_size
        return list(range(start + rank % self.weight_size, start + self.optimizer_size, self.weight_size))

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, in a fixed order (all ranks create them identically)."""
        kinds = {
            "weight": self.weight_ranks,
            "secondary": self.secondary_ranks,
            "grad": self.grad_ranks,
            "grad_cross": self.grad_cross_ranks,
            "post_step": self.post_step_ranks,
        }
        out: dict[str, list[list[int]]] = {}
        for kind, fn in kinds.items():
            seen: dict[tuple[int, ...], list[int]] = {}  # first-seen order; a dict keeps it linear in the world size
            for r in range(self.world_size):
                ranks = fn(r)
                seen.setdefault(tuple(ranks), ranks)
            out[kind] = list(seen.values())
        return out
