"""The sharded Muon of ``epso`` (:mod:`mula_lightning.parallel.sharded_muon`): owners balanced by Newton-Schulz cost,
whole matrices per owner, the uneven reductions it runs on, and what it refuses. Its training against one process
(every layout, every loop) is the loop tester's Muon layouts (``tests/testing/test_conformance.py``,
``tests/testing/test_trainer_conformance.py``) and the pipeline test's Muon layout."""

import math
import random
import types

import pytest
import torch
from torch import nn

from mula_lightning.optim.muon import MuonAdamW, newton_schulz_flops
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.sharded_muon import ShardedMuon, partition_matrices
from mula_lightning.testing import run_pooled_test


def _nearest_cuts_reference(shapes, ranks):
    """The rule spelled out: every matrix boundary's cumulative cost, and for each share ``r / ranks`` of the total
    the boundary nearest to it (ties to the earlier), never before the previous cut."""
    boundaries, costs = [0], [0.0]
    for shape in shapes:
        *batch, rows, cols = shape
        for _ in range(math.prod(batch)):
            boundaries.append(boundaries[-1] + rows * cols)
            costs.append(costs[-1] + newton_schulz_flops((rows, cols)))
    picks = [0]
    for r in range(1, ranks):
        share = costs[-1] * r / ranks
        best = min(range(len(costs)), key=lambda i: (abs(costs[i] - share), i))
        picks.append(max(best, picks[-1]))
    picks.append(len(costs) - 1)
    return [boundaries[i] for i in picks], [costs[b] - costs[a] for a, b in zip(picks, picks[1:])], costs


def test_the_partition_cuts_at_matrix_boundaries_nearest_to_equal_shares():
    """Contiguous ranges per rank: four equal matrices over four ranks one each; an expert tensor of 8 experts over 4
    ranks two experts each; on random layouts of matrices and expert tensors (1 to 1000 ranks, more ranks than
    matrices included) the cuts equal the rule spelled out, every range's cost is within one matrix of its share, and
    the costs add up."""
    assert partition_matrices([(4, 4)] * 4, 4)[0] == [0, 16, 32, 48, 64]
    assert partition_matrices([(8, 4, 4)], 4)[0] == [0, 32, 64, 96, 128]
    rng = random.Random(0)
    for _ in range(40):
        shapes = [
            (rng.randint(1, 6), rng.choice([4, 8]), rng.choice([4, 12])) if rng.random() < 0.4
            else (rng.choice([2, 8, 16]), rng.choice([4, 8]))
            for _ in range(rng.randint(1, 12))
        ]  # fmt: skip
        ranks = rng.choice([1, 2, 3, 5, 8, 1000])
        cuts, loads = partition_matrices(shapes, ranks)
        ref_cuts, ref_loads, costs = _nearest_cuts_reference(shapes, ranks)
        assert cuts == ref_cuts and loads == pytest.approx(ref_loads, rel=1e-12)
        largest = max(b - a for a, b in zip(costs, costs[1:]))
        assert max(loads) <= costs[-1] / ranks + largest * (1 + 1e-9)
        assert sum(loads) == pytest.approx(costs[-1], rel=1e-12)


