"""Auxiliary-loss-free balancing in one process: the update rule (the issue's worked example, no re-centring), what
a forward counts (training forwards' choices before capacity drops; not evaluation, ``no_grad``, a paused forward or
an activation-checkpointing recomputation), once per optimizer step under gradient accumulation, and the bias as
model state (fp32 through dtype casts, zero when materialised from the meta device, loaded by ``init_from``)."""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.moe import MoEConfig
from mula_lightning.moe.balancing import expert_bias_routers, install_expert_bias_update, update_expert_bias
from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.router import Router, paused_load_counting
from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing

H, E = 16, 4


def _router(rate=0.1, **kwargs):
    torch.manual_seed(0)
    router = Router(H, E, 2, bias_update_rate=rate, **kwargs)
    with torch.no_grad():
        router.weight.normal_()
    return router


def test_update_moves_each_expert_by_the_rate_against_its_load():
    """Global loads [10, 0, 2, 4] (mean 4) at rate 0.1 move the bias by [-0.1, +0.1, +0.1, 0] exactly (not re-centred:
    the sum moves by +0.1); a second update in the same step, with nothing counted, changes nothing."""
    router = _router()
    router.pending_load = torch.tensor([10.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    loads = update_expert_bias(router)
    assert torch.equal(loads[0], torch.tensor([10.0, 0.0, 2.0, 4.0], dtype=torch.float64))
    expected = torch.tensor([-0.1, 0.1, 0.1, 0.0], dtype=torch.float32)
    assert torch.equal(router.e_score_correction_bias, expected)
    assert router.pending_load is None
    update_expert_bias(router)
    assert torch.equal(router.e_score_correction_bias, expected)


def test_a_training_forward_counts_its_choices_before_capacity_drops():
    """The pending load is the bincount of the chosen experts, dropped pairs included (the demand the bias balances),
    and adds up over forwards."""
    router = _router(capacity_factor=0.5)
    x = torch.randn(24, H)
    first = router(x)
    assert (first.indices_SK < 0).any()  # capacity dropped some pairs
    chosen = torch.topk(torch.softmax(x @ router.weight.T, -1), 2)[1]
    assert torch.equal(router.pending_load, torch.bincount(chosen.reshape(-1), minlength=E).double())
    router(x)
    assert torch.equal(router.pending_load, 2 * torch.bincount(chosen.reshape(-1), minlength=E).double())


def test_evaluation_no_grad_and_paused_forwards_count_nothing():
    """Evaluation mode, ``torch.no_grad`` and :func:`paused_load_counting` leave the pending load alone; a router
    without a moving bias never counts."""
    router, x = _router(), torch.randn(8, H)
    router.eval()
    router(x)
    router.train()
    with torch.no_grad():
        router(x)
    with paused_load_counting():
        router(x)
    assert router.pending_load is None
    fixed = _router(rate=0.0, expert_bias=True)
    fixed(x)
    assert fixed.pending_load is None and fixed.has_expert_bias


def _tiny(**overrides):
    config = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=E, top_k=2, bias_update_rate=0.01, **overrides,
    )  # fmt: skip
    return init_weights(MulaForCausalLM(config), seed=0)


@pytest.mark.parametrize("what", ["full", ["moe"]])
def test_activation_checkpointing_recomputation_is_not_counted_twice(what):
    """A forward and backward with decoder layers (or MoE blocks) recomputed count each token once: the same pending
    loads as without activation checkpointing."""
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    loads = []
    for checkpointed in (False, True):
        model = _tiny()
        if checkpointed:
            apply_activation_checkpointing(model, what)
        out = model(x, labels=x)
        (out.loss + out.aux_loss).backward()
        loads.append([r.pending_load.clone() for r in expert_bias_routers(model)])
    assert all(torch.equal(a, b) for a, b in zip(*loads))
    assert all(load.sum() == 2 * 12 * 2 for load in loads[1])


def test_gradient_accumulation_updates_once_per_optimizer_step():
    """Two accumulated micro-batches, then one ``optimizer.step()``: one update from their summed loads; a step with
    no forward after it leaves the bias where it is."""
    model = _tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    install_expert_bias_update(optimizer, model)
    install_expert_bias_update(optimizer, model)  # installing again replaces the hook: still one update per step
    total = None
    for seed in (1, 2):
        x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
        model(x, labels=x).loss.backward()
    total = [r.pending_load.clone() for r in expert_bias_routers(model)]
    optimizer.step()
    for router, load in zip(expert_bias_routers(model), total):
        expected = (0.01 * torch.sign(load.mean() - load)).float()
        assert torch.equal(router.e_score_correction_bias, expected)
    before = [r.e_score_correction_bias.clone() for r in expert_bias_routers(model)]
    optimizer.step()
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(expert_bias_routers(model), before))


def test_the_bias_stays_fp32_through_casts_and_starts_at_zero_from_meta():
    """``model.to(bfloat16)`` keeps the bias fp32 with its values (1e-3 steps would round away in bf16); a model
    built on the meta device and materialised gets a zero bias; the bias is in the state dict."""
    block = FastSparseMoEBlock(MoEConfig(hidden_size=H, intermediate_size=8, num_experts=E, top_k=2, expert_bias=True))
    block.gate.e_score_correction_bias.copy_(torch.tensor([1e-3, -2e-3, 3e-3, 0.0]))
    block.to(torch.bfloat16)
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(block.gate.e_score_correction_bias, torch.tensor([1e-3, -2e-3, 3e-3, 0.0]))
    assert block.gate.weight.dtype == torch.bfloat16
    assert "gate.e_score_correction_bias" in block.state_dict()
    with torch.device("meta"):
        model = MulaForCausalLM(_tiny().config)
    model.to_empty(device="cpu")
    model.model.layers[0].mlp.gate.e_score_correction_bias.fill_(float("nan"))  # what to_empty may leave
    init_weights(model)
    assert all(torch.equal(r.e_score_correction_bias, torch.zeros(E)) for r in expert_bias_routers(model))
