"""The sharded Muon of ``epso`` (:mod:`mula_lightning.parallel.sharded_muon`): owners balanced by Newton-Schulz cost,
whole matrices per owner, the uneven reductions it runs on, and what it refuses. Its training against one process
(every layout, every loop) is the loop tester's Muon layouts (``tests/testing/test_conformance.py``,
``tests/testing/test_trainer_conformance.py``) and the pipeline test's Muon layout."""

import random
import types

import pytest
import torch
from torch import nn

from mula_lightning.optim.muon import MuonAdamW, newton_schulz_flops
from mula_lightning.parallel.flat_buffer import FlatBuffer
from mula_lightning.parallel.sharded_muon import ShardedMuon, assign_owners
from mula_lightning.testing import run_pooled_test


def test_owners_balance_newton_schulz_cost_in_layout_order():
    """Greedy in layout order: each matrix goes to the least-loaded rank so far (ties to the lowest), so four equal
    matrices spread over four ranks and a large one is followed by small ones on the other ranks."""
    assert assign_owners([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert assign_owners([8, 1, 1, 1, 5], 3) == [0, 1, 2, 1, 2]
    costs = [newton_schulz_flops(s) for s in [(4, 64, 32), (32, 32), (32, 32), (64, 32), (4, 32, 64)]]
    owners = assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert max(loads) <= sum(costs) / 2 + max(costs)  # the greedy bound
    rng = random.Random(0)
    for ranks in (1, 3, 8, 1000):  # the heap against the rule spelled out (repeated costs: ties)
        costs = [rng.choice([1.0, 2.0, 3.5, rng.random()]) for _ in range(200)]
        loads, expected = [0.0] * ranks, []
        for cost in costs:
            rank = min(range(ranks), key=lambda r: (loads[r], r))
            loads[rank] += cost
            expected.append(rank)
        assert assign_owners(costs, ranks) == expected


def test_an_owner_aligned_buffer_gives_each_shard_whole_parameters_without_padding():
    """Three ranks, five matrices in two buckets: every bucket lists its matrices owner by owner, its uneven shards
    end at parameter boundaries, each rank's segments are whole parameters, and nothing is padded."""
    params = [nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in [(6, 4), (3, 4), (2, 2), (5, 4), (4, 4)]]
    items = [(f"p{i}", p, 0) for i, p in enumerate(params)]
    owners = dict(zip(map(id, params), [2, 0, 2, 1, 0]))
    total = sum(p.numel() for p in params)
    for rank in range(3):
        buf = FlatBuffer(items, 3, rank, bucket_numel=30, owners=owners)
        assert buf.numel == total and len(buf.buckets) == 2
        for b in buf.buckets:
            assert sum(b.shard_sizes()) == b.numel
            for shard in range(3):
                lo, hi = b.shard_range(shard)
                inside = [s for s in b.slots if lo <= s.start < hi]
                assert all(owners[id(s.param)] == shard and s.end <= hi for s in inside)
        assert {s.slot.name for s in buf.segments} == {f"p{i}" for i, o in enumerate([2, 0, 2, 1, 0]) if o == rank}
        assert all(s.numel == s.slot.numel for s in buf.segments)
        for slot in buf.slots:  # the parameters view the buffer, values kept
            assert torch.equal(buf.params[slot.start : slot.end], slot.param.detach().reshape(-1))


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


def _muon_run(rank, world_size, path, save):
    """Fabric ``epso`` with EP = the world size, Muon; saves after two steps (``save``) or loads that checkpoint,
    then takes one more step over both data ranks' batches (one process accumulates the two)."""
    from lightning.fabric import Fabric

    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict
    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy
    from mula_lightning.testing.conformance import batch, model_config, optimizer_of

    strategy = FabricEPSOStrategy(ep_size=world_size, bucket_numel=700)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(model_config())
    model, optimizer = fabric.setup(model, optimizer_of("epso ep_aware muon", model.named_parameters()))

    def step(micro):
        ranks = [0, 1] if world_size == 1 else [fabric.global_rank]
        for i, r in enumerate(ranks):
            x = batch(micro, r)
            with fabric.no_backward_sync(model, enabled=i < len(ranks) - 1):
                out = model(x, labels=x)
                fabric.backward((out.loss + out.aux_loss) / len(ranks))
        optimizer.step()
        optimizer.zero_grad()

    if save:
        step(0)
        step(1)
        fabric.save(path, {"model": model, "optimizer": optimizer})
    else:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    step(2)
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
