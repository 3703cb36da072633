"""The failure drill of ``mula launch`` (issue 74): N faults of mixed kinds through one run, which must end at its
last step with every step's loss equal, bit for bit, to a straight run's.

Why: each fault path is tested alone (``tests/launch``), but a week-long run meets them in sequence, each relaunch on
the nodes the previous ones left, each resume from whatever slot the previous fault left complete. The drill draws
a sequence from a seed and runs it through ``mula launch`` (local backend, 2 nodes x 2 ranks plus buffer nodes,
``mula-tiny-moe`` with asynchronous DualCheckpoint saves), then checks and tables what happened.

Faults (``MULA_FAULT``, one attempt each except ``slow``, which shares its attempt with the next fault):

=============  =================================================  ==============================================
kind           what                                               expected handling
=============  =================================================  ==============================================
``kill_rank``  SIGKILL of one rank                                rank failure: relaunch (its node a suspect)
``kill_node``  SIGKILL of both ranks of a node                    node lost: a buffer node in its place
``abort``      SIGABRT of one rank (NCCL's watchdog)              rank failure: relaunch
``hang``       SIGSTOP of one rank                                hang (no heartbeat): its node taken out
``nan``        NaN gradients on one rank                          NaNDetector, exit 86: relaunch, node a suspect
``exception``  a Python exception on one rank                     rank failure: relaunch
``diskfull``   ENOSPC in one rank's save (asynchronous writer)    the save fails on every rank: relaunch from the
                                                                  older slot
``slow``       one rank 3x slower per step                        named in the straggler reports; no relaunch
=============  =================================================  ==============================================

Each fault's time lost is the launch report's split (detection, restart, reload, recomputation; a ``slow`` fault's
is the extra time of its slowed steps). Steps are spaced so that each fault fires in the attempt it belongs to:
after the step where the previous fault ended its attempt (a ``diskfull`` ends it at the next save's wait).
"""

from __future__ import annotations

import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from mula_lightning.testing.tiny_run import tiny_fit_config

__all__ = [
    "DRILL_KINDS",
    "DrillFault",
    "attempt_losses",
    "check_drill",
    "drill_table",
    "launch_processes",
    "plan_drill",
    "restart_ratio",
    "run_drill",
]

DRILL_KINDS = ("kill_rank", "kill_node", "abort", "hang", "nan", "exception", "diskfull", "slow")
NODES, RANKS_PER_NODE = 2, 2
EVERY = 2  # DualCheckpoint's interval
REPORT_EVERY, REPORT_WINDOW = 4, 3  # StragglerDetection's
HANG_TIMEOUT_S = 6.0
REJOIN_TIMEOUT_S = 90.0  # an in-job restart that stalls falls back to a relaunch (and fails the drill's check)
COLLECTIVE_TIMEOUT_S = 30.0  # in-job: a survivor blocked after the cut is free within this
SLOW_MS = 400


@dataclass
class DrillFault:
    """One fault of the drill: ``kind`` at optimizer step ``step`` of launch attempt ``attempt`` on ``ranks``."""

    kind: str
    step: int
    attempt: int
    ranks: list[int]

    def spec(self) -> str:
        """Its ``MULA_FAULT`` parts."""
        kind = {"kill_rank": "kill", "kill_node": "kill"}.get(self.kind, self.kind)
        extra = f",ms={SLOW_MS}" if self.kind == "slow" else ""
        return ";".join(f"{kind}@step={self.step},rank={r},attempt={self.attempt}{extra}" for r in self.ranks)


def plan_drill(
    faults: int, seed: int, kinds: tuple[str, ...] = DRILL_KINDS, in_order: bool = False
) -> tuple[list[DrillFault], int]:
    """``faults`` faults drawn from ``kinds`` with ``seed`` (``in_order``: ``kinds`` one after the other, cycling),
    and the run's ``max_steps``."""
    unknown = [k for k in kinds if k not in DRILL_KINDS]
    if unknown or not kinds or faults < 0:
        raise ValueError(f"drill kinds {unknown or kinds} are not among {DRILL_KINDS} (or faults {faults} < 0)")
    rng = random.Random(seed)
    out: list[DrillFault] = []
    step, attempt = 0, 0
    for i in range(faults):
        kind = kinds[i % len(kinds)] if in_order else rng.choice(kinds)
        step += rng.randint(1, EVERY + 1)
        node = rng.randrange(NODES)
        ranks = [node * RANKS_PER_NODE + local for local in range(RANKS_PER_NODE)]
        out.append(DrillFault(kind, step, attempt, ranks if kind == "kill_node" else [rng.choice(ranks)]))
        if kind == "slow":  # named within 2 reports; the attempt goes on
            step += 2 * REPORT_EVERY + 1
        else:
            attempt += 1
            if kind == "diskfull":  # the failed save surfaces at the next save's wait
                step += 2 * EVERY
    return out, step + 2 * EVERY + 1


