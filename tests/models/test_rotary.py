"""The fused rotary embedding against ``x * cos + rotate_half(x) * sin``: forward and gradient, on the tables the model
uses and on random ones, for contiguous and transposed (attention's) layouts."""

import pytest
import torch

from mula_lightning.models import MulaConfig
from mula_lightning.models.rotary import apply_rotary, apply_rotary_reference
from mula_lightning.models.transformer import rotary_cos_sin


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_fused_rotary_equals_the_formula_forward_and_gradient(transposed):
    """Float64, random input and output gradient, the model's cos / sin tables and random tables: the output and the
    input gradient equal the formula's autograd; gradcheck agrees with finite differences."""
    config = MulaConfig.from_name("mula-tiny-moe", hidden_size=64, num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(int(transposed))
    b, t, heads, hd = 2, 9, 3, config.head_dim
    tables = [rotary_cos_sin(config, t, torch.device("cpu"), torch.float64)]
    tables.append((torch.randn(t, hd, generator=g, dtype=torch.float64), torch.randn(t, hd, generator=g,
                                                                                    dtype=torch.float64)))  # fmt: skip
    for cos, sin in tables:
        x = torch.randn(b, t, heads, hd, generator=g, dtype=torch.float64)
        x = x.transpose(1, 2) if transposed else x.reshape(b, heads, t, hd)
        dy = torch.randn(b, heads, t, hd, generator=g, dtype=torch.float64)
        results = []
        for fn in (apply_rotary, apply_rotary_reference):
            xi = x.detach().clone().requires_grad_()
            y = fn(xi, cos, sin)
            y.backward(dy)
            results.append((y.detach(), xi.grad))
        for fused, reference in zip(*results):
            torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
        small = x[:1, :1, :4].detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, c=cos[:4], s=sin[:4]: apply_rotary(a, c, s), (small,))


def test_tables_that_need_a_gradient_take_the_formula():
    """cos / sin that require a gradient (not the model's constants) get it through the formula."""
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    cos = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    apply_rotary(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None
