"""Context parallelism's model path (:mod:`mula_lightning.parallel.context_parallel`) against the unsplit model.

The chunk layout is checked on its own (every position once, the causal work equal on every rank); then the plan's
model on 2 and 4 gloo ranks (float64) against one process holding the whole sequences: the loss, the routers' losses
and the logits of each rank's positions equal the unsplit model's, and the ranks' gradients summed over the group
equal its gradients, with labels masked across chunk boundaries and a whole chunk masked. The strategy's training
loops (clipping, accumulation, folding with expert parallelism, data parallelism beside it, save and reload) are the
loop tester's context-parallel layouts (``tests/testing/test_conformance.py``).
"""

import pytest
import torch

from mula_lightning.parallel.context_parallel import check_sequence_length, chunk_positions
from mula_lightning.testing import run_pooled_test

V, T = 96, 16


def _config(**overrides):
    from mula_lightning.models import MulaConfig

    options = dict(vocab_size=V, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=8,
                   num_experts=4, top_k=2, moe_impl="fast", z_loss_coef=1e-2)  # fmt: skip
    return MulaConfig.from_name("mula-tiny-moe", **{**options, **overrides})


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_position_is_held_once_and_the_causal_work_is_equal(cp):
    """The ranks' positions partition the sequence, each rank's in increasing order (chunks r and 2cp-1-r), and
    every rank's queries see the same number of (query, key) pairs under the causal mask: the load balance."""
    seq_len = 2 * cp * 5
    held = [chunk_positions(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    assert all(bool((p[1:] > p[:-1]).all()) for p in held)
    work = {int(sum(int(q) + 1 for q in p)) for p in held}  # query at position q sees q + 1 keys
    assert len(work) == 1


@pytest.mark.parametrize("seq_len, cp", [(10, 2), (12, 4), (7, 1)])
def test_a_length_that_does_not_split_is_refused_naming_it(seq_len, cp):
    """A sequence that does not split into 2 x cp equal chunks is refused (not padded: padding would add tokens the
    routers count), naming the length and 2 x cp."""
    with pytest.raises(ValueError, match=rf"2 x cp = {2 * cp} .*length {seq_len} "):
        check_sequence_length(seq_len, cp)


def _model_on_ranks(rank, world_size, checkpointing):
    import torch.distributed as dist

    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing
    from mula_lightning.parallel.context_parallel import apply_context_parallel

    config = _config()
    split = init_weights(MulaForCausalLM(config), seed=0).double()
    whole = init_weights(MulaForCausalLM(config), seed=0).double()
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    labels = x.clone()
    labels[0, 3:9] = -100  # across a chunk boundary at cp 2 and cp 4
    labels[1, 12:16] = -100  # the whole last chunk at cp 2 (its targets: one real, then none)
    if checkpointing:
        apply_activation_checkpointing(split, "full")
    apply_context_parallel(split, dist.group.WORLD, world_size, rank)
    result = {}
    for name, model in (("split", split), ("whole", whole)):
        out = model(x, labels=labels, return_logits=False)
        (out.loss + out.aux_loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if name == "split":
            for g in grads.values():
                dist.all_reduce(g)
        with torch.no_grad():
            summed = model(x, labels=labels, loss_reduction="sum")
        result[name] = dict(loss=out.loss.item(), aux=out.aux_loss.item(), grads=grads, sum=summed.loss.item(),
                            logits=summed.logits)  # fmt: skip
    positions = chunk_positions(T, world_size, rank)
    result["whole"]["logits"] = result["whole"]["logits"][:, positions]
    return result


@pytest.mark.distributed
@pytest.mark.parametrize(("cp", "checkpointing"), [(2, False), (4, False), (2, True)], ids=["cp2", "cp4", "cp2 ac"])
def test_the_split_model_equals_the_whole_one(cp, checkpointing):
    """CP 2 and CP 4 (and CP 2 under full activation checkpointing, whose recomputation gathers again): on every rank
    the mean and summed losses and the routers' losses are the whole micro-batch's, the logits are those of the
    rank's positions, and the gradients summed over the ranks are the whole model's, to float64 rounding (masked
    labels across chunk boundaries, a whole chunk masked, grouped-query attention)."""
    for result in run_pooled_test(_model_on_ranks, cp, checkpointing=checkpointing, timeout=120):
        split, whole = result["split"], result["whole"]
        for key in ("loss", "aux", "sum"):
            assert split[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-14), key
        torch.testing.assert_close(split["logits"], whole["logits"], rtol=1e-12, atol=1e-12)
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-10, atol=1e-13, msg=name)


def _groups(rank, world_size):
    import torch.distributed as dist

    from mula_lightning.parallel.topology import build_topology

    topo = build_topology(ep_size=2, cp_size=2)
    ranks = dist.get_process_group_ranks
    return dict(cp=ranks(topo.cp_group), replicas=ranks(topo.dense_dp_group), ep=ranks(topo.ep_group),
                batch=(topo.batch_rank, topo.batches), cp_rank=topo.cp_rank)  # fmt: skip


@pytest.mark.distributed
def test_the_groups_of_cp2_folded_with_ep2_beside_dp2():
    """4 ranks, CP 2 x DP 2 folded with EP 2: the cp groups are consecutive pairs and coincide with the ep groups
    (Megatron's folding), the dense weights' replicas are all 4 ranks (dp x cp), and each cp pair reads one of 2
    batches."""
    got = run_pooled_test(_groups, 4, timeout=120)
    for rank, groups in enumerate(got):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert groups == dict(cp=pair, replicas=[0, 1, 2, 3], ep=pair, batch=(rank // 2, 2), cp_rank=rank % 2)


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(cp_size=2, etp_size=2), r"cp_size \(2\) > 1 with etp_size \(2\) > 1 is not supported yet"),
        (dict(cp_size=2, compile=True), r"cp_size \(2\) > 1 with compile"),
        (dict(cp_size=0), r"cp_size \(0\) must be an integer >= 1"),
    ],
    ids=["etp", "compile", "zero"],
)
def test_what_context_parallelism_does_not_run_with_is_refused_in_one_line(options, fragment):
    """The strategy refuses, at construction, the sizes context parallelism does not compose with yet, naming them."""
    from mula_lightning.strategies import FabricEPSOStrategy

    with pytest.raises(ValueError, match=fragment):
        FabricEPSOStrategy(**options)
