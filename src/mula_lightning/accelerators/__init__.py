"""Accelerators Lightning does not ship: Intel XPU (:class:`XPUAccelerator`, native ``torch.xpu`` and ``xccl``).

Importing this package registers ``"xpu"`` with the Trainer's and Fabric's accelerator registries and teaches their
``accelerator="auto"`` / ``"gpu"`` choice about XPU (:func:`install_lightning_xpu_support`); ``import
mula_lightning`` imports it only when Lightning is used (``mula fit``, the strategies), so ``import
mula_lightning.models`` stays free of Lightning.
"""

from mula_lightning.accelerators.xpu import (
    XPUAccelerator,
    install_lightning_xpu_support,
    parse_xpu_devices,
    xpu_device_count,
)

install_lightning_xpu_support()

__all__ = ["XPUAccelerator", "install_lightning_xpu_support", "parse_xpu_devices", "xpu_device_count"]
