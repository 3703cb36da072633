"""``counting_host_reads``: which tensor reads a block makes and where (the counter the step tests rely on)."""

from __future__ import annotations

import os

import torch

from mula_lightning.testing import counting_host_reads


def test_counting_host_reads_sees_reads_and_data_dependent_sizes():
    """The counter records value reads, branches on tensors and data-sized results where the caller made them, and
    nothing for device-side work."""
    x = torch.arange(6.0)
    with counting_host_reads() as reads:
        y = (x * 2).sum()  # device-side: not a read
        x.sum().item()
        x.tolist()
        if x[0] == 0:  # bool() of a tensor
            pass
        x[x > 2]  # boolean mask: sized by the data
        torch.nonzero(x)
        torch.bincount(x.long())
    assert y == 30
    names = sorted(name for name, _ in reads.sites)
    assert names == ["__bool__", "__getitem__", "bincount", "item", "nonzero", "tolist"], reads.sites
    assert reads.total(os.path.basename(__file__)) == 6
