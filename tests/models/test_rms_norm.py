"""The fused RMSNorm against the formula as written: forward and both gradients, float64 and float32, any shape."""

import pytest
import torch

from mula_lightning.models.rms_norm import rms_norm, rms_norm_reference
from mula_lightning.models.transformer import RMSNorm


@pytest.mark.parametrize("shape", [(7,), (3, 5, 16), (2, 4, 3, 32)])
def test_fused_rms_norm_equals_the_formula_forward_and_gradients(shape):
    """Fresh random inputs, weights and output gradients (float64): the fused function's output and the gradients
    of the input and the weight equal the reference's autograd; torch's gradcheck agrees with finite differences."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    grads = []
    for fn in (rms_norm, rms_norm_reference):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, wi.grad))
    for fused, reference in zip(*grads):
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    xs, ws = x[..., :5].clone().requires_grad_(), w[:5].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (xs, ws))


def test_float32_matches_and_other_inputs_take_the_formula():
    """float32: within float32 rounding of the float64 formula, input gradient only when the weight is frozen; bf16
    takes the formula itself (transformers casts back before the weight), so it equals it exactly."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 64, generator=g), torch.randn(64, generator=g)
    exact = rms_norm_reference(x.double(), w.double(), 1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5).double(), exact, rtol=1e-5, atol=1e-6)
    xi = x.clone().requires_grad_()
    rms_norm(xi, w, 1e-5).sum().backward()
    assert xi.grad is not None and torch.isfinite(xi.grad).all()
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(rms_norm(xb, wb, 1e-5), rms_norm_reference(xb, wb, 1e-5))
    module = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(w)
    assert torch.equal(module(x), rms_norm(x, w, 1e-5))
