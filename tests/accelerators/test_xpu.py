"""The XPU accelerator with ``torch.xpu`` mocked on CPU: the Trainer and Fabric resolve ``"xpu"`` (and ``"auto"`` /
``"gpu"`` when XPU is available) to :class:`XPUAccelerator`, the right device indices, ``xccl`` for every DDP-based
strategy (epso, zero_topo, ddp), one-device runs on the XPU (not the CPU), and AMP on ``xpu``."""

import logging

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

from mula_lightning.accelerators import XPUAccelerator, parse_xpu_devices


@pytest.fixture
def fake_xpus(monkeypatch):
    """Two XPU devices as torch.xpu reports them (availability, count, memory statistics); set_device is a no-op."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    monkeypatch.setattr(torch.xpu, "set_device", lambda device: None)
    monkeypatch.setattr(torch.xpu, "memory_stats", lambda device=None: {"allocated_bytes.all.current": 123})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return 2


def _trainer(**kwargs):
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("strategy", ["epso", "zero_topo", "ddp"])
def test_trainer_resolves_xpu_devices_and_xccl(fake_xpus, strategy):
    """`Trainer(accelerator="xpu", devices=2, strategy=...)`: the XPU accelerator, devices xpu:0 and xpu:1, rank 0 on
    xpu:0, and the process group backend xccl."""
    import mula_lightning.strategies  # noqa: F401  (registers epso / zero_topo)

    trainer = _trainer(accelerator="xpu", devices=2, strategy=strategy)
    assert isinstance(trainer.accelerator, XPUAccelerator)
    assert trainer.strategy.parallel_devices == [torch.device("xpu", 0), torch.device("xpu", 1)]
    assert trainer.strategy.root_device == torch.device("xpu", 0)
    assert trainer.strategy._get_process_group_backend() == "xccl"
    assert trainer.accelerator.get_device_stats(trainer.strategy.root_device) == {"allocated_bytes.all.current": 123}


def test_fabric_resolves_xpu_devices_and_xccl(fake_xpus):
    """`Fabric(accelerator="xpu", devices=[1], ...)` and `devices=2, strategy="epso"` pick the XPU accelerator, the
    requested indices and xccl."""
    import mula_lightning.strategies  # noqa: F401

    fabric = Fabric(accelerator="xpu", devices=2, strategy="epso")
    assert isinstance(fabric.accelerator, XPUAccelerator)
    assert fabric.strategy.parallel_devices == [torch.device("xpu", 0), torch.device("xpu", 1)]
    assert fabric.strategy._get_process_group_backend() == "xccl"
    single = Fabric(accelerator="xpu", devices=[1])
    assert single.device == torch.device("xpu", 1)


@pytest.mark.parametrize("flag", ["auto", "gpu"])
def test_auto_and_gpu_pick_xpu_when_available(fake_xpus, flag):
    """With XPUs and no CUDA, `accelerator="auto"` / `"gpu"` with one device trains on xpu:0 (a single-device strategy
    on the XPU, not on the CPU), in the Trainer and in Fabric; bf16-mixed autocasts on xpu."""
    trainer = _trainer(accelerator=flag, devices=1, precision="bf16-mixed")
    assert isinstance(trainer.accelerator, XPUAccelerator)
    assert trainer.strategy.root_device == torch.device("xpu", 0)
    assert trainer.precision_plugin.device == "xpu"
    fabric = Fabric(accelerator=flag, devices=1, precision="bf16-mixed")
    assert isinstance(fabric.accelerator, XPUAccelerator) and fabric.device == torch.device("xpu", 0)
    assert fabric._precision.device == "xpu"


def test_auto_without_accelerators_says_it_runs_on_cpu(caplog, monkeypatch):
    """No XPU, no CUDA: `accelerator="auto"` is the CPU, and one log line says so."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import mula_lightning.accelerators  # noqa: F401

    with caplog.at_level(logging.INFO, logger="mula_lightning.accelerators.xpu"):
        trainer = _trainer(accelerator="auto", devices=1)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert [r.message for r in caplog.records if "running on the CPU" in r.message]


def test_device_parsing_and_errors(fake_xpus):
    """Ints, -1, strings and lists as for CUDA; a request beyond the machine's devices names what it has."""
    assert parse_xpu_devices(2) == [0, 1] and parse_xpu_devices(-1) == [0, 1] and parse_xpu_devices("-1") == [0, 1]
    assert parse_xpu_devices("1") == [0] and parse_xpu_devices("1,0") == [1, 0] and parse_xpu_devices([1]) == [1]
    with pytest.raises(ValueError, match="this machine has 2 XPU"):
        parse_xpu_devices(3)
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        parse_xpu_devices([0, 2])
    with pytest.raises(ValueError, match="distinct"):
        parse_xpu_devices([1, 1])
    with pytest.raises(ValueError, match="at least one"):
        parse_xpu_devices(0)


def test_xpu_without_devices_is_refused_by_lightning(monkeypatch):
    """`accelerator="xpu"` on a machine without XPUs is refused before anything starts (Lightning's own check that
    the accelerator is available, which now knows "xpu")."""
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    import mula_lightning.accelerators  # noqa: F401

    with pytest.raises(Exception, match="xpu|XPU"):
        _trainer(accelerator="xpu", devices=1)


def test_a_lightning_without_the_connector_methods_keeps_working_and_warns_once(monkeypatch):
    """A Lightning release that renamed one of the private connector methods: wrapping leaves the class untouched
    (no AttributeError at import, so CUDA and CPU users are unaffected), says once why XPU auto-selection is off,
    and the registered "xpu" accelerator still resolves by name."""
    import mula_lightning.accelerators.xpu as xpu

    class Renamed:
        @staticmethod
        def _choose_auto_accelerator():
            return "cpu"

        @staticmethod
        def _choose_gpu_accelerator_backend():
            return "cuda"

        def _select_strategy(self):  # was _choose_strategy
            return None

        def _check_and_init_precision(self):
            return None

    monkeypatch.setattr(xpu, "_WARNED", False)
    with pytest.warns(UserWarning, match=r"XPU auto-selection is off \(Renamed .* has no _choose_strategy\)"):
        assert xpu._wrap_connector(Renamed) is False
    assert Renamed._choose_auto_accelerator() == "cpu" and not hasattr(Renamed, "_mula_xpu_support")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert xpu._wrap_connector(Renamed) is False  # once only
    from lightning.pytorch.accelerators import AcceleratorRegistry

    assert "xpu" in AcceleratorRegistry
