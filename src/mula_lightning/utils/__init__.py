"""Leaf helpers shared across the package; they import nothing else from it.

``device`` (device and backend selection), ``dist`` (process-group and object-collective helpers), ``io`` (atomic
writes), ``precision`` (the compute dtype of sensitive steps), ``safe_load`` (checkpoint readers that build data
only), ``dcp_box_read`` (the part of a stored DCP chunk a request needs, read alone), ``launch_env`` (what ``mula
launch`` and its ranks agree on).

The device helpers are re-exported here but imported on first use (PEP 562): importing a torch-free leaf such as
``mula_lightning.utils.launch_env`` or ``mula_lightning.utils.io`` must not import torch, so that ``mula launch``,
its SLURM helpers and a process that only reads the launch protocol start in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mula_lightning.utils.device import (
        BACKEND_FOR_DEVICE,
        accelerator_type,
        backend_for,
        default_device,
        device_count,
        device_for_local_rank,
        empty_cache,
        max_memory_allocated,
        reset_peak_memory_stats,
        synchronize,
    )

__all__ = [
    "BACKEND_FOR_DEVICE",
    "accelerator_type",
    "backend_for",
    "default_device",
    "device_count",
    "device_for_local_rank",
    "empty_cache",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "synchronize",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mula_lightning.utils.device"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