def _config(data_dir: Path, max_steps: int) -> dict[str, Any]:
    config = tiny_fit_config(data_dir, max_steps, every_n_train_steps=EVERY)
    dual = config["trainer"]["callbacks"][0]
    dual["init_args"]["async_save"] = True
    config["stragglers"] = {"every_n_steps": REPORT_EVERY, "window": REPORT_WINDOW}
    return config


def _launch(
    workdir: Path, data_dir: Path, max_steps: int, faults: list[DrillFault], in_job: bool = False
) -> tuple[int, dict, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(_config(data_dir, max_steps)))
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_FAULT", None)
    if faults:
        env["MULA_FAULT"] = ";".join(f.spec() for f in faults)
    relaunches = sum(f.kind != "slow" for f in faults)
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", "--nnodes", str(NODES), "--nproc-per-node",
            str(RANKS_PER_NODE), "--buffer-nodes", str(relaunches + 1), "--max-restarts", str(relaunches),
            "--hang-timeout", str(HANG_TIMEOUT_S), "--rejoin-timeout", str(REJOIN_TIMEOUT_S),
            "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--grace", "2",
            "--report-dir", "launch",
            *(["--in-job"] if in_job else []), "--",
            "mula", "fit", "--config", "tiny.yaml"]  # fmt: skip
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    report = json.loads((workdir / "launch" / "launch_report.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def launch_processes(launch_id: str) -> list[int]:
    """PIDs of every live process whose environment holds this launch's id (``MULA_LAUNCH_ID``): what a launch
    left running (orphans, if any; empty once ``mula launch`` returned)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if f"MULA_LAUNCH_ID={launch_id}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(proc.name))
    return found


def attempt_losses(workdir: Path) -> list[dict[int, str]]:
    """Per attempt of a ``mula fit`` run in ``workdir`` (its CSV logger's version folders, ``runs/tiny``): optimizer
    step (1-based) -> train/loss as written (the exact text; empty for an attempt that died before its first log
    flush)."""
    out = []
    versions = sorted((workdir / "runs" / "tiny").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        rows = []
        if (version / "metrics.csv").exists():
            with open(version / "metrics.csv") as fh:
                rows = [r for r in csv.DictReader(fh) if r.get("train/loss")]
        out.append({int(r["step"]) + 1: r["train/loss"] for r in rows})
    return out


def run_drill(workdir: Path, data_dir: Path, faults: int, seed: int, kinds: tuple[str, ...] = DRILL_KINDS,
              in_order: bool = False, in_job: bool = False,
              plan: list[DrillFault] | None = None) -> dict:  # fmt: skip
    """The straight run and the drill in ``workdir`` (``in_job``: ``mula launch --in-job``); the checked result
    (see :func:`check_drill`). ``plan``: these faults (in attempt order) instead of drawn ones."""
    if plan is None:
        plan, max_steps = plan_drill(faults, seed, kinds, in_order)
    else:
        max_steps = max(f.step for f in plan) + 2 * EVERY + 1
    began = time.time()
    code, _, output = _launch(workdir / "straight", data_dir, max_steps, [])
    if code != 0:
        raise AssertionError(f"the straight run failed (exit {code}):\n{output[-3000:]}")
    (reference,) = attempt_losses(workdir / "straight")
    straight_s = time.time() - began
    began = time.time()
    code, report, output = _launch(workdir / "drill", data_dir, max_steps, plan, in_job)
    result = check_drill(plan, max_steps, code, report, reference, attempt_losses(workdir / "drill"),
                         workdir / "drill" / "launch" / "stragglers.jsonl", output, in_job)  # fmt: skip
    result.update(in_job=in_job, seed=seed, straight_s=round(straight_s, 1), drill_s=round(time.time() - began, 1))
    (workdir / "drill_result.json").write_text(json.dumps(result, indent=1))
    return result


def check_drill(plan: list[DrillFault], max_steps: int, code: int, report: dict, reference: dict[int, str],
                attempts_losses: list[dict[int, str]], stragglers: Path, output: str,
                in_job: bool = False) -> dict:  # fmt: skip
    """Check the drill ended right and say how each fault was handled; raises ``AssertionError`` naming the first
    thing that is wrong (exit code, an attempt that did not fail as its fault should, a fault restarted by the
    wrong path, a loss that differs from the straight run's, a step never done, a slow rank never named).

    Under ``in_job`` a fault that kills, aborts, stops or raises must be restarted in-job, on any rank or node
    (rank 0's too: the launcher hosts the job's store); it must fall back to a relaunch when it is a NaN (every rank
    ends) or fires during the set-up (``step=0``: a second fault while the job restarts); a full disk may go either
    way (in-job when the rank whose save failed ends first, a relaunch when every rank's save fails at the next
    wait)."""
    tail = output[-4000:]
    assert code == 0 and report["outcome"] == "succeeded", f"launch exit {code}: {report['message']}\n{tail}"
    attempts = report["attempts"]
    relaunching = [f for f in plan if f.kind != "slow"]
    assert len(attempts) == len(relaunching) + 1, (len(attempts), len(relaunching), tail)
    done: set[int] = set()
    for k, losses in enumerate(attempts_losses):
        wrong = {s: (v, reference.get(s)) for s, v in losses.items() if reference.get(s) != v}
        assert not wrong, f"attempt {k}: losses differ from the straight run's at steps {sorted(wrong)[:5]}: {wrong}"
        done |= set(losses)
    assert done == set(range(1, max_steps + 1)), f"steps never done: {sorted(set(range(1, max_steps + 1)) - done)}"
    rows = []
    restarts = report["restarts"]
    named = _named(stragglers)
    for fault in plan:
        row: dict[str, Any] = {**asdict(fault)}
        if fault.kind == "slow":
            attempt = attempts[fault.attempt]
            slowed = max(0, (attempt["last_step"] or fault.step) - fault.step + 1)
            host = attempt["nodes"][fault.ranks[0] // RANKS_PER_NODE]
            hosts = {(step, h) for step, h, section, lag_ms in named
                     if step >= fault.step and h == host and section == "data" and lag_ms >= SLOW_MS / 2}  # fmt: skip
            assert hosts, f"the slow rank {fault.ranks} on {host} from step {fault.step} was never named"
            row.update(path="straggler report", named_at_step=min(hosts)[0], lost_s=slowed * SLOW_MS / 1000)
        else:
            record, restart = attempts[fault.attempt], restarts[fault.attempt]
            expected = "hang" if fault.kind == "hang" else "failed"
            assert record["outcome"] == expected, f"{fault}: attempt outcome {record['outcome']}: {record['reason']}"
            if fault.kind == "kill_node":
                assert record["failed_hosts"], f"{fault}: no node taken out ({record['reason']})"
            cost = restart["cost_s"]
            relaunch = fault.kind == "nan" or fault.step == 0
            either = fault.kind == "diskfull"
            expected_path = {"relaunch"} if not in_job or relaunch else {"in-job", "relaunch"} if either else {"in-job"}
            assert restart["path"] in expected_path, f"{fault}: restarted by {restart['path']}, not {expected_path}"
            row.update(path=restart["path"], reason=record["reason"], lost_s=cost["total"], cost_s=cost,
                       taken_out=record["failed_hosts"], steps_redone=restart["steps_redone"],
                       last_step=record["last_step"])  # fmt: skip
        rows.append(row)
    return {"faults": rows, "max_steps": max_steps, "attempts": len(attempts), "bit_equal": True, "lost_steps": 0,
            "launch_id": report["settings"]["launch_id"]}  # fmt: skip


def _named(path: Path) -> list[tuple[int, str, str, float]]:
    """Every (step, host, section, lag in ms) the straggler reports named."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            report = json.loads(line)
            out += [(report["step"], s["host"], s["section"], s["lag_ms"]) for s in report["stragglers"]]
    return out


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def drill_table(result: dict) -> str:
    """The markdown table of a drill: per kind and path, the faults, time lost (mean, p95) and its parts."""
    lines = [
        "| kind | faults | handled by | time lost mean (s) | p95 (s) | detection | restart | reload | recompute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in DRILL_KINDS:
        for path in ("in-job", "relaunch", "straggler report"):
            rows = [r for r in result["faults"] if r["kind"] == kind and r["path"] == path]
            if not rows:
                continue
            lost = [r["lost_s"] for r in rows if r["lost_s"] is not None]
            parts = []
            for part in ("detection", "restart", "reload", "recompute"):
                values = [r["cost_s"][part] for r in rows if r.get("cost_s") and r["cost_s"][part] is not None]
                parts.append(f"{statistics.mean(values):.1f}" if values else "-")
            mean = f"{statistics.mean(lost):.1f}" if lost else "-"
            p95 = f"{_p95(lost):.1f}" if lost else "-"
            lines.append(f"| {kind} | {len(rows)} | {path} | {mean} | {p95} | {' | '.join(parts)} |")
    return "\n".join(lines)


def restart_ratio(result: dict) -> dict[str, float | None]:
    """Mean restart latency (detection to every rank back in the group) and time lost per fault of the in-job path
    and of the relaunch path in one drill, and their ratios (in-job / relaunch)."""
    out: dict[str, float | None] = {}
    for key, part in (("restart", "restart"), ("lost", "total")):
        means = {}
        for path in ("in-job", "relaunch"):
            values = [r["cost_s"][part] for r in result["faults"] if r["path"] == path and r.get("cost_s")
                      and r["cost_s"][part] is not None]  # fmt: skip
            means[path] = statistics.mean(values) if values else None
        out[f"{key}_in_job_s"], out[f"{key}_relaunch_s"] = means["in-job"], means["relaunch"]
        ratio = means["in-job"] / means["relaunch"] if means["in-job"] and means["relaunch"] else None
        out[f"{key}_ratio"] = round(ratio, 2) if ratio is not None else None
    return out
