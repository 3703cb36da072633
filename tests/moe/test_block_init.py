"""A block built alone is usable: its router and expert weights are drawn at construction (as ``nn.Linear`` draws its
own), not left as whatever memory ``torch.empty`` returned; on the meta device nothing is allocated or drawn."""

import torch

from mula_lightning.moe import FastSparseMoEBlock, MoEConfig
from mula_lightning.moe.reference import ReferenceMoEBlock


def test_a_bare_block_has_drawn_weights_and_a_finite_output():
    """Every parameter of a bare block (fast and reference) lies within nn.Linear's bound 1/sqrt(fan_in), is not
    constant, and the forward and backward are finite."""
    config = MoEConfig(hidden_size=48, intermediate_size=20, num_experts=6, top_k=2, shared_experts=1)
    for cls in (FastSparseMoEBlock, ReferenceMoEBlock):
        torch.manual_seed(0)
        block = cls(config)
        for name, p in block.named_parameters():
            fan_in = p.shape[-1]
            assert p.abs().max() <= fan_in**-0.5, name
            assert p.std() > 0.2 * fan_in**-0.5, name  # drawn, not zeros or a constant
        x = torch.randn(2, 7, 48, requires_grad=True)
        y, aux = block.forward_with_aux(x)
        (y.square().mean() + aux.aux_loss).backward()
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_a_meta_block_draws_nothing():
    """On the meta device the block is built without data (the path every sharded strategy takes)."""
    config = MoEConfig(hidden_size=48, intermediate_size=20, num_experts=6, top_k=2)
    with torch.device("meta"):
        block = FastSparseMoEBlock(config)
    assert all(p.is_meta for p in block.parameters())