def test_a_buffer_cut_at_given_places_gives_each_shard_its_range_unpadded():
    """Three ranks, five parameters (an expert tensor among them) in three buckets, cut at the partition's places:
    every bucket's uneven shards add up to it, rank r's segments are exactly ``[cuts[r], cuts[r + 1])`` of the
    concatenation, made of whole matrices (experts of the expert tensor split between ranks), nothing padded, and
    the parameters view the buffer; cuts that do not span the elements are refused, naming them."""
    shapes = [(6, 4), (3, 4), (5, 2, 4), (2, 2), (4, 4)]
    params = [nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in shapes]
    items = [(f"p{i}", p, 0) for i, p in enumerate(params)]
    cuts, _ = partition_matrices(shapes, 3)
    total = sum(p.numel() for p in params)
    split = False
    for rank in range(3):
        buf = FlatBuffer(items, 3, rank, bucket_numel=30, cuts=cuts)
        assert buf.numel == total and len(buf.buckets) == 3
        assert all(sum(b.shard_sizes()) == b.numel for b in buf.buckets)
        covered = [(seg.buffer_start, seg.buffer_end) for seg in buf.segments]
        assert covered[0][0] == cuts[rank] and covered[-1][1] == cuts[rank + 1]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous
        for seg in buf.segments:
            matrix = seg.slot.param.shape[-2] * seg.slot.param.shape[-1]
            assert seg.param_start % matrix == 0 and seg.numel % matrix == 0, seg
            split |= seg.numel < seg.slot.numel
        for slot in buf.slots:  # the parameters view the buffer, values kept
            assert torch.equal(buf.params[slot.start : slot.end], slot.param.detach().reshape(-1))
    assert split  # the expert tensor is shared by two owners
    with pytest.raises(ValueError, match=r"cuts \[0, 10, 20\] must be 4 non-decreasing offsets from 0 to the 96 "):
        FlatBuffer(items, 3, 0, cuts=[0, 10, 20])


def _uneven(rank, world_size, via):
    import torch.distributed as dist

    from mula_lightning.parallel.collectives import gather_from_owners, reduce_to_owners

    sizes = [3, 0, 5]
    x = torch.arange(sum(sizes), dtype=torch.float64) * (rank + 1) + 0.25 * rank
    work, out = reduce_to_owners(x.clone(), sizes, dist.group.WORLD, via=via)
    work.wait()
    full = torch.full((sum(sizes),), -1.0, dtype=torch.float64)  # every other owner's chunk comes from it
    lo = sum(sizes[:rank])
    full[lo : lo + sizes[rank]] = out * 10
    gather_from_owners(full, sizes, dist.group.WORLD).wait()
    return out.tolist(), full.tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("via", ["all_to_all", "reduce"])
def test_reduce_to_owners_and_back_with_uneven_and_empty_chunks(via):
    """Three gloo ranks, chunks of 3, 0 and 5 elements (per-rank distinct values): each rank receives exactly the sum
    of its chunk over the ranks, by gloo's all-to-all and by the accelerators' reduce to each owner; the gather from
    the owners leaves every rank with every owner's chunk."""
    sizes = [3, 0, 5]
    base = torch.arange(8, dtype=torch.float64)
    total = sum(base * (r + 1) + 0.25 * r for r in range(3))
    results = run_pooled_test(_uneven, 3, via=via)
    for rank, (out, full) in enumerate(results):
        lo = sum(sizes[:rank])
        assert out == total[lo : lo + sizes[rank]].tolist()
        assert full == (total * 10).tolist()


def test_tensor_parallelism_and_zero_topo_refuse_muon_in_one_line():
    """Muon needs whole matrices: a topology with tp_size or etp_size 2 is refused naming it, and zero_topo names
    Muon when given a MuonAdamW."""
    from mula_lightning.strategies.zero_topo import check_adamw

    model = nn.Linear(4, 4)
    for size in ("tp_size", "etp_size"):
        topology = types.SimpleNamespace(**{"tp_size": 1, "etp_size": 1, size: 2})
        with pytest.raises(ValueError, match=rf"optimizer 'muon' with {size} \(2\) > 1 is not supported"):
            ShardedMuon(model, topology)
    with pytest.raises(TypeError, match="Muon needs whole matrices.*use strategy 'epso'"):
        check_adamw(MuonAdamW([model.weight]))


def _step(fabric, model, optimizer, micro, clip=None):
    """One optimizer step over data ranks 0 and 1's batches ``micro``: each rank its own, one process both (the
    second backward synchronised), then clipped to ``clip`` where given."""
    from mula_lightning.testing.conformance import batch

    ranks = [0, 1] if fabric.world_size == 1 else [fabric.global_rank]
    for i, r in enumerate(ranks):
        x = batch(micro, r)
        with fabric.no_backward_sync(model, enabled=i < len(ranks) - 1):
            out = model(x, labels=x)
            fabric.backward((out.loss + out.aux_loss) / len(ranks))
    if clip is not None:
        fabric.clip_gradients(model, optimizer, max_norm=clip)
    optimizer.step()
    optimizer.zero_grad()


