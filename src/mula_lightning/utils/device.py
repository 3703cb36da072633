"""Device and collective-backend selection that works with CUDA, Intel XPU (native ``torch.xpu``) or only a CPU.

Everything above this module asks "which device, which backend" through these functions, so the rest of the
package never branches on ``torch.cuda`` directly and imports and runs on a machine without an accelerator.

The priority order is CUDA, then XPU, then CPU: a machine exposes at most one of the two accelerator kinds in
practice, and CPU is the always-available fallback used by the test suite (gloo).

Memory helpers (``max_memory_allocated``, ``reset_peak_memory_stats``, ``empty_cache``) call the accelerator's own
allocator statistics. On CPU PyTorch keeps no allocator statistics, so ``max_memory_allocated`` reports the
process's peak resident set size instead (documented on the function), which is the closest honest number.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

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

#: The collective backend that ``torch.distributed`` uses for each device type.
BACKEND_FOR_DEVICE: dict[str, str] = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}


def _xpu_available() -> bool:
    """True when PyTorch's native XPU support is compiled in and a device is visible."""
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and xpu.is_available()


def accelerator_type() -> str:
    """The device type this process should compute on: ``"cuda"``, ``"xpu"`` or ``"cpu"``.

    CUDA wins over XPU, and CPU is the fallback, so the answer is deterministic on any machine.
    """
    if torch.cuda.is_available():
        return "cuda"
    if _xpu_available():
        return "xpu"
    return "cpu"


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return accelerator_type()
    return torch.device(device).type


def _accelerator_module(device_type: str) -> ModuleType | None:
    """``torch.cuda`` / ``torch.xpu`` for an accelerator type, ``None`` for CPU (no allocator, no streams)."""
    if device_type in ("cuda", "xpu"):
        return getattr(torch, device_type)
    if device_type == "cpu":
        return None
    raise ValueError(f"unsupported device type {device_type!r}; expected one of {sorted(BACKEND_FOR_DEVICE)}")


def backend_for(device_type: torch.device | str) -> str:
    """The ``torch.distributed`` backend for a device type (``cuda -> nccl``, ``xpu -> xccl``, ``cpu -> gloo``).

    Args:
        device_type: ``"cuda"``, ``"xpu"``, ``"cpu"``, a ``torch.device`` or a device string such as ``"cuda:1"``.

    Raises:
        ValueError: for a device type with no collective backend here (the message lists the known ones).
    """
    kind = device_type.type if isinstance(device_type, torch.device) else device_type.split(":")[0]
    try:
        return BACKEND_FOR_DEVICE[kind]
    except KeyError:
        raise ValueError(
            f"no collective backend for device type {kind!r}; known: "
            + ", ".join(f"{k} -> {v}" for k, v in BACKEND_FOR_DEVICE.items())
        ) from None


def device_count(device_type: str | None = None) -> int:
    """Number of visible devices of a type (1 for CPU: one process, one CPU device)."""
    module = _accelerator_module(_device_type(device_type))
    return 1 if module is None else module.device_count()


def default_device() -> torch.device:
    """The current device of the preferred accelerator (with its index), or ``cpu``."""
    kind = accelerator_type()
    module = _accelerator_module(kind)
    return torch.device("cpu") if module is None else torch.device(kind, module.current_device())


def device_for_local_rank(local_rank: int, ranks_per_gpu: int = 1, device_type: str | None = None) -> torch.device:
    """The device a process with this node-local rank should use.

    With ``ranks_per_gpu > 1`` several ranks share one device (e.g. a test that simulates two ranks per GPU, or a
    CPU run); the device index is ``local_rank // ranks_per_gpu``.

    Args:
        local_rank: rank within the node (``LOCAL_RANK``).
        ranks_per_gpu: how many consecutive local ranks share one device.
        device_type: ``"cuda"``, ``"xpu"`` or ``"cpu"``; by default the preferred accelerator.

    Raises:
        ValueError: when the computed index is beyond the visible devices (the message shows the values).
    """
    if local_rank < 0 or ranks_per_gpu < 1:
        raise ValueError(f"local_rank ({local_rank}) must be >= 0 and ranks_per_gpu ({ranks_per_gpu}) >= 1")
    kind = _device_type(device_type)
    if kind == "cpu":
        return torch.device("cpu")
    index = local_rank // ranks_per_gpu
    count = device_count(kind)
    if index >= count:
        raise ValueError(
            f"local_rank {local_rank} with ranks_per_gpu={ranks_per_gpu} needs {kind}:{index}, "
            f"but only {count} {kind} device(s) are visible"
        )
    return torch.device(kind, index)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU, where kernels run synchronously).

    Needed before reading a wall clock in benchmarks, since accelerator kernels run asynchronously.
    """
    kind = _device_type(device)
    module = _accelerator_module(kind)
    if module is not None:
        module.synchronize(device)


def empty_cache(device_type: str | None = None) -> None:
    """Return cached, unused allocator blocks to the driver (a no-op on CPU, which has no caching allocator)."""
    module = _accelerator_module(_device_type(device_type))
    if module is not None:
        module.empty_cache()


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes, 0 where the platform cannot tell."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS reports bytes, Linux KiB


def max_memory_allocated(device: torch.device | str | None = None) -> int:
    """Peak bytes allocated by tensors on ``device`` since the start or the last ``reset_peak_memory_stats``.

    On CPU PyTorch tracks no allocations, so this returns the process's peak resident set size (all memory the
    process touched, not only tensors, and not resettable); use it as an upper bound for CPU runs.
    """
    kind = _device_type(device)
    module = _accelerator_module(kind)
    if module is None:
        return _peak_rss_bytes()
    return int(module.max_memory_allocated(device))


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    """Reset the accelerator's peak-memory counter (a no-op on CPU, where the OS peak cannot be reset)."""
    module = _accelerator_module(_device_type(device))
    if module is not None:
        module.reset_peak_memory_stats(device)
