"""The flat-shard AdamW every optimizer of the package runs (:mod:`mula_lightning.optim.adamw`)."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_adamw_update_equals_the_written_out_reference(dtype):
    """The one-pass ``torch._fused_adamw_`` path of ``adamw_update_`` against the written-out update it replaced, on
    fresh random flat shards with three parameter groups (their own lr, betas, eps, weight decay; runs that
    interleave and one empty run), over 5 steps: within 16 units of rounding of each tensor's scale in its dtype (the
    kernel rounds ``b2 v + (1 - b2) g^2`` in another order: 1 ulp in float64). A wrong group (swapped lr or weight
    decay) or step would fail it."""
    from mula_lightning.optim.adamw import adamw_update_, adamw_update_reference_

    gen = torch.Generator().manual_seed(7)
    groups = [
        dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
        dict(lr=5e-2, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.5),
    ]
    runs = [(0, 37, 0), (37, 100, 1), (100, 100, 2), (100, 161, 2), (161, 300, 0)]
    fused = [torch.randn(300, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2)]
    fused.append(torch.rand(300, generator=gen, dtype=torch.float64).to(dtype))
    reference = [t.clone() for t in fused]
    for step in range(1, 6):
        grads = torch.randn(300, generator=gen, dtype=torch.float64).to(dtype) * step
        adamw_update_(*fused[:1], grads, *fused[1:], runs, groups, step)
        adamw_update_reference_(*reference[:1], grads, *reference[1:], runs, groups, step)
    for name, got, expected in zip(("params", "exp_avg", "exp_avg_sq"), fused, reference):
        bound = 16 * torch.finfo(dtype).eps * expected.double().abs().max().item()
        assert (got.double() - expected.double()).abs().max().item() <= bound, name
