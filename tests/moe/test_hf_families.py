"""FastSparseMoEBlock as a drop-in for the MoE blocks of Qwen3-MoE, Qwen2-MoE (a gated shared expert) and DeepSeek-V3
(sigmoid scores, group-limited routing, a selection bias, routed scaling, shared experts), on tiny random transformers
models built locally: block outputs and every gradient equal transformers' own block, ``patch_hf_moe`` keeps a whole
model's loss and gradients, and a patched Qwen3-MoE model trains under Fabric + ``epso`` at EP=2 with the losses and
weights of one process."""

from __future__ import annotations

import pytest
import torch
import transformers

from mula_lightning.moe import FastSparseMoEBlock, patch_hf_moe
from mula_lightning.testing import run_pooled_test

H, FF, V = 32, 16, 96


def _config(family: str, **kw):
    common = dict(
        vocab_size=V, hidden_size=H, intermediate_size=48, moe_intermediate_size=FF, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, experts_implementation="eager",
    )  # fmt: skip
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=True, **kw)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, num_experts=8, shared_expert_intermediate_size=24, **kw)
    common["num_key_value_heads"] = 4  # multi-head latent attention: as many key-value heads as query heads
    return transformers.DeepseekV3Config(
        **common, n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, **kw,
    )  # fmt: skip


MODELS = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    "deepseek_v3": transformers.DeepseekV3ForCausalLM,
}


def _randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter N(0, 0.3^2) and DeepSeek's selection biases N(0, 0.1^2), so that the bias changes choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return module


def _hf_block(family: str) -> torch.nn.Module:
    model = MODELS[family](_config(family))
    block = model.model.layers[-1].mlp
    return _randomise(block, 3).float()


def _forward_backward(block, x, probe):
    """(output, input gradient, {parameter id: gradient})."""
    xi = x.clone().requires_grad_()
    block.zero_grad()
    y = block(xi)
    (y * probe).sum().backward()
    return y.detach(), xi.grad, {id(p): p.grad.clone() for p in block.parameters()}


@pytest.mark.parametrize("family", list(MODELS))
def test_block_equals_the_transformers_block(family):
    """``FastSparseMoEBlock.from_hf`` of the family's block: same output, input gradient and every parameter gradient
    (float32; the same parameter objects; shared experts and their gate kept)."""
    hf = _hf_block(family)
    x = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(2))
    expected = _forward_backward(hf, x, probe)
    fast = FastSparseMoEBlock.from_hf(hf)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in hf.parameters()}
    got = _forward_backward(fast, x, probe)
    pairs = [("output", got[0], expected[0]), ("input grad", got[1], expected[1])]
    pairs += [(name, got[2][id(p)], expected[2][id(p)]) for name, p in hf.named_parameters()]
    for name, a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"{family} {name}")
    if family != "qwen3_moe":  # the same module, under transformers' name
        name = "shared_experts" if family == "deepseek_v3" else "shared_expert"
        assert getattr(fast, name) is getattr(hf, name)
        assert {n for n, _ in fast.named_parameters()} == {n for n, _ in hf.named_parameters()}


@pytest.mark.parametrize("family", list(MODELS))
def test_patched_model_keeps_loss_and_gradients(family):
    """``patch_hf_moe`` swaps the family's MoE blocks (DeepSeek-V3's dense first layer stays): parameter names, loss,
    logits and every parameter gradient unchanged."""
    torch.manual_seed(0)
    model = _randomise(MODELS[family](_config(family)), 5)
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before, grads_before = loss_and_grads()
    patch_hf_moe(model)
    moe_layers = 1 if family == "deepseek_v3" else 2
    assert sum(isinstance(m, FastSparseMoEBlock) for m in model.modules()) == moe_layers
    after, grads_after = loss_and_grads()
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5 * before.logits.abs().max().item())
    torch.testing.assert_close(after.loss, before.loss, rtol=1e-5, atol=0)
    assert grads_after.keys() == grads_before.keys()
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


STEPS, LR = 4, 1e-2


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _patched_qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    model = _randomise(transformers.Qwen3MoeForCausalLM(_config("qwen3_moe")), 7).double()
    return patch_hf_moe(model)


def _train_epso(rank: int, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from lightning.fabric import Fabric

    from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
    from mula_lightning.strategies import FabricEPSOStrategy

    strategy = FabricEPSOStrategy(ep_size=2, dispatcher="alltoall")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    model = _patched_qwen3()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for step in range(STEPS):
        ids = _batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = gather_expert_parallel_state_dict(model.module, strategy.topology.ep_group)
    return losses, {k: v.detach().clone() for k, v in full.items()}


@pytest.mark.distributed
def test_patched_qwen3_moe_trains_under_epso_ep2_like_one_process():
    """A transformers Qwen3-MoE after ``patch_hf_moe`` under Fabric + ``epso`` (EP=2, all-to-all, float64): each
    rank's losses and the gathered weights after 4 AdamW steps equal one process averaging the two ranks' batches."""
    results = run_pooled_test(_train_epso, 2, timeout=300)
    model = _patched_qwen3()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=_batch(step, r), labels=_batch(step, r)).loss for r in range(2)]
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    for rank, (got, state) in enumerate(results):
        torch.testing.assert_close(torch.tensor(got), torch.tensor([s[rank] for s in losses]), rtol=1e-10, atol=0)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", list(MODELS))
def test_our_router_routes_like_the_transformers_router(family):
    """Our :class:`Router` built from the block's :class:`MoEConfig` (DeepSeek-V3: sigmoid scores, 4 groups keep 2, a
    random selection bias, scaling 2.5) with the same weight and bias chooses the same experts with the same weights as
    transformers' router, on fresh random tokens: a model converted to Mula routes as the original did."""
    from mula_lightning.moe.block import moe_config_of_hf_block
    from mula_lightning.moe.router import Router

    hf = _hf_block(family)
    ours = Router.from_config(moe_config_of_hf_block(hf))
    ours.load_state_dict(hf.gate.state_dict())
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4))
    _, weights, indices = hf.gate(x)
    out = ours(x)
    order, ref_order = out.indices_SK.argsort(-1), indices.argsort(-1)
    assert torch.equal(out.indices_SK.gather(1, order), indices.gather(1, ref_order))
    torch.testing.assert_close(out.weights_SK.gather(1, order), weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)
