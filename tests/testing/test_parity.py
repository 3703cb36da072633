"""The parity rule of ``mula_lightning.testing.assert_parity``: tolerance = reduction_len x eps(dtype) x scale."""

import pytest
import torch

from mula_lightning.testing import assert_parity, parity_tolerance


def test_reordered_sums_pass_and_a_one_percent_error_fails_in_both_dtypes():
    """Sums of the same 4096 terms in two orders agree within the rule (float32 and float64); a change of one
    element by 1% of the scale (what a dropped token or a wrong scale does) is refused with the values named."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        terms = torch.randn(64, 4096, generator=g, dtype=dtype)
        forward = terms.sum(dim=1)
        backward = terms.flip(1).cumsum(dim=1)[:, -1]  # another order of the same additions
        assert assert_parity(backward, forward, reduction_len=4096, scale=terms.abs().sum(1).max().item()) >= 0
        broken = forward.clone()
        broken[3] += 0.01 * forward.abs().max()
        with pytest.raises(AssertionError, match=r"1 of 64 elements differ by more than .* at flat index 3"):
            assert_parity(broken, forward, reduction_len=4096, msg="sum")


def test_tolerance_formula_nan_and_shape_mismatch():
    """The tolerance is the formula; NaN and a shape or dtype mismatch fail; integers compare exactly."""
    x = torch.tensor([0.5, -2.0], dtype=torch.float64)
    assert parity_tolerance(x, reduction_len=10) == 10 * torch.finfo(torch.float64).eps * 2.0
    assert parity_tolerance(x, reduction_len=10, dtype=torch.float32) == 10 * torch.finfo(torch.float32).eps * 2.0
    with pytest.raises(AssertionError):
        assert_parity(torch.tensor([float("nan"), -2.0], dtype=torch.float64), x, reduction_len=10)
    with pytest.raises(AssertionError, match="shape/dtype"):
        assert_parity(x.float(), x, reduction_len=10)
    with pytest.raises(AssertionError):
        assert_parity(torch.tensor([1, 2]), torch.tensor([1, 3]), reduction_len=10)
    with pytest.raises(ValueError, match=r"reduction_len \(0\)"):
        parity_tolerance(x, reduction_len=0)
