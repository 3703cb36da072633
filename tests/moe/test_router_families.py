"""Sigmoid scores, group-limited routing and the routed scaling factor (DeepSeek-V3's router) against a slow,
token-by-token reference, on fresh random inputs: the chosen experts, their weights, and the gradients of the router
weight and of the tokens through those weights; the MoE block with these options against the reference block."""

import zlib

import pytest
import torch

from mula_lightning.moe import MoEConfig
from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.reference import ReferenceMoEBlock
from mula_lightning.moe.router import Router
from mula_lightning.testing import assert_parity

H, E, S = 16, 8, 37

OPTIONS = {
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid, normalised, scaled": dict(score_function="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "sigmoid, 4 groups keep 2": dict(score_function="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True),
    "softmax, 2 groups keep 1": dict(n_group=2, topk_group=1, routed_scaling_factor=16.0),
    "softmax, 8 groups of one keep 3": dict(n_group=8, topk_group=3),
    "softmax, selection bias": dict(expert_bias=True),
    "sigmoid, 4 groups keep 2, selection bias": dict(
        score_function="sigmoid",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        bias_update_rate=0.001,
    ),  # fmt: skip
}


def _random_bias(module, generator):
    """A selection bias large enough to change choices (scores lie in [0, 1]), when the router has one."""
    for m in module.modules():
        if isinstance(m, Router) and m.has_expert_bias:
            m.e_score_correction_bias.copy_(torch.randn(E, generator=generator) * 0.3)


def _reference_weights(logits_SE, top_k, score_function="softmax", norm_topk_prob=False, n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, bias=None, **_):  # fmt: skip
    """Token by token, in plain Python where the rule is a choice: (chosen experts (S, K), their weights (S, K)).
    The selection bias enters the choice (groups included) and never the weights."""
    indices, weights = [], []
    for logits in logits_SE:
        scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
        per = E // n_group
        values = (scores + (bias if bias is not None else 0.0)).tolist()
        group_score = [sum(sorted(values[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(E) if e // per in kept]
        chosen = sorted(allowed, key=lambda e: -values[e])[:top_k]
        w = torch.stack([scores[e] for e in chosen])
        if norm_topk_prob:
            w = w / w.sum()
        indices.append(chosen)
        weights.append(w * routed_scaling_factor)
    return torch.tensor(indices), torch.stack(weights)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("top_k", [1, 2])
def test_router_options_match_the_token_by_token_rule(name, top_k):
    """The experts each token chooses (as a set: equal scores are improbable on random inputs), their weights and
    the gradients of a random function of the weights (router weight and tokens) equal the slow rule's, in float64."""
    options = OPTIONS[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + top_k)
    router = Router(H, E, top_k, **options).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g, dtype=torch.float64))
        _random_bias(router, g)
    bias = router.e_score_correction_bias.double() if router.has_expert_bias else None
    x = torch.randn(S, H, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(S, top_k, generator=g, dtype=torch.float64)
    out = router(x)
    order = out.indices_SK.argsort(dim=-1)  # compare as sets, weight by weight
    (out.weights_SK * probe.gather(1, order.argsort(-1))).sum().backward()
    grads = (router.weight.grad.clone(), x.grad.clone())

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = router.weight.detach().clone().requires_grad_(True)
    idx, weights = _reference_weights(x_ref @ w_ref.T, top_k, bias=bias, **options)
    ref_order = idx.argsort(dim=-1)
    assert torch.equal(out.indices_SK.gather(1, order), idx.gather(1, ref_order)), name
    sorted_w = out.weights_SK.gather(1, order)
    ref_sorted = weights.gather(1, ref_order)
    assert_parity(sorted_w.detach(), ref_sorted.detach(), reduction_len=H + E, msg=f"{name} weights")
    (ref_sorted * probe).sum().backward()
    assert_parity(grads[0], w_ref.grad, reduction_len=S * (H + E), msg=f"{name} router grad")
    assert_parity(grads[1], x_ref.grad, reduction_len=H + E, msg=f"{name} token grad")
    # the load-balancing loss: E x sum_e (pairs routed to e / S) x mean probability of e, the probabilities being
    # each token's scores normalised to sum to one (sigmoid scores do not)
    with torch.no_grad():
        logits = x.detach() @ router.weight.T
        scores = (
            torch.softmax(logits, -1) if options.get("score_function", "softmax") == "softmax" else logits.sigmoid()
        )
        probs = scores / scores.sum(-1, keepdim=True)
        f = torch.bincount(idx.reshape(-1), minlength=E).double() / S
        assert_parity(out.load_balance_loss.detach(), E * (f * probs.mean(0)).sum(), reduction_len=S + E, msg=name)


BLOCK_OPTIONS = {
    **OPTIONS,
    "deepseek: sigmoid, groups, bias, 2 shared experts": dict(
        score_function="sigmoid",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        expert_bias=True,
        shared_experts=2,
    ),  # fmt: skip
    "qwen2: a gated shared expert of its own width": dict(
        norm_topk_prob=True, shared_expert_intermediate_size=20, shared_expert_gate=True
    ),
}


@pytest.mark.parametrize("name", list(BLOCK_OPTIONS))
def test_block_with_router_options_matches_the_reference_block(name):
    """FastSparseMoE with the option equals the reference per-expert loop: output, aux losses, every gradient."""
    config = MoEConfig(hidden_size=H, intermediate_size=12, num_experts=E, top_k=2, **BLOCK_OPTIONS[name])
    torch.manual_seed(3)
    fast = FastSparseMoEBlock(config).double()
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.5)
        _random_bias(fast, torch.Generator().manual_seed(4))
    ref = ReferenceMoEBlock(config).double()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(3, 11, H, dtype=torch.float64)
    outs = []
    for block in (fast, ref):
        xi = x.clone().requires_grad_(True)
        y, aux = block.forward_with_aux(xi)
        (y.square().sum() + aux.aux_loss).backward()
        outs.append((y.detach(), aux, xi.grad, {k: p.grad for k, p in block.named_parameters()}))
    (y, aux, xg, grads), (ry, raux, rxg, rgrads) = outs
    assert_parity(y, ry, reduction_len=H + 24 + E, msg=f"{name} output")
    assert torch.equal(aux.tokens_per_expert, raux.tokens_per_expert)
    assert_parity(aux.aux_loss.detach(), raux.aux_loss.detach(), reduction_len=S * E, msg=f"{name} aux")
    assert_parity(xg, rxg, reduction_len=H + 24 + E, msg=f"{name} input grad")
    for key, value in rgrads.items():
        assert_parity(grads[key], value, reduction_len=33 * (H + 24 + E), msg=f"{name} {key}")


def test_softmax_without_groups_is_todays_router_bit_for_bit():
    """The defaults (softmax scores, one group, scale 1) route and weigh exactly as before the options existed."""
    torch.manual_seed(0)
    plain = Router(H, E, 2, norm_topk_prob=True)
    with torch.no_grad():
        plain.weight.normal_()
    explicit = Router(H, E, 2, norm_topk_prob=True, score_function="softmax", n_group=1, topk_group=1,
                      routed_scaling_factor=1.0)  # fmt: skip
    explicit.load_state_dict(plain.state_dict())
    x = torch.randn(S, H)
    a, b = plain(x), explicit(x)
    probs = torch.softmax(x @ plain.weight.T, -1)
    idx = probs.topk(2, -1)[1]
    w = probs.gather(1, idx)
    assert torch.equal(a.indices_SK, idx) and torch.equal(a.weights_SK, w / w.sum(-1, keepdim=True))
    assert torch.equal(a.indices_SK, b.indices_SK) and torch.equal(a.weights_SK, b.weights_SK)


@pytest.mark.parametrize(
    "options,fragment",
    [
        (dict(n_group=3), r"num_experts \(8\) must be divisible by n_group \(3\)"),
        (dict(n_group=4, topk_group=5), r"topk_group \(5\) must be at most n_group \(4\)"),
        (dict(n_group=4, topk_group=1, top_k=3), r"top_k \(3\) must be at most the experts of the topk_group \(1\)"),
        (dict(score_function="relu"), r"score_function \('relu'\) must be one of \('softmax', 'sigmoid'\)"),
        (dict(score_function="sigmoid", router_kind="topk_softmax"), r"need router_kind='softmax_topk'"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor \(0.0\) must be > 0"),
        (dict(bias_update_rate=-0.001), r"bias_update_rate \(-0.001\) must be a finite number >= 0"),
        (dict(bias_update_rate=float("nan")), r"bias_update_rate \(nan\) must be a finite number >= 0"),
        (dict(expert_bias=True, router_kind="topk_softmax"), r"expert_bias True, bias_update_rate 0.0\) .* needs "),
    ],
)
def test_routing_that_cannot_work_is_named(options, fragment):
    """Groups that do not divide the experts, more kept groups than groups, a top-k larger than the experts left
    after group selection, an unknown score function: one line naming the values, from MoEConfig and from
    MulaConfig (what ``mula fit`` checks before launch)."""
    from mula_lightning.models import MulaConfig

    kwargs = {"hidden_size": H, "intermediate_size": 12, "num_experts": E, "top_k": 2, **options}
    with pytest.raises(ValueError, match=fragment):
        MoEConfig(**kwargs)
    with pytest.raises(ValueError, match=fragment):
        MulaConfig.from_name("mula-tiny-moe", **{k: v for k, v in kwargs.items() if k != "intermediate_size"})


def test_export_to_a_family_whose_router_differs_is_refused():
    """A model with sigmoid scores and groups has no OLMoE / Mixtral equivalent: ``to_hf`` names the options instead
    of writing a model that routes otherwise."""
    from mula_lightning.models import MulaConfig, MulaForCausalLM

    config = MulaConfig.from_name("mula-tiny-moe", score_function="sigmoid", n_group=4, topk_group=2)
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    with pytest.raises(ValueError, match=r"uses \{'score_function': 'sigmoid', 'n_group': 4, 'topk_group': 2\}"):
        model.to_hf()
    with torch.device("meta"):
        biased = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", bias_update_rate=0.001))
    with pytest.raises(ValueError, match=r"uses \{'bias_update_rate': 0.001\}.*no selection bias"):
        biased.to_hf()
