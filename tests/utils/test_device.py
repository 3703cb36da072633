"""Tests for device and backend selection: the pure mappings, the CUDA -> XPU -> CPU order, and CPU fallbacks."""

from __future__ import annotations

import pytest
import torch

from mula_lightning.utils import device as device_utils
from mula_lightning.utils.device import (
    accelerator_type,
    backend_for,
    default_device,
    device_for_local_rank,
    empty_cache,
    max_memory_allocated,
    reset_peak_memory_stats,
    synchronize,
)


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cuda", "nccl"), ("xpu", "xccl"), ("cpu", "gloo"), ("cuda:3", "nccl"), (torch.device("cpu"), "gloo")],
)
def test_backend_for_maps_each_device_type(device: object, backend: str) -> None:
    """Each device type (as a string, an indexed string or a torch.device) maps to its collective backend."""
    assert backend_for(device) == backend


def test_backend_for_unknown_device_lists_known_ones() -> None:
    """An unknown device type is refused with the known mapping in the message."""
    with pytest.raises(ValueError, match=r"'mps'.*cuda -> nccl, xpu -> xccl, cpu -> gloo"):
        backend_for("mps")


@pytest.mark.parametrize(
    ("cuda", "xpu", "expected"),
    [(True, True, "cuda"), (True, False, "cuda"), (False, True, "xpu"), (False, False, "cpu")],
)
def test_accelerator_priority_is_cuda_then_xpu_then_cpu(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, xpu: bool, expected: str
) -> None:
    """With availability faked, the preferred device type follows CUDA -> XPU -> CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(device_utils, "_xpu_available", lambda: xpu)
    assert accelerator_type() == expected


def test_device_for_local_rank_shares_devices_between_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank r with k ranks per GPU uses device r // k; an index past the visible devices is refused."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert device_for_local_rank(3, device_type="cuda") == torch.device("cuda", 3)
    assert device_for_local_rank(5, ranks_per_gpu=2, device_type="cuda") == torch.device("cuda", 2)
    with pytest.raises(ValueError, match=r"needs cuda:4, but only 4 cuda device"):
        device_for_local_rank(4, device_type="cuda")
    assert device_for_local_rank(7, device_type="cpu") == torch.device("cpu")


def test_cpu_helpers_work_without_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no accelerator, the default device is CPU, sync/cache calls are no-ops and peak memory is a real RSS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_utils, "_xpu_available", lambda: False)
    assert default_device() == torch.device("cpu")
    synchronize()
    synchronize("cpu")
    empty_cache()
    reset_peak_memory_stats("cpu")
    before = max_memory_allocated("cpu")
    assert before > 10 * 2**20  # a Python process with torch loaded has touched more than 10 MiB
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert max_memory_allocated() >= before
    del big
