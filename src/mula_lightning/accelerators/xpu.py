"""``XPUAccelerator``: Intel Data Center GPU Max (``torch.xpu``, ``xccl``) for the Trainer and for Fabric.

Why: the Aurora paper trains on Intel XPUs, but Lightning ships no XPU accelerator (Lightning issues #20938 and
#20848; PRs #17700 and #19443 were never merged) and ``intel-extension-for-pytorch`` is retired. Without one,
``accelerator: auto`` on an Aurora node trains on 12 CPU processes, silently. PyTorch itself supports XPU natively
(``torch.xpu`` and the ``xccl`` process-group backend, ``torch.distributed.Backend.default_device_backend_map``
maps ``xpu`` to ``xccl``), so the accelerator is thin:

* ``Trainer(accelerator="xpu", devices=12)`` / ``Fabric(accelerator="xpu", ...)``: registered as ``"xpu"`` in both
  registries when :mod:`mula_lightning.accelerators` is imported (``import mula_lightning`` does it);
* device parsing as for CUDA: an int (``-1`` = all), a list of indices, a string ``"0,1"`` / ``"2"``;
* every DDP-based strategy (``ddp``, ``epso``, ``zero_topo``) gets ``xccl`` from the root device's type;
* ``get_device_stats`` gives ``torch.xpu.memory_stats`` (``DeviceStatsMonitor``, throughput logging).

Lightning chooses accelerators, single-device strategies and AMP devices in its connectors from fixed lists (CUDA,
MPS, TPU); :func:`install_lightning_xpu_support` wraps four of those (private) methods, when this Lightning has them
(2.5.5 to 2.6; a release without them leaves the connectors untouched, with one warning, and only the auto-selection
of XPU is lost), so that ``accelerator="auto"`` and
``"gpu"`` pick XPU when ``torch.xpu.is_available()`` (after CUDA, MPS and TPU), one XPU device gets a
``SingleDeviceStrategy`` on that device instead of the CPU, and ``bf16-mixed`` autocasts on ``xpu``, not ``cuda``.
The wrappers only change a decision that involves XPU; every other answer is Lightning's own. ``accelerator: auto``
on a machine with no accelerator logs one line saying it runs on the CPU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.accelerators.accelerator import Accelerator
from typing_extensions import override

__all__ = ["XPUAccelerator", "install_lightning_xpu_support", "parse_xpu_devices", "xpu_device_count"]

log = logging.getLogger(__name__)


def xpu_device_count() -> int:
    """XPU devices PyTorch sees (0 without native XPU support or without a device)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return 0
    return int(xpu.device_count())


def parse_xpu_devices(devices: int | str | list[int] | tuple[int, ...]) -> list[int]:
    """``devices`` as XPU indices: ``2`` -> ``[0, 1]``, ``-1`` / ``"-1"`` -> all, ``"0,2"`` / ``[0, 2]`` -> those.

    Raises:
        ValueError: naming the request and the devices this machine has (none, too few, an index out of range).
    """
    available = xpu_device_count()
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            devices = [int(part) for part in text.split(",") if part.strip()]
        elif text.lstrip("-").isdigit():
            devices = int(text)
        else:
            raise ValueError(f"devices={devices!r}: expected an int, -1, or a comma-separated list of XPU indices")
    if isinstance(devices, int):
        if devices == -1:
            devices = available
        if devices < 1:
            raise ValueError(f"devices={devices}: ask for at least one XPU device (or -1 for all)")
        if devices > available:
            raise ValueError(f"devices={devices}: this machine has {available} XPU device(s)")
        return list(range(devices))
    indices = [int(i) for i in devices]
    bad = [i for i in indices if not 0 <= i < available]
    if not indices or bad or len(set(indices)) != len(indices):
        raise ValueError(
            f"devices={list(devices)}: XPU indices must be distinct and in [0, {available}) on this machine"
        )
    return indices