def _muon_run(rank, world_size, path, save):
    """Fabric ``epso`` with EP = the world size, Muon; saves after two steps (``save``) or loads that checkpoint,
    then takes one more step over both data ranks' batches (one process accumulates the two)."""
    from lightning.fabric import Fabric

    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict
    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy
    from mula_lightning.testing.conformance import model_config, optimizer_of

    strategy = FabricEPSOStrategy(ep_size=world_size, bucket_numel=700)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(model_config())
    model, optimizer = fabric.setup(model, optimizer_of("epso ep_aware muon", model.named_parameters()))

    if save:
        _step(fabric, model, optimizer, 0)
        _step(fabric, model, optimizer, 1)
        fabric.save(path, {"model": model, "optimizer": optimizer})
    else:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    _step(fabric, model, optimizer, 2)
    return {k: v.detach().clone() for k, v in full_state_dict(model, fabric.strategy).items()}


@pytest.mark.distributed
def test_a_muon_checkpoint_of_two_ranks_resumes_in_one_process_with_the_same_next_step(tmp_path):
    """Saved by 2 ranks at EP 2 (attention matrices owned by one rank or the other, expert tensors by each EP rank)
    after two steps, loaded by one process (every matrix its own): the momentum under single-device keys gives the
    third step's weights of the 2-rank run, to 1e-12 (float64)."""
    path = str(tmp_path / "muon")
    two = run_pooled_test(_muon_run, 2, path=path, save=True, timeout=180)[0]
    one = run_pooled_test(_muon_run, 1, path=path, save=False, timeout=180)[0]
    assert set(one) == set(two)
    for name, value in two.items():
        torch.testing.assert_close(one[name], value, rtol=1e-12, atol=1e-14, msg=name)


def _split_run(rank, world_size):
    """Fabric ``epso`` ``ep_aware`` without EP (the expert tensors over both ranks), one MoE layer, Muon, float64:
    three clipped steps, each over both data ranks' batches (one process accumulates the two). Returns the weights and
    whether an expert tensor was split between the owners."""
    from lightning.fabric import Fabric

    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict
    from mula_lightning.models import MulaConfig, MulaForCausalLM
    from mula_lightning.optim.muon import muon_param_groups
    from mula_lightning.strategies import FabricEPSOStrategy

    config = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=96, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
        intermediate_size=8, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip
    strategy = FabricEPSOStrategy(ep_size=1, sharded_optimizer="ep_aware", bucket_numel=None)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(config)
    model, optimizer = fabric.setup(model, MuonAdamW(muon_param_groups(model), lr=0.02, weight_decay=0.1))
    for micro in range(3):
        _step(fabric, model, optimizer, micro, clip=0.5)
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    split = any(seg.numel < seg.slot.numel for seg in inner.buffers["muon_expert"].segments)
    return {k: v.detach().clone() for k, v in full_state_dict(model, fabric.strategy).items()}, split


@pytest.mark.distributed
def test_an_expert_tensor_split_between_two_owners_trains_as_one_process():
    """Two ranks, one layer's expert tensors over both (the cut falls between two experts of ``gate_up_proj``: each
    owner orthogonalises its experts, batched): three clipped steps of the two data ranks equal one process
    accumulating both batches, to 1e-12 (float64)."""
    two, split = run_pooled_test(_split_run, 2, timeout=180)[0]
    one, _ = run_pooled_test(_split_run, 1, timeout=180)[0]
    assert split
    assert set(one) == set(two)
    for name, value in two.items():
        torch.testing.assert_close(one[name], value, rtol=1e-12, atol=1e-14, msg=name)
