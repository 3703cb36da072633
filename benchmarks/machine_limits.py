"""What the machine itself can do, measured in the same run as a benchmark: its GEMM rate and a process's peak memory.

Shared by ``benchmarks/train.py`` (``mula fit`` vs Lightning DDP) and ``benchmarks/model_step.py`` (one process):
"fraction of the GEMM limit" is a step's model FLOPs over its time, divided by :func:`gemm_rate` of the model's
largest GEMM with the same threads (on a GPU the same ratio is MFU against what the device reaches, not its
datasheet).
"""

from __future__ import annotations

import time

import torch


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``) in MB; NaN where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_memory_mb(device: torch.device) -> float:
    """The peak memory of this process on ``device`` in MB: its allocator's peak on an accelerator (what the model
    and its activations took there), :func:`peak_rss_mb` on the CPU."""
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).max_memory_allocated(device) / 2**20
    return peak_rss_mb()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (a no-op on CPU), so that a host timer measures their work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def gemm_rate(
    rank,
    world_size,
    m: int,
    k: int,
    n: int,
    threads: int,
    seconds: float = 2.0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """FLOP/s of this rank's ``torch.mm`` of (m, k) x (k, n) in ``dtype`` on ``device`` (``threads`` host threads),
    all ranks at once (a ``run_distributed_test`` function: the ranks start timing together)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:  # one device per rank, as the contenders use them
        dev = torch.device(dev.type, rank % getattr(torch, dev.type).device_count())
        getattr(torch, dev.type).set_device(dev)
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(m, k, generator=gen).to(dev, dtype)
    b = torch.randn(k, n, generator=gen).to(dev, dtype)
    for _ in range(3):
        torch.mm(a, b)
    synchronize(dev)
    if dist.is_initialized():
        dist.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
        synchronize(dev)
    return 2.0 * m * k * n * count / (time.perf_counter() - start)
