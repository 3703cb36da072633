"""FastSparseMoEBlock as a drop-in for transformers' OLMoE and Mixtral sparse MoE blocks (tiny random configs)."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from mula_lightning.models.config import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock, patch_hf_moe

H, I = 32, 16  # noqa: E741


def olmoe_block(num_experts: int, top_k: int, norm_topk_prob: bool, dtype=torch.float32) -> OlmoeSparseMoeBlock:
    cfg = OlmoeConfig(
        hidden_size=H,
        intermediate_size=I,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        experts_implementation="eager",
    )
    block = OlmoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(num_experts + top_k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.to(dtype)


def forward_backward(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_()
    y = block(xi)
    (y.float() * g).sum().backward()
    return [y.detach().float(), xi.grad.float()] + [p.grad.float() for p in block.parameters()]


@pytest.mark.parametrize("E,K,norm", [(1, 1, False), (8, 2, False), (8, 2, True), (64, 8, False)])
def test_matches_hf_olmoe_eager_fp32(E, K, norm):
    """A FastSparseMoEBlock built from our config and loaded with an HF OLMoE block's state dict matches that block
    run eagerly: output and gradients of input, router and experts within rtol 1e-5, atol 1e-6*max|ref|
    (odd token count; with E=64 several experts receive no token)."""
    hf = olmoe_block(E, K, norm)
    ours = FastSparseMoEBlock(
        MulaConfig.from_name(
            "mula-tiny-moe", hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, norm_topk_prob=norm
        )
    )
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 17, H, generator=torch.Generator().manual_seed(0))
    g = torch.randn(3, 17, H, generator=torch.Generator().manual_seed(1))
    for a, b in zip(forward_backward(ours, x, g), forward_backward(hf, x, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


@pytest.mark.parametrize("E,K", [(1, 1), (8, 2), (64, 8)])
def test_from_hf_matches_hf_olmoe_bf16(E, K):
    """In bf16, ``from_hf`` (which routes with the HF router itself, so both sides pick the same experts) agrees
    with the eager HF block in output and all gradients to a relative Frobenius error <= 1e-2."""
    hf = olmoe_block(E, K, False, dtype=torch.bfloat16)
    ours = FastSparseMoEBlock.from_hf(hf)
    x = torch.randn(1, 23, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    g = torch.randn(1, 23, H, generator=torch.Generator().manual_seed(3))
    fast = forward_backward(ours, x, g)
    hf.zero_grad()  # the parameters are shared
    ref = forward_backward(hf, x, g)
    for a, b in zip(fast, ref):
        assert (a - b).norm() <= 1e-2 * b.norm()


def test_from_hf_shares_parameters_and_router():
    """``from_hf`` keeps the HF router module and the very same parameter objects (so optimizers stay valid)."""
    hf = olmoe_block(8, 2, False)
    ours = FastSparseMoEBlock.from_hf(hf)
    assert ours.gate is hf.gate
    assert [id(p) for p in ours.parameters()] == [id(p) for p in hf.parameters()]
    assert list(ours.state_dict()) == list(hf.state_dict())


def tiny_olmoe() -> OlmoeForCausalLM:
    cfg = OlmoeConfig(
        vocab_size=96,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg)


def tiny_mixtral() -> MixtralForCausalLM:
    cfg = MixtralConfig(
        vocab_size=96,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def loss_and_grads(model, input_ids, **kwargs):
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make_model", [tiny_olmoe, tiny_mixtral], ids=["olmoe", "mixtral"])
def test_patch_hf_moe_keeps_loss_and_gradients(make_model):
    """``patch_hf_moe`` swaps every sparse MoE block in place; loss, logits and every parameter gradient are
    unchanged (rtol 1e-5), with ``output_router_logits=True`` still returning the router logits and aux loss."""
    model = make_model()
    input_ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(0))
    before, grads_before = loss_and_grads(model, input_ids, output_router_logits=True)
    params_before = {n: id(p) for n, p in model.named_parameters()}

    patch_hf_moe(model)
    blocks = [m for m in model.modules() if isinstance(m, FastSparseMoEBlock)]
    assert len(blocks) == model.config.num_hidden_layers
    assert {n: id(p) for n, p in model.named_parameters()} == params_before
    after, grads_after = loss_and_grads(model, input_ids, output_router_logits=True)

    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-6 * before.logits.abs().max().item())
    torch.testing.assert_close(after.loss, before.loss, rtol=1e-5, atol=0)
    assert len(after.router_logits) == len(before.router_logits) == model.config.num_hidden_layers
    for a, b in zip(after.router_logits, before.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after.aux_loss, before.aux_loss, rtol=1e-5, atol=0)
    assert grads_after.keys() == grads_before.keys()
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def test_patch_hf_moe_rejects_a_model_without_moe_blocks():
    """Patching a model with nothing to patch is an error that names the block types (not a silent no-op)."""
    with pytest.raises(ValueError, match="OlmoeSparseMoeBlock"):
        patch_hf_moe(torch.nn.Sequential(torch.nn.Linear(2, 2)))
