"""Muon in ``mula plan``: which matrices Muon trains, which rank of a stage owns each, and what every rank then holds
and computes.

Why a module of its own: AdamW's states are even over a family's ranks (a closed form per element); Muon's are not.
:class:`~mula_lightning.parallel.sharded_muon.ShardedMuon` gives each matrix (each expert's too) whole to one rank of
its family's group, so a rank's momentum bytes and Newton-Schulz FLOPs depend on which matrices it drew, and the
busiest rank, not the average, sets the memory and the step. This module runs the same assignment on shapes alone:

* the matrices: the model built once per config on the meta device (no memory), split by
  :func:`~mula_lightning.optim.muon.muon_param_groups`'s rule (the decoder layers' matrices, experts included;
  routers, embeddings, head and norms stay AdamW's);
* the order: a stage's matrices as ShardedMuon lays them out, its parameters reversed (as backward produces their
  gradients), family by family;
* the owners: :func:`~mula_lightning.parallel.sharded_muon.partition_matrices`, contiguous ranges of balanced
  Newton-Schulz FLOPs (``ns_steps`` of :data:`~mula_lightning.optim.muon.MUON_DEFAULTS`) cut at matrix boundaries (an
  expert tensor between two experts), one per rank of the family's group
  (:func:`~mula_lightning.parallel.sharded_optimizer.family_plans`): ``muon_non_expert`` over the stage
  (``ep_aware``: shard rank = stage rank), over ``dp`` (``dp``: shard rank = ``stage_rank // ep``) or not sharded
  (``none``: every rank updates every matrix); ``muon_expert``, tensors of ``E / ep`` experts, over ``dp`` (``dp``
  and ``ep_aware``) or not sharded.

Tensor and expert tensor parallelism and ``zero_topo`` are refused by :meth:`~mula_lightning.plan.states.Layout.check`
(ShardedMuon refuses them too). The bytes on the links are AdamW's: the reduction to the owners and the gather back
move a reduce-scatter's and an all-gather's bytes, so :mod:`~mula_lightning.plan.comm` is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from mula_lightning.models.config import MulaConfig
from mula_lightning.optim.muon import MUON_DEFAULTS
from mula_lightning.parallel.params import is_expert_param
from mula_lightning.parallel.pipeline import stage_layer_ranges
from mula_lightning.parallel.sharded_muon import partition_matrices

FAMILIES = ("muon_non_expert", "muon_expert")


@dataclass(frozen=True)
class MuonMatrix:
    """One tensor Muon trains: its decoder layer, whether it holds experts, its whole shape (an expert tensor's
    first dimension is every expert of the layer)."""

    layer: int
    expert: bool
    shape: tuple[int, ...]


def muon_matrices(config: MulaConfig) -> tuple[MuonMatrix, ...]:
    """Muon's tensors of ``config``'s model in ``named_parameters`` order (cached per config)."""
    key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    if key not in _MATRICES:
        import torch

        from mula_lightning.models import MulaForCausalLM
        from mula_lightning.optim.muon import muon_param_groups

        with torch.device("meta"):
            model = MulaForCausalLM(config)
        groups = muon_param_groups(model)
        muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
        out = []
        for name, p in model.named_parameters():
            if id(p) in muon:
                layer = int(name.split("layers.", 1)[1].split(".", 1)[0])
                out.append(MuonMatrix(layer, is_expert_param(name), tuple(p.shape)))
        if len(_MATRICES) >= 16:
            _MATRICES.pop(next(iter(_MATRICES)))
        _MATRICES[key] = tuple(out)
    return _MATRICES[key]


_MATRICES: dict[str, tuple[MuonMatrix, ...]] = {}


@dataclass(frozen=True)
class StageMuon:
    """Muon's share of one pipeline stage's ranks.

    Attributes:
        non_expert / expert: Muon's elements of the stage (the expert ones of all experts, before EP cuts them).
        elements / flops: per family, per rank of the family's group (its shard rank), the elements it owns and the
            Newton-Schulz FLOPs of one step.
        ep / shard_by: the layout's EP, and per family how a stage rank maps to its shard rank (``"stage"``,
            ``"dp"``: ``stage_rank // ep``, ``"all"``: one group of one rank holding everything).
    """

    non_expert: int
    expert: int
    elements: dict[str, list[int]]
    flops: dict[str, list[float]]
    ep: int
    shard_by: dict[str, str]

    def shard_rank(self, family: str, stage_rank: int) -> int:
        by = self.shard_by[family]
        return stage_rank if by == "stage" else stage_rank // self.ep if by == "dp" else 0

    def rank_elements(self, stage_rank: int) -> int:
        """Muon elements ``stage_rank`` owns (its momentum, and its master for half-precision weights)."""
        return sum(self.elements[f][self.shard_rank(f, stage_rank)] for f in FAMILIES)

    def rank_flops(self, stage_rank: int) -> float:
        """Newton-Schulz FLOPs of ``stage_rank`` per optimizer step."""
        return sum(self.flops[f][self.shard_rank(f, stage_rank)] for f in FAMILIES)

    def worst(self, stage_size: int) -> tuple[int, float]:
        """The most elements and the most FLOPs of any rank of the stage (each its own rank)."""
        ranks = range(stage_size)
        return max(map(self.rank_elements, ranks)), max(map(self.rank_flops, ranks))


def stage_muon(config: MulaConfig, pp: int, stage_size: int, ep: int, mode: str) -> list[StageMuon]:
    """Per pipeline stage, Muon's share of its ranks at ``pp`` stages of ``stage_size`` ranks, ``ep`` and
    ``epso``'s ``mode`` (see the module docstring).

    Raises:
        ValueError: for a mode ShardedMuon does not know.
    """
    dp = stage_size // ep
    shard_by = {
        "none": {"muon_non_expert": "all", "muon_expert": "all"},
        "dp": {"muon_non_expert": "dp", "muon_expert": "dp"},
        "ep_aware": {"muon_non_expert": "stage", "muon_expert": "dp"},
    }.get(mode)
    if shard_by is None:
        raise ValueError(f"epso's sharded_optimizer ({mode!r}) must be 'none', 'dp' or 'ep_aware'")
    sizes = {"stage": stage_size, "dp": dp, "all": 1}
    steps = MUON_DEFAULTS["ns_steps"]
    matrices = muon_matrices(config)
    out = []
    for layers in stage_layer_ranges(config.num_layers, pp):
        mine = [m for m in matrices if m.layer in layers]
        elements, flops = {}, {}
        for family in FAMILIES:
            # the flat buffer's order: the stage's parameters reversed; an expert tensor holds E / ep experts
            shapes = [
                (m.shape[0] // ep, *m.shape[1:]) if m.expert else m.shape
                for m in reversed(mine)
                if m.expert == (family == "muon_expert")
            ]
            cuts, flops[family] = partition_matrices(shapes, sizes[shard_by[family]], steps)
            elements[family] = [b - a for a, b in zip(cuts, cuts[1:])]
        out.append(
            StageMuon(
                non_expert=sum(math.prod(m.shape) for m in mine if not m.expert),
                expert=sum(math.prod(m.shape) for m in mine if m.expert),
                elements=elements,
                flops=flops,
                ep=ep,
                shard_by=shard_by,
            )
        )
    return out
