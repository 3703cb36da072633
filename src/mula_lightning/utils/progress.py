"""Progress lines of a training run: what a person reads first to decide whether a run is healthy (issue 75).

One line per interval, as torchtitan and Megatron print them, on the global rank 0 only::

    step 45/300 | loss 6.1234 | aux 0.0123 | lr 2.90e-03 | 12.3k tok/s (3.08k/device) | MFU 41.2% | mem 1.23 GiB
    host | 0.512 s/step | left 2m10s

(one line, here wrapped). Rates are taken over the interval since the previous line (a first line after a resume
or a validation pause says what the run does now, not on average): tokens per second over every data-parallel
replica and per device, MFU when the device's peak is known (``peak_tflops``) and the model's FLOPs per token are,
the peak memory of the device (CUDA, XPU) or, on the CPU, the largest resident set sampled so far, the time per
optimizer step, and the time left at that pace. :class:`ProgressMeter` holds the arithmetic and the format for
both the Trainer (:class:`~mula_lightning.callbacks.progress.MulaProgress`) and Fabric loops, which call it
directly::

    meter = ProgressMeter(max_steps=1000, every_n_steps=10, world_size=fabric.world_size, enabled=fabric.is_global_zero)
    for step in range(1, 1001):
        ...  # forward, backward, step
        meter.add_tokens(batch.numel() * fabric.world_size)
        meter.step(step, loss=lambda: loss.item(), lr=optimizer.param_groups[0]["lr"])

``loss`` may be a callable: it is read (a host synchronisation on a GPU) only on the steps that print.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

__all__ = ["ProgressMeter", "format_duration", "format_rate", "peak_memory_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def format_duration(seconds: float) -> str:
    """``3h05m``, ``2m10s``, ``4.2s``: the two largest units."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_rate(value: float) -> str:
    """``950``, ``12.3k``, ``4.56M``: three significant figures."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _host_resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # not Linux: no sample
        return None


def peak_memory_bytes(device: torch.device | None) -> tuple[int, str] | None:
    """The peak memory the allocator of ``device`` (CUDA, XPU) handed out, or None for another device."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device)), "device"
    if device is not None and device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return int(torch.xpu.max_memory_allocated(device)), "device"
    return None


class ProgressMeter:
    """Prints a progress line every ``every_n_steps`` optimizer steps (and on :meth:`finish`), when ``enabled``.

    Args:
        max_steps: the run's last step (None or <= 0: unknown; no time left is printed).
        every_n_steps: the interval between lines (0: never, except :meth:`finish`).
        world_size: devices of the run (for the per-device rate and MFU).
        enabled: print at all (the global rank 0 only, in a multi-process run).
        peak_tflops: peak dense TFLOP/s of one device in the training precision; MFU is printed only with it.
        flops_per_token: model FLOPs of one token's forward and backward (for MFU).
        device: the training device (its allocator's peak memory; otherwise the host's resident set).
        stream: where lines go (default: standard output, flushed at each line).
    """

    def __init__(self, max_steps: int | None, every_n_steps: int, world_size: int = 1, enabled: bool = True,
                 peak_tflops: float | None = None, flops_per_token: float | None = None,
                 device: torch.device | None = None, stream: TextIO | None = None) -> None:  # fmt: skip
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps ({every_n_steps}) must be >= 0 (0: a line at the end only)")
        self.max_steps = max_steps if max_steps and max_steps > 0 else None
        self.every_n_steps, self.world_size, self.enabled = every_n_steps, max(int(world_size), 1), enabled
        self.peak_tflops, self.flops_per_token, self.device = peak_tflops, flops_per_token, device
        self.stream = stream
        self.lines: list[str] = []  # every line printed (for tests and reports)
        self._host_peak = 0  # the largest resident set sampled in the run
        self.restart()

    def restart(self, step: int = 0) -> None:
        """Start an interval at ``step`` now (a run's start, a resume, the end of a validation pause)."""
        self._since_step, self._since_time, self._tokens, self._last_step = step, time.perf_counter(), 0, step

    def add_tokens(self, tokens: int) -> None:
        """Tokens trained since the last call, over every data-parallel replica (a micro-batch's share)."""
        self._tokens += int(tokens)
        if self.enabled:
            resident = _host_resident_bytes()
            self._host_peak = max(self._host_peak, resident or 0)

    def due(self, step: int) -> bool:
        """Whether ``step`` (just completed) prints a line."""
        return self.enabled and self.every_n_steps > 0 and step > self._last_step and step % self.every_n_steps == 0

    def step(self, step: int, **metrics: float | Callable[[], float] | None) -> str | None:
        """Optimizer step ``step`` is done: print its line if it is due; the metrics (``loss``, ``aux``, ``lr``, any
        other name) may be callables, read only then. Returns the line printed, if any."""
        return self._line(step, metrics) if self.due(step) else None

    def finish(self, step: int, **metrics: float | Callable[[], float] | None) -> str | None:
        """The run ended at ``step``: its line, unless that step printed one already."""
        return self._line(step, metrics) if self.enabled and step > self._last_step else None

    def _line(self, step: int, metrics: dict[str, Any]) -> str:
        now = time.perf_counter()
        steps, elapsed = step - self._since_step, max(now - self._since_time, 1e-9)
        parts = [f"step {step}/{self.max_steps}" if self.max_steps else f"step {step}"]
        for name, value in metrics.items():
            value = value() if callable(value) else value
            if value is not None:
                parts.append(f"{name} {value:.2e}" if name == "lr" else f"{name} {value:.4f}")
        if self._tokens:
            rate = self._tokens / elapsed
            parts.append(f"{format_rate(rate)} tok/s ({format_rate(rate / self.world_size)}/device)")
            if self.peak_tflops and self.flops_per_token:
                mfu = rate * self.flops_per_token / (self.peak_tflops * 1e12 * self.world_size)
                parts.append(f"MFU {100 * mfu:.1f}%")
        memory = peak_memory_bytes(self.device)
        if memory is None and self._host_peak:
            memory = (self._host_peak, "host")
        if memory is not None:
            parts.append(f"mem {memory[0] / 2**30:.2f} GiB {memory[1]}")
        if steps > 0:
            per_step = elapsed / steps
            parts.append(f"{per_step:.3g} s/step")
            if self.max_steps and self.max_steps > step:
                parts.append(f"left {format_duration(per_step * (self.max_steps - step))}")
        line = " | ".join(parts)
        print(line, file=self.stream or sys.stdout, flush=True)
        self.lines.append(line)
        self.restart(step)
        return line