class XPUAccelerator(Accelerator):
    """Accelerator for Intel XPU devices (native ``torch.xpu``), for the Trainer and for Fabric."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "xpu":
            raise ValueError(f"XPUAccelerator needs an xpu device, got {device}")
        torch.xpu.set_device(device)

    @override
    def setup(self, trainer: Any) -> None:
        pass

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """``torch.xpu.memory_stats`` of ``device`` (allocated, reserved, peaks), as ``DeviceStatsMonitor`` logs."""
        return dict(torch.xpu.memory_stats(device))

    @override
    def teardown(self) -> None:
        if xpu_device_count():
            torch.xpu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: Any) -> list[int]:
        return parse_xpu_devices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("xpu", i) for i in parse_xpu_devices(devices)]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return xpu_device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return xpu_device_count() > 0

    @staticmethod
    @override
    def name() -> str:
        return "xpu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


def _is_xpu(flag: Any) -> bool:
    return flag == "xpu" or isinstance(flag, XPUAccelerator)


#: the private connector methods the XPU support wraps (Lightning 2.5.5 - 2.6 have all four)
CONNECTOR_METHODS = (
    "_choose_auto_accelerator",
    "_choose_gpu_accelerator_backend",
    "_choose_strategy",
    "_check_and_init_precision",
)


def _xpu_selection_off(why: str) -> bool:
    """Warn once that ``accelerator="auto"`` / ``"gpu"`` will not pick XPU (``"xpu"`` still works); False."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            f"mula_lightning: XPU auto-selection is off ({why}); Trainer(accelerator='xpu') still works, and CUDA "
            "and CPU runs are unaffected",
            stacklevel=3,
        )
    return False


_WARNED = False


def _wrap_connector(connector_cls: type) -> bool:
    """Make one Lightning connector class (Trainer's or Fabric's) XPU-aware; idempotent. Returns whether it did:
    a Lightning without one of :data:`CONNECTOR_METHODS` is left untouched, with one warning."""
    if getattr(connector_cls, "_mula_xpu_support", False):
        return True
    missing = [name for name in CONNECTOR_METHODS if not callable(getattr(connector_cls, name, None))]
    if missing:
        return _xpu_selection_off(f"{connector_cls.__name__} of this Lightning has no {', '.join(missing)}")
    auto, gpu = connector_cls._choose_auto_accelerator, connector_cls._choose_gpu_accelerator_backend
    choose_strategy, init_precision = connector_cls._choose_strategy, connector_cls._check_and_init_precision

    def choose_auto_accelerator() -> str:
        choice = auto()
        if choice == "cpu" and XPUAccelerator.is_available():
            return "xpu"
        if choice == "cpu":
            log.info("accelerator='auto': no CUDA, XPU, MPS or TPU device found; running on the CPU")
        return choice

    def choose_gpu_accelerator_backend() -> str:
        try:
            return gpu()
        except Exception:  # Lightning's "No supported gpu backend found!" (RuntimeError or MisconfigurationException)
            if XPUAccelerator.is_available():
                return "xpu"
            raise

    fabric = connector_cls.__module__.startswith("lightning.fabric")
    if fabric:
        from lightning.fabric.plugins.precision import MixedPrecision
        from lightning.fabric.strategies import SingleDeviceStrategy
    else:
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning.pytorch.strategies import SingleDeviceStrategy

    def choose_strategy_for_xpu(self: Any) -> Any:
        devices = getattr(self, "_parallel_devices", None) or []
        if _is_xpu(self._accelerator_flag) and len(devices) <= 1 and getattr(self, "_num_nodes_flag", 1) <= 1:
            return SingleDeviceStrategy(device=devices[0] if devices else torch.device("xpu", 0))
        return choose_strategy(self)

    def check_and_init_precision_for_xpu(self: Any) -> Any:
        flag = getattr(self, "_precision_input" if fabric else "_precision_flag", None)
        if _is_xpu(self._accelerator_flag) and flag in ("16-mixed", "bf16-mixed"):
            return MixedPrecision(precision=flag, device="xpu")
        return init_precision(self)

    connector_cls._choose_auto_accelerator = staticmethod(choose_auto_accelerator)
    connector_cls._choose_gpu_accelerator_backend = staticmethod(choose_gpu_accelerator_backend)
    connector_cls._choose_strategy = choose_strategy_for_xpu
    connector_cls._check_and_init_precision = check_and_init_precision_for_xpu
    connector_cls._mula_xpu_support = True
    return True


def install_lightning_xpu_support() -> None:
    """Register ``"xpu"`` with the Trainer's and Fabric's accelerator registries and make their connectors choose it
    (see the module docstring). Idempotent; called when :mod:`mula_lightning.accelerators` is imported."""
    for registry in (AcceleratorRegistry, ACCELERATOR_REGISTRY):
        if "xpu" not in registry:
            XPUAccelerator.register_accelerators(registry)
    try:
        from lightning.fabric.connector import _Connector
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    except ImportError as err:  # a Lightning that moved its connectors: registration above still works
        _xpu_selection_off(f"Lightning's connectors are not where 2.5.5 - 2.6 keep them: {err}")
        return
    _wrap_connector(_AcceleratorConnector)
    _wrap_connector(_Connector)
