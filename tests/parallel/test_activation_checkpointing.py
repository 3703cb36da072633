"""Activation checkpointing, whole layers or the paper's selective parts: the same losses, MoE statistics and
gradients as storing every activation; routers replay their decisions on recomputation instead of choosing again;
unknown options are named."""

import copy

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.moe.router import Router
from mula_lightning.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_parts,
    parse_activation_checkpointing,
)

OPTIONS = ["full", ["norm"], ["attention"], ["moe"], ["mlp"], ["norm", "attention", "moe"], ["norm", "mlp", "moe"]]


def _model(capacity_factor=None, experts_backend="auto"):
    """Two MoE layers and one dense layer, GQA, q/k norm, top-2 of 4 experts (with capacity drops if asked)."""
    config = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast", moe_layers=[0, 2],
        capacity_factor=capacity_factor, experts_backend=experts_backend,
    )  # fmt: skip
    return init_weights(MulaForCausalLM(config), seed=1)


def _step(model, seed=0):
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(seed))
    out = model(x, labels=x)
    (out.loss + out.aux_loss).backward()
    stats = [(a.tokens_per_expert.clone(), a.aux_loss.detach()) for a in out.moe_aux]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), stats, grads


CASES = [(option, None, "auto") for option in OPTIONS] + [(option, 1.0, "auto") for option in OPTIONS]
CASES += [("full", None, "triton"), (["moe"], 1.0, "triton")]  # the Triton experts, under Triton's interpreter


@pytest.mark.parametrize("option,capacity_factor,experts_backend", CASES, ids=str)
def test_every_option_gives_the_losses_statistics_and_gradients_of_none(option, capacity_factor, experts_backend):
    """Float32, bit for bit: the loss, each MoE layer's tokens per expert and aux loss, and every gradient equal a
    run without checkpointing (with and without capacity drops; with either experts backend); the parts asked for,
    and only those, recompute."""
    plain = _model(capacity_factor, experts_backend)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), option)
    loss, stats, grads = _step(plain)
    got_loss, got_stats, got_grads = _step(checkpointed)
    assert torch.equal(got_loss, loss)
    for (tokens, aux), (exp_tokens, exp_aux) in zip(got_stats, stats):
        assert torch.equal(tokens, exp_tokens) and torch.equal(aux, exp_aux)
    for name, g in grads.items():
        assert torch.equal(got_grads[name], g), name
    parts = checkpointed_parts(checkpointed)
    expected = {"layer": 0, "attention": 0, "norm": 0, "mlp": 0, "moe": 0}
    if option == "full":
        expected["layer"] = 3
    else:
        expected.update(attention=3 * ("attention" in option), mlp=1 * ("mlp" in option), moe=2 * ("moe" in option))
        expected["norm"] = ("norm" in option) * (3 * 2 + 1 + (0 if "attention" in option else 3 * 2))
    assert parts == expected
    assert sorted(checkpointed.state_dict()) == sorted(plain.state_dict())


@pytest.mark.parametrize("option", ["full", ["moe"]], ids=str)
def test_recomputation_replays_the_routers_decisions(option, monkeypatch):
    """A router that would choose other experts when asked again (every second call rolls its choice, and backward
    recomputes the layers in reverse order, so a re-chosen routing would differ) is asked once per layer and step:
    the recomputation takes the forward's decisions, and the gradients equal those of storing every activation."""
    calls = []
    choose = Router._choose

    def fickle(self, logits, probs):
        calls.append(1)
        chosen = choose(self, logits, probs)
        return chosen if len(calls) % 2 else (chosen + 1) % self.num_experts

    monkeypatch.setattr(Router, "_choose", fickle)
    plain = _model()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), option)
    _, _, grads = _step(plain)
    calls.clear()
    _, _, got = _step(checkpointed)
    assert len(calls) == 2  # two MoE layers, each routed once; none routed again in backward
    for name in grads:  # the plain run was routed by calls 1 and 2 as well
        assert torch.equal(got[name], grads[name]), name


def test_no_grad_forward_does_not_checkpoint():
    """Under no_grad (evaluation) a checkpointed model runs its plain forward and returns the same logits."""
    plain = _model()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), ["norm", "attention", "moe"])
    x = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        assert torch.equal(checkpointed(x).logits, plain(x).logits)


@pytest.mark.parametrize(
    "value,expected",
    [(False, None), (None, None), ([], None), (True, "full"), ("full", "full"), ("moe", ("moe",)),
     (["moe", "norm"], ("norm", "moe"))],
)  # fmt: skip
def test_options_parse(value, expected):
    """Booleans, 'full', one part or a list of parts (kept in the paper's order)."""
    assert parse_activation_checkpointing(value) == expected


def test_unknown_parts_are_named():
    with pytest.raises(ValueError, match=r"parts \['experts', 'ffn'\] are unknown"):
        parse_activation_checkpointing(["moe", "experts", "ffn"])


def test_norms_of_pipeline_stages_without_the_final_norm():
    """Every stage of a model cut into pipeline stages (the stages before the last hold no final norm) takes the
    220B recipe's norm + attention + moe recomputation; only the last stage's final norm is checkpointed with them
    (this crashed on the first stage: found by mula plan's dry run of the recipe)."""
    from mula_lightning.parallel.pipeline import prune_to_stages

    counts = []
    for stage in range(3):
        model = _model()
        prune_to_stages(model, stage, 3)
        apply_activation_checkpointing(model, ["norm", "attention", "moe"])
        counts.append(checkpointed_parts(model))
    assert [c["norm"] for c in counts] == [2, 2, 3]  # each stage's layer's two, and the last stage's final norm
    assert [c["attention"] for c in counts] == [1, 1, 1] and [c["moe"] for c in counts] == [1, 0, 1]


@pytest.mark.parametrize("option", ["full", ["moe"]], ids=str)
def test_router_jitter_is_drawn_again_identically_on_recomputation(option):
    """A block drawing router jitter noise (Mixtral's) recomputes with the generator state of its forward: the loss
    and every gradient equal a run without checkpointing from the same seed (checkpointing saves the generator's
    state only around regions that draw; without it the recomputed noise, hence the gradients, would differ)."""
    plain = _model()
    for m in plain.modules():
        if hasattr(m, "jitter_noise"):
            m.jitter_noise = 0.3
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), option)
    torch.manual_seed(5)
    loss, _, grads = _step(plain)
    torch.manual_seed(5)
    got_loss, _, got = _step(checkpointed)
    assert torch.equal(got_loss, loss)
    for name in grads:
        assert torch.equal(got[name], grads[name]), name
