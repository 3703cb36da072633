"""Straggler detection: which rank makes every other rank wait, in which section of the step (issue 74).

Why: in synchronous training the whole job runs at the pace of its slowest rank, and a slow node (a throttled GPU,
a failing fan, a noisy neighbour, a bad link) is found by nobody: every rank's step takes equally long, because the
fast ones wait in the next collective. NVIDIA's resiliency extension (NVRx) scores each rank per section of the step
and flags a rank below 0.75 of the fastest; this module does the same without CUDA-specific profiling, for any
accelerator and for CPU runs, with two scores per rank:

* **relative**: the fastest rank's median / this rank's median. Medians are taken over the last ``window`` steps
  before each report of *the time from the step's start to the end of each section* ("arrival times"), not of each
  section's duration. A rank that waits in a collective for a slow peer spends longer in that section, but it
  arrives at the section's end at the same moment as the peer it waited for: arrival times never make a waiting rank
  look slower than the rank it waited for, while the slow rank arrives late at the end of the section where it lost
  the time (a data stall, a slow forward before the first collective). A rank is **named** when its relative score
  at some section is below ``threshold`` and it arrives at least ``min_lag`` (20 %) of the median step time later
  than the fastest rank there (a healthy rank on a shared CPU machine lags up to ~15 %), and at least ``min_lag_ms``
  (2 ms: a scheduler's time slice; tiny sections, a millisecond of data fetching, would otherwise score 0.5 on
  jitter); the section named is the first one where it fell behind.
* **individual**: this rank's best median step time over all reports / its current one. It says the job (or this
  rank) is slower than it was; since a fast rank waiting for a slow one slows down too, it names nobody.

A section that ends in a collective hides a slowness that happened before that collective inside the same section
(every rank leaves the collective together); sections are therefore as fine as the hooks allow: each micro-batch's
data, forward, backward, then the optimizer. Checkpoint saves, which run between steps, are scored on their durations,
a rank named only when its save's lag is also ``min_lag`` of a step. On CUDA / XPU the device is synchronized at every
section end of the measured steps (``synchronize``), so that the times are the device's, not the kernel launches'; the
other steps are not measured at all.

Every ``every_n_steps`` steps, one small all-gather (``2 + MAX_MARKS`` numbers per rank) brings every rank's medians
to rank 0, which scores them and appends one JSON line to ``stragglers.jsonl`` (``mula launch`` reads it: a node
named in several reports in a row is replaced by a buffer node at the next relaunch). The Lightning callback is
:class:`~mula_lightning.callbacks.straggler_detection.StragglerDetection`; a Fabric loop uses
:class:`StragglerMonitor` directly::

    monitor = StragglerMonitor(every_n_steps=50, path="runs/stragglers.jsonl", device=fabric.device)
    for step in range(1, max_steps + 1):
        with monitor.section("data"):
            batch = next(batches)
        with monitor.section("forward"):
            loss = model(batch)
        with monitor.section("backward"):
            fabric.backward(loss)
        with monitor.section("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        monitor.step_done(step)  # every rank, every step: a collective every `every_n_steps` steps
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.utils.launch_env import STRAGGLERS_ENV, host_name

__all__ = [
    "MAX_MARKS",
    "OUTSIDE_STEP",
    "STRAGGLERS_ENV",
    "Straggler",
    "StragglerMonitor",
    "StragglerReport",
    "score_ranks",
]

#: section ends per step that are scored (a step with more, e.g. 30 micro-batches, keeps the first ones and its end)
MAX_MARKS = 64
#: sections that run between steps: scored on their durations, and not counted in the next step's time
OUTSIDE_STEP = ("checkpoint",)


@dataclass
class Straggler:
    """One rank named in a report."""

    rank: int
    host: str
    section: str  # the first section where it fell behind ("checkpoint": its saves are the slow ones)
    relative: float  # the fastest rank's median there / its own
    individual: float  # its best median step time over the reports / its current one
    lag_ms: float  # how much later than the fastest rank it arrived there (median)


@dataclass
class StragglerReport:
    """What rank 0 scored at one report (one line of ``stragglers.jsonl``)."""

    step: int
    world: int
    threshold: float
    step_ms: float  # the median step time over ranks
    stragglers: list[Straggler] = field(default_factory=list)
    min_relative: float = 1.0
    min_individual: float = 1.0
    time: float = field(default_factory=time.time)

    def line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def score_ranks(
    arrivals: torch.Tensor,
    names: Sequence[str],
    threshold: float,
    min_lag: float,
    min_lag_s: float = 0.0,
) -> list[tuple[int, int, float, float]]:
    """``(rank, section index, relative score, lag)`` of every rank that fell behind (see the module docstring).

    Args:
        arrivals: ``[world, sections]`` median times from each rank's step start to each section's end (seconds;
            NaN for a rank without measurements, which is never named); the last column is the step's end.
        names: the sections' names, for the error only.
        threshold: relative score below which a rank is named.
        min_lag: the smallest lag that names a rank, as a fraction of the median step time.
        min_lag_s: and in seconds (in the units of ``arrivals``).
    """
    if arrivals.dim() != 2 or arrivals.shape[1] != len(names):
        raise ValueError(f"arrivals of shape {tuple(arrivals.shape)} do not match the {len(names)} sections {names}")
    measured = ~arrivals.isnan().any(dim=1)
    if not measured.any():
        return []
    fastest = arrivals[measured].min(dim=0).values
    floor = max(min_lag * arrivals[measured, -1].median().item(), min_lag_s)
    named = []
    for rank in measured.nonzero().flatten().tolist():
        lag = arrivals[rank] - fastest
        relative = torch.where(arrivals[rank] > 0, fastest / arrivals[rank], torch.ones_like(fastest))
        behind = ((relative < threshold) & (lag >= floor)).nonzero().flatten()
        if len(behind):
            j = int(behind[0])
            named.append((rank, j, float(relative[j]), float(lag[j])))
    return named


class StragglerMonitor:
    """Times the sections of each step on this rank and, every ``every_n_steps`` steps, scores every rank.

    Args:
        every_n_steps: steps between reports (a collective on every rank: call :meth:`step_done` on each).
        window: the steps before each report that are measured (at most ``every_n_steps``).
        threshold: relative score below which a rank is named (NVRx's default 0.75: 25 % slower).
        min_lag: the smallest lag that names a rank, as a fraction of the median step time.
        min_lag_ms: and in milliseconds.
        path: the JSON-lines file rank 0 appends to (default: ``MULA_STRAGGLERS_FILE``; None there: no file).
        synchronize: synchronize the device at each section end of the measured steps (default: on CUDA / XPU).
        device: where the gathered numbers live (the backend's device: CUDA for NCCL, CPU for gloo).
        group: the process group of the ranks compared (default: the world).
    """

    def __init__(self, every_n_steps: int = 50, window: int = 10, threshold: float = 0.75, min_lag: float = 0.2,
                 min_lag_ms: float = 2.0, path: str | os.PathLike | None = None, synchronize: bool | None = None,
                 device: torch.device | str | None = None, group: Any = None) -> None:  # fmt: skip
        if every_n_steps < 1 or not 1 <= window <= every_n_steps:
            raise ValueError(f"every_n_steps ({every_n_steps}) must be >= 1 and window ({window}) in 1..every_n_steps")
        if not 0 < threshold <= 1 or not 0 <= min_lag < 1 or min_lag_ms < 0:
            raise ValueError(
                f"threshold ({threshold}) must be in (0, 1], min_lag ({min_lag}) in [0, 1) and min_lag_ms "
                f"({min_lag_ms}) >= 0"
            )
        self.every_n_steps, self.window, self.threshold, self.min_lag = every_n_steps, window, threshold, min_lag
        self.min_lag_ms = min_lag_ms
        env_path = os.environ.get(STRAGGLERS_ENV)
        self.path = Path(path) if path is not None else (Path(env_path) if env_path else None)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.synchronize = self.device.type in ("cuda", "xpu") if synchronize is None else synchronize
        self.group = group
        self.reports: list[StragglerReport] = []  # rank 0's reports of this process
        self._next_step = 1  # the step being computed
        self._start = time.perf_counter()  # this step's start
        self._marks: list[tuple[str, float]] = []  # this step's (section, arrival)
        self._steps: dict[tuple[str, ...], list[list[float]]] = {}  # measured steps, by their section sequence
        self._outside: dict[str, list[float]] = {}  # durations of sections between steps (checkpoint)
        self._best: torch.Tensor | None = None  # rank 0: each rank's best median step time so far
        self._hosts: list[str] | None = None

    # ------------------------------------------------------------------ this rank's timings
    @property
    def measuring(self) -> bool:
        """Whether the step being computed is one of the ``window`` steps before a report."""
        return (self._next_step - 1) % self.every_n_steps >= self.every_n_steps - self.window

    def restart(self, step: int) -> None:
        """Start timing at ``step`` completed steps (the start of training, a resume): the next step is ``step + 1``."""
        self._next_step, self._marks, self._start = step + 1, [], time.perf_counter()

    def mark(self, section: str) -> None:
        """``section`` of the current step ends now (what came since the previous mark belongs to it)."""
        if self.measuring:
            self._sync()
            self._marks.append((section, time.perf_counter() - self._start))

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the block as ``name``; a section of :data:`OUTSIDE_STEP` (a checkpoint save between steps) is
        timed on its own and left out of the next step's time."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if name in OUTSIDE_STEP:
                self.outside(name, began)
            else:
                self.mark(name)

    def outside(self, name: str, began: float) -> None:
        """A stretch between steps (``name`` since ``began``, ``perf_counter`` time) is over: its duration is
        recorded under ``name`` (checkpoint saves) and the next step's clock starts now."""
        now = time.perf_counter()
        self._outside.setdefault(name, []).append(now - began)  # rare (saves): kept until the next report
        self._start = now

    @property
    def step_started(self) -> float:
        """When the current step's clock started (``perf_counter`` time): the end of the previous step."""
        return self._start

    def resume(self) -> None:
        """The time until now is not training (validation): the current step's clock starts now."""
        self._start = time.perf_counter()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time that is not training (a validation loop): the next step's clock starts after it."""
        try:
            yield
        finally:
            self.resume()

    def _sync(self) -> None:
        if self.synchronize:
            getattr(torch, self.device.type).synchronize()

    def step_done(self, step: int) -> StragglerReport | None:
        """Step ``step`` (1-based, as counted by the optimizer) is over. Every ``every_n_steps`` steps every rank
        must call this (it gathers); returns rank 0's report then, None otherwise and on the other ranks."""
        if self.measuring and self._marks:
            self.mark("end")
            marks = self._marks if len(self._marks) <= MAX_MARKS else [*self._marks[: MAX_MARKS - 1], self._marks[-1]]
            names = tuple(name for name, _ in marks)
            self._steps.setdefault(names, []).append([t for _, t in marks])
        self._marks, self._start = [], time.perf_counter()
        self._next_step = step + 1
        return self._report(step) if step % self.every_n_steps == 0 else None

    # ------------------------------------------------------------------ the report
    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    def _medians(self) -> tuple[tuple[str, ...], torch.Tensor]:
        """This rank's section sequence (the most frequent one of the window) and the row it sends:
        ``[sections, checkpoint median, arrival medians..., NaN padding]``."""
        row = torch.full((2 + MAX_MARKS,), math.nan, dtype=torch.float64)
        names: tuple[str, ...] = ()
        if self._steps:
            names, steps = max(self._steps.items(), key=lambda item: len(item[1]))
            row[0] = len(names)
            row[2 : 2 + len(names)] = torch.tensor(steps, dtype=torch.float64).median(dim=0).values
        saves = self._outside.get("checkpoint", [])
        if saves:
            row[1] = statistics.median(saves)
        self._steps, self._outside = {}, {}
        return names, row

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        rank, world = self._world()
        if world == 1:
            return row[None]
        local = row.to(self.device)
        out = torch.empty(world * local.numel(), dtype=local.dtype, device=self.device)
        dist.all_gather_into_tensor(out, local, group=self.group)
        if self._hosts is None:
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, host_name(), group=self.group)
            self._hosts = [str(h) for h in hosts]
        return out.view(world, -1).cpu()

    def _report(self, step: int) -> StragglerReport | None:
        names, row = self._medians()
        table = self._gather(row)
        rank, world = self._world()
        if rank != 0:
            return None
        if self._hosts is None:
            self._hosts = [host_name()]
        counts = table[:, 0]
        has = ~counts.isnan()
        report = StragglerReport(step=step, world=world, threshold=self.threshold, step_ms=math.nan)
        if has.any():
            width = int(counts[has].min())
            arrivals = table[:, 2 : 2 + width].clone()
            arrivals[~has] = math.nan
            names = names[:width] if len(names) >= width else tuple(f"section{j}" for j in range(width))
            totals = arrivals[:, -1]
            report.step_ms = round(1000 * totals[has].median().item(), 3)
            individual = self._individual(totals)
            floors = (self.threshold, self.min_lag, self.min_lag_ms / 1000)
            found = {r: (names[j], rel, lag) for r, j, rel, lag in score_ranks(arrivals, names, *floors)}
            saves = table[:, 1]
            if not saves.isnan().any():  # every rank saved: their durations, named only for a lag that costs a step
                step_floor = max(self.min_lag_ms / 1000, self.min_lag * totals[has].median().item())
                for r, _, rel, lag in score_ranks(saves[:, None], ("checkpoint",), self.threshold, 0.0, step_floor):
                    found.setdefault(r, ("checkpoint", rel, lag))
            report.stragglers = [
                Straggler(rank=r, host=self._hosts[r], section=sec, relative=round(rel, 4),
                          individual=round(float(individual[r]), 4), lag_ms=round(1000 * lag, 3))
                for r, (sec, rel, lag) in sorted(found.items())
            ]  # fmt: skip
            report.min_relative = round(min([s.relative for s in report.stragglers], default=1.0), 4)
            report.min_individual = round(float(individual[has].min()), 4)
        self.reports.append(report)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(report.line() + "\n")
        return report

    def _individual(self, totals: torch.Tensor) -> torch.Tensor:
        """Each rank's best median step time so far / its current one (1 for a rank not measured now)."""
        best = totals.clone() if self._best is None else torch.fmin(self._best, totals)
        self._best = best
        return torch.where(totals.isnan(), torch.ones_like(totals), best / totals)
