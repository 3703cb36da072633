"""The load-balancing loss at each balance scope (:mod:`mula_lightning.moe.balance_scope`): transformers' loss at
micro-batch scope, a uniform router at exactly 1 (normalised) at every scope, a sequence scope that is the mean of
the sequences' losses, and a global-batch scope whose data-parallel gradient equals one process holding every rank's
tokens under the running-sum rule, recomputed identically under activation checkpointing."""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.moe.balance_scope import enable_global_batch_balance, reset_balance_window
from mula_lightning.moe.router import Router, load_balancing_loss
from mula_lightning.testing import run_pooled_test

H, E, K = 16, 8, 2


def _router(kind="softmax_topk", scope="micro_batch", seed=0):
    torch.manual_seed(seed)
    router = Router(H, E, K, router_kind=kind).double()
    router.balance_scope = scope
    return router


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_micro_batch_scope_equals_transformers_load_balancing_loss(family):
    """One layer's routing of 24 tokens: the micro-batch loss equals transformers' ``load_balancing_loss_func`` of the
    OLMoE (softmax, then top-k) and Mixtral (top-k logits) families, to float32 rounding (transformers counts in
    float32)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = _router("softmax_topk" if family == "olmoe" else "topk_softmax")
    x = torch.randn(24, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = router(x)
    expected = module.load_balancing_loss_func((out.logits_SE,), num_experts=E, top_k=K)
    assert out.load_balance_loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_uniform_router_gives_a_normalised_loss_of_exactly_one_at_every_scope():
    """Zero router weights (every probability 1 / E, whatever the top-k picks) give ``loss / K == 1`` exactly at the
    micro-batch, sequence and global-batch scopes (Megatron's check of its normalisation)."""
    x = torch.randn(4 * 6, H, dtype=torch.float64)
    for scope in ("micro_batch", "sequence", "global_batch"):
        router = _router(scope=scope)
        with torch.no_grad():
            router.weight.zero_()
        for _ in range(2):  # at global scope the second micro-batch counts both
            assert router(x, num_sequences=4).load_balance_loss.item() / K == 1.0, scope


def test_sequence_scope_is_the_mean_of_each_sequences_own_loss():
    """Three sequences of 10 tokens: the sequence-scope loss is the mean of the micro-batch loss of each sequence
    alone, and differs from the loss of the three together (the routing is not the same in each)."""
    router = _router(scope="sequence")
    x = torch.randn(30, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = router(x, num_sequences=3).load_balance_loss
    alone = _router(seed=0)
    parts = [alone(x[i * 10 : (i + 1) * 10]).load_balance_loss for i in range(3)]
    assert got.item() == pytest.approx(torch.stack(parts).mean().item(), rel=1e-14)
    assert abs(got.item() - alone(x).load_balance_loss.item()) > 1e-3


def _tokens(step, micro, rank):
    return torch.randn(
        12, H, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    )


def _global_rank(rank, world_size, steps, micros):
    """Each rank routes its own micro-batches; the router's gradient is averaged over the ranks (DDP's mean)."""
    import torch.distributed as dist

    router = _router(scope="global_batch")
    enable_global_batch_balance(router, dist.group.WORLD)
    losses, grads = [], []
    for step in range(steps):
        reset_balance_window(router)
        router.zero_grad()
        for micro in range(micros):
            loss = router(_tokens(step, micro, rank)).load_balance_loss
            (loss / micros).backward()
            losses.append(loss.item())
        grad = router.weight.grad.clone()
        dist.all_reduce(grad)
        grads.append(grad / world_size)
    return losses, grads


@pytest.mark.distributed
@pytest.mark.parametrize("micros", [1, 2])
def test_global_batch_at_dp2_equals_one_process_of_both_ranks_tokens(micros):
    """DP 2, two steps of one or two accumulated micro-batches, float64: the ranks' mean gradient of the router equals
    one process whose micro-batch ``m`` holds both ranks' micro-batch ``m`` under the same running-sum rule (to
    1e-12), and the mean of the ranks' losses its loss; no factor of the data-parallel size appears."""
    results = run_pooled_test(_global_rank, 2, steps=2, micros=micros)
    router = _router(scope="global_batch")
    for step in range(2):
        reset_balance_window(router)
        router.zero_grad()
        for micro in range(micros):
            x = torch.cat([_tokens(step, micro, r) for r in range(2)])
            loss = router(x).load_balance_loss
            (loss / micros).backward()
            mean = sum(results[r][0][step * micros + micro] for r in range(2)) / 2
            assert mean == pytest.approx(loss.item(), rel=1e-12)
        for r in range(2):
            torch.testing.assert_close(results[r][1][step], router.weight.grad, rtol=1e-12, atol=1e-15)
    assert results[0][1][0].abs().max() > 1e-3  # the balance loss has a gradient to compare


def test_activation_checkpointing_recomputes_with_the_frequencies_the_forward_used():
    """A tiny MoE model at global-batch scope, two accumulated micro-batches, with every layer checkpointed and
    without: equal losses and gradients (the recomputation takes its first run's frequencies: no double count), and
    the step's running count holds each micro-batch's token choices once."""
    from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing

    config = MulaConfig.from_name("mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                  num_kv_heads=2, intermediate_size=8, num_experts=4, top_k=2,
                                  balance_scope="global_batch", aux_loss_coef=1.0)  # fmt: skip
    runs = []
    for checkpointed in (False, True):
        model = init_weights(MulaForCausalLM(config), seed=0).double()
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        enable_global_batch_balance(model, None)
        losses = []
        for micro in range(2):
            x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(micro))
            out = model(x, labels=x)
            (out.loss + out.aux_loss).backward()
            losses.append(out.aux_loss.item())
        counts = [r.balance_window for r in model.modules() if isinstance(r, Router)]
        runs.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}, counts))
    (l0, g0, c0), (l1, g1, c1) = runs
    assert l0 == pytest.approx(l1, rel=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-14, msg=name)
    for window in c0 + c1:
        assert window[-1].item() == 2 * 2 * 8 and window[:-1].sum().item() == 2 * 2 * 8 * 2  # tokens, pairs


def test_an_unknown_scope_is_refused_naming_it():
    """``balance_scope`` takes one of three names; a typo is refused at the config."""
    with pytest.raises(ValueError, match=r"balance_scope \('global'\) must be one of"):
        MulaConfig.from_name("mula-tiny-moe", balance_scope="global")


def test_micro_batch_scope_is_the_plain_loss():
    """The default scope computes exactly ``load_balancing_loss`` of the routing (today's behaviour)."""
    router = _router()
    x = torch.randn(20, H, dtype=torch.float64)
    out = router(x)
    probs = torch.softmax(out.logits_SE, dim=-1)
    assert out.load_balance_loss.item() == load_balancing_loss(probs, out.indices_SK).item()
