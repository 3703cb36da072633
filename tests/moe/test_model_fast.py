"""``MulaForCausalLM`` with ``moe_impl="fast"`` against ``moe_impl="reference"`` on the same weights."""

from __future__ import annotations

import pytest
import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.transformer import MulaForCausalLM
from mula_lightning.moe import FastSparseMoEBlock, ReferenceMoEBlock


def tiny(moe_impl: str, **overrides) -> MulaForCausalLM:
    cfg = MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=16,
        num_layers=2,
        moe_impl=moe_impl,
        **overrides,
    )
    return MulaForCausalLM(cfg)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"router_kind": "topk_softmax", "capacity_factor": 1.0}, {"num_experts": 64, "top_k": 8}],
    ids=["olmoe", "mixtral-capacity", "e64-k8"],
)
def test_fast_model_matches_reference_model(overrides):
    """Logits, LM loss, aux loss, per-layer MoE stats and every parameter gradient of the fast model equal those
    of the reference model loaded with the same state dict (fp32, rtol 1e-5)."""
    ref, fast = tiny("reference", **overrides), tiny("fast", **overrides)
    assert isinstance(fast.model.layers[0].mlp, FastSparseMoEBlock)
    assert isinstance(ref.model.layers[0].mlp, ReferenceMoEBlock)
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (ref, fast):
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (r, rg), (f, fg) = outs
    torch.testing.assert_close(f.logits, r.logits, rtol=1e-5, atol=1e-6 * r.logits.abs().max().item())
    torch.testing.assert_close(f.loss, r.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(f.aux_loss, r.aux_loss, rtol=1e-5, atol=0)
    for a, b in zip(f.moe_aux, r.moe_aux):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and torch.equal(a.num_dropped, b.num_dropped)
    for name, grad in rg.items():
        torch.testing.assert_close(fg[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def test_fast_block_is_the_default():
    """``MulaForCausalLM`` builds its MoE layers with FastSparseMoEBlock unless told otherwise."""
    cfg = MulaConfig.from_name("mula-tiny-moe", vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=1)
    assert cfg.moe_impl == "fast"
    assert isinstance(MulaForCausalLM(cfg).model.layers[0].mlp, FastSparseMoEBlock)
