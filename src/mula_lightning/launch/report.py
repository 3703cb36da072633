"""The restart report of ``mula launch``: ``launch_report.json`` plus one line per event on stdout.

Why: after a week-long run the questions are "how often did it restart, why, on which nodes, and what did each
restart cost". The report answers them without reading N log files: every attempt (nodes, outcome, reason,
failed hosts, last step seen), every restart (step resumed from, time lost from the failure to the first step of
the next attempt, steps redone, and the cost split into detection, restart, reload and recomputation:
:func:`fault_cost`) and the final outcome with its exit code. It is rewritten atomically after every event, so a
launcher killed itself still leaves a report of everything before.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mula_lightning.utils.io import atomic_write_text

__all__ = ["REPORT_NAME", "AttemptRecord", "LaunchReport", "fault_cost"]

REPORT_NAME = "launch_report.json"


@dataclass
class AttemptRecord:
    """One attempt: where it ran and how it ended."""

    attempt: int
    nodes: list[str]
    command: list[str]
    started: float
    ended: float | None = None
    outcome: str = "running"  # running | succeeded | failed | hang | diverged | interrupted
    reason: str = ""
    failed_hosts: list[str] = field(default_factory=list)
    suspect_hosts: list[str] = field(default_factory=list)
    straggler_hosts: list[str] = field(default_factory=list)  # named in --straggler-reports reports in a row
    ep_groups: list[int] = field(default_factory=list)  # expert-parallel groups of the non-finite ranks (NaN stops)
    resumed_from_step: int | None = None  # the step of the attempt's first heartbeat (after the resume)
    last_step: int | None = None  # the highest step any rank reported
    first_step_at: float | None = None  # when the first step after the resume was reported
    failure_at: float | None = None  # when the failure happened (an exit seen, or the last heartbeat of a hang)
    detected_at: float | None = None  # when the launcher called it a failure (after the settle time / hang timeout)
    setup_at: float | None = None  # the first rank's "setup" beat: processes up, group formed, nothing loaded yet
    start_at: float | None = None  # the first "start" beat: checkpoint loaded, training begins
    caught_up_at: float | None = None  # the first beat at the previous attempt's last step: the lost steps redone
    time_lost_s: float | None = None  # from the previous attempt's failure to this attempt's first step
    started_by: str = "launch"  # launch (the first) | relaunch (every process started again) | in-job
    replaced_ranks: list[int] = field(default_factory=list)  # in-job: the ranks given a new process
    pids: list[int] = field(default_factory=list)  # each rank's process id (local backend)


def fault_cost(before: AttemptRecord, after: AttemptRecord) -> dict[str, float | None]:
    """What one restart (a relaunch or an in-job restart) cost, in seconds: ``detection`` (failure to the
    launcher's verdict: the settle time or the hang timeout), ``restart`` (stopping the attempt or the failed ranks,
    starting the processes, imports, rendezvous: to the first ``setup`` beat), ``reload`` (model, strategy,
    checkpoint: to the first ``start`` beat), ``recompute`` (the steps since the checkpoint, done again: to the first
    beat at the failed attempt's last step) and ``total`` (failure to caught up). None where a moment was not
    reported (a command without the Heartbeat callback)."""

    def span(a: float | None, b: float | None) -> float | None:
        return round(b - a, 3) if a is not None and b is not None else None

    setup = after.setup_at if after.setup_at is not None else after.start_at
    return {
        "detection": span(before.failure_at, before.detected_at),
        "restart": span(before.detected_at, setup),
        "reload": span(after.setup_at, after.start_at),
        "recompute": span(after.start_at, after.caught_up_at),
        "total": span(before.failure_at, after.caught_up_at),
    }


class LaunchReport:
    """Collects attempts and events; writes ``DIR/launch_report.json`` after each change."""

    def __init__(self, directory: str | Path, settings: dict[str, Any]) -> None:
        self.path = Path(directory) / REPORT_NAME
        self.settings = settings
        self.attempts: list[AttemptRecord] = []
        self.events: list[dict[str, Any]] = []
        self.outcome = "running"
        self.exit_code: int | None = None
        self.message = ""

    def event(self, text: str, **fields: Any) -> None:
        """Print ``mula launch: <text>`` and keep it (with ``fields``) in the report."""
        print(f"mula launch: {text}", flush=True)
        self.events.append({"time": time.time(), "text": text, **fields})
        self.write()

    def start_attempt(self, attempt: int, nodes: list[str], command: list[str]) -> AttemptRecord:
        record = AttemptRecord(attempt=attempt, nodes=list(nodes), command=list(command), started=time.time())
        self.attempts.append(record)
        self.write()
        return record

    def restarts(self) -> list[dict[str, Any]]:
        """One row per relaunch: reason, failed hosts, nodes, resumed step, time lost, steps redone."""
        rows = []
        for before, after in zip(self.attempts, self.attempts[1:], strict=False):
            redone = None
            if before.last_step is not None and after.resumed_from_step is not None:
                redone = max(0, before.last_step - after.resumed_from_step)
            rows.append(
                {
                    "attempt": after.attempt,
                    "path": after.started_by,
                    "replaced_ranks": after.replaced_ranks,
                    "reason": before.reason,
                    "failed_hosts": before.failed_hosts,
                    "nodes": after.nodes,
                    "resumed_from_step": after.resumed_from_step,
                    "steps_redone": redone,
                    "time_lost_s": after.time_lost_s,
                    "cost_s": fault_cost(before, after),
                }
            )
        return rows

    def finish(self, outcome: str, exit_code: int, message: str) -> None:
        self.outcome, self.exit_code, self.message = outcome, exit_code, message
        self.write()

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "message": self.message,
            "attempts": [asdict(a) for a in self.attempts],
            "restarts": self.restarts(),
            "events": self.events,
        }

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self.as_dict(), indent=1))
        except OSError as err:  # the report must never be what stops a run
            print(f"mula launch: cannot write {self.path}: {err}", file=sys.stderr, flush=True)
