"""Leaf helpers shared across the package; they import nothing else from it.

``device`` (device and backend selection), ``dist`` (process-group and object-collective helpers), ``io`` (atomic
writes), ``precision`` (the compute dtype of sensitive steps), ``safe_load`` (checkpoint readers that build data only).
"""

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
