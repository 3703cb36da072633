"""Every group root and rank index of every layout the strategies accept, for every rank of every world size up to 64,
computed without starting a process.

Why: a root computed from the wrong sizes only shows at some world size (a broadcast from "root rank 8 of 8" reached a
user at 8 ranks). Here each rank's roots and indices are checked against an independent construction of the rank
order: the dense side ``pp x dp x tp`` and the MoE side ``pp x edp x ep x etp`` (row-major, ``pp`` outermost), and the
hierarchical ZeRO layout's groups of consecutive ranks.
"""

import itertools

from mula_lightning.parallel.topology import MoETopology
from mula_lightning.parallel.zero.layout import ZeroTopoLayout

WORLDS = range(1, 65)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def test_every_root_and_index_of_every_epso_layout_up_to_64_ranks():
    """For every world size up to 64 and every pp, tp, ep, etp that divide it as the strategies require: each rank's
    stage root, expert root (its expert part's ``dp_rank == 0`` replica), dense data-parallel root (the stage's rank of
    its ``tp`` index) and its ranks along every dimension agree with the row-major rank order, and every root is a
    rank of the world that holds the same part."""
    layouts = 0
    for world in WORLDS:
        for pp in _divisors(world):
            stage = world // pp
            for tp, ep, etp in itertools.product(_divisors(stage), repeat=3):
                if stage % (ep * etp):
                    continue
                layouts += 1
                edp = stage // (ep * etp)
                for rank in range(world):
                    t = MoETopology(dp_size=edp, ep_size=ep, rank=rank, tp_size=tp, etp_size=etp, pp_size=pp)
                    p, inner = divmod(rank, stage)
                    e_dp, rest = divmod(inner, ep * etp)
                    e_ep, e_etp = divmod(rest, etp)
                    d_dp, d_tp = divmod(inner, tp)
                    where = f"world {world} pp {pp} tp {tp} ep {ep} etp {etp} rank {rank}"
                    assert (t.pp_rank, t.stage_rank, t.stage_root) == (p, inner, p * stage), where
                    assert (t.dp_rank, t.ep_rank, t.etp_rank) == (e_dp, e_ep, e_etp), where
                    assert (t.dense_dp_rank, t.tp_rank) == (d_dp, d_tp), where
                    assert t.expert_root == p * stage + e_ep * etp + e_etp < world, where  # edp index 0, same part
                    assert t.stage_root + t.tp_rank == p * stage + d_tp < world, where  # dense dp index 0, same tp
                    if etp == 1:
                        assert t.ep_ranks() == [p * stage + e_dp * ep + i for i in range(ep)], where
                        assert t.dp_ranks() == [p * stage + i * ep + e_ep for i in range(edp)], where
                        assert rank in t.ep_ranks() and rank in t.dp_ranks(), where
    assert layouts > 1000


def _zero_layouts(world):
    """The paper's default sizes for every ranks-per-node / per-GPU split, and every explicit sizes (ranks per GPU
    only set the defaults, so they are left at 1 there)."""
    for per_node in _divisors(world):
        for per_gpu in _divisors(per_node):
            yield ZeroTopoLayout(world, per_node, per_gpu)
        for w in _divisors(world):
            for g in (g for g in _divisors(world) if g % w == 0):
                for o in (o for o in _divisors(world) if o % g == 0):
                    for s in {w, per_node}:
                        try:
                            yield ZeroTopoLayout(world, per_node, 1, w, g, o, s)
                        except ValueError:
                            continue


def test_every_group_of_every_zero_topo_layout_up_to_64_ranks():
    """For every world size up to 64, every ranks-per-node / per-GPU split and every group sizes the dependency rule
    accepts: each kind of group (weight, secondary, gradient, cross-node gradient, post-step) partitions the world's
    ranks, every rank is in its own group of each kind, the weight-replica groups (where setup reads a chunk once)
    partition the world too, and each rank's chunk positions lie inside their group sizes."""
    layouts = 0
    for world in WORLDS:
        for lay in _zero_layouts(world):
            layouts += 1
            everyone = list(range(world))
            kinds = lay.all_groups()
            own = {"weight": lay.weight_ranks, "secondary": lay.secondary_ranks, "grad": lay.grad_ranks,
                   "grad_cross": lay.grad_cross_ranks, "post_step": lay.post_step_ranks}  # fmt: skip
            for kind, groups in kinds.items():
                assert sorted(r for g in groups for r in g) == everyone, (lay, kind)  # a partition of the world
                created = {tuple(g) for g in groups}
                for rank in everyone:  # the group a rank uses is one every rank created, and holds the rank
                    mine = own[kind](rank)
                    assert rank in mine and tuple(mine) in created, (lay, kind, rank)
            assert sorted(r for g in lay.weight_replica_groups() for r in g) == everyone, lay
            for rank in everyone:
                pos = lay.positions(rank)
                assert 0 <= pos.weight < lay.weight_size and 0 <= pos.grad < lay.grad_size, (lay, rank)
                assert 0 <= pos.optimizer < lay.optimizer_size and 0 <= pos.secondary < lay.secondary_size, (lay, rank)
    assert layouts > 500
