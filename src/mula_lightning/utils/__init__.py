"""Small utilities shared across the package (device and backend selection)."""

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
