"""Failure attribution: what the end of an attempt says about the nodes it ran on (apart from the attempt loop).

Why: on a real cluster most failures are not the failing node's fault, and every wrong eviction costs a buffer node.
PyTorch's NCCL watchdog aborts (SIGABRT) healthy ranks after a peer's communication error; a native library can
segfault anywhere; a diverging run turns every rank non-finite in the same step; a bad sample replays its NaN on
whichever node reads it next. So a node is *lost* (taken out at once) only on hard evidence, and everything else
makes it a *suspect*, taken out when it is again the one to blame in the next attempt
(:meth:`~mula_lightning.launch.node_pool.NodePool.mark_suspects`):

======================================================  ===============================================================
what ended the attempt                                  verdict
======================================================  ===============================================================
srun's ``Node failure on HOST``                          HOST lost (SLURM's own report)
SLURM reports HOST down / not responding after a failure HOST lost (``scontrol show node``: the node is unreachable)
every rank of HOST killed by SIGKILL, which the          HOST lost (the node vanished: power, kernel, OOM killer of the
launcher did not send (it classifies before stopping)    whole node)
anything else: exit code, SIGABRT, SIGSEGV, SIGBUS,      the host of the first failing rank is a suspect (seen at
an unknown signal or srun wording                        the same moment: a signal death before an exit code)
NaNDetector (exit 86), non-finite ranks in one unit      that unit's hosts are suspects (a unit is an expert-parallel
                                                         group when the ranks say which: a NaN crosses the dispatch
                                                         all-to-all before the other ranks' gradient hooks run; else a
                                                         host)
NaNDetector, non-finite ranks in two or more units       divergence: the model or the data, nobody is blamed, the
                                                         launch stops (:data:`DIVERGED`)
NaNDetector at the same step as the previous attempt's   divergence: the same batch failed on another node: the data
NaN, on other hosts
a hang with a stopped process (local backend)            its host lost
a hang: the silent ranks with the lowest step, behind    their hosts are suspects (the others wait for them in a
the others                                               collective); no difference in steps: nobody is blamed
======================================================  ===============================================================
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mula_lightning.launch.backends import RankExit
from mula_lightning.utils.launch_env import NAN_EXIT_CODE, NanRecord, parse_nan_line

__all__ = [
    "DIVERGED",
    "attribute_unreachable",
    "LOST",
    "SUSPECT",
    "NanRecord",
    "Verdict",
    "attribute_exits",
    "attribute_hang",
    "attribute_nan",
    "parse_nan_line",
]

LOST = "lost"
SUSPECT = "suspect"
DIVERGED = "diverged"
NOBODY = "nobody"


@dataclass
class Verdict:
    """What to do with the nodes after a failed attempt: ``lost`` hosts out now, ``suspects`` counted."""

    kind: str
    reason: str
    lost: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    ep_groups: list[int] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # host -> the evidence against it (the pool's record)


def attribute_exits(bad: Sequence[RankExit], nproc_per_node: int) -> Verdict:
    """The verdict for ranks that ended badly (not by NaNDetector), first failure first (see the module table)."""
    failures = [e for e in bad if e.node_failure]
    if failures:
        hosts = list(dict.fromkeys(e.host for e in failures if e.host))
        why = {h: "SLURM reported a node failure" for h in hosts}
        return Verdict(LOST, f"hard failure: {', '.join(hosts)} lost (SLURM node failure)", lost=hosts, why=why)
    killed: dict[str, set[int]] = {}
    others: set[str] = set()
    for e in bad:
        if e.host and e.code == -int(signal.SIGKILL):
            killed.setdefault(e.host, set()).update(e.ranks)
        elif e.host:
            others.add(e.host)
    vanished = [h for h, ranks in killed.items() if h not in others and len(ranks) >= nproc_per_node]
    if vanished:
        why = {h: f"every rank vanished ({next(e.describe() for e in bad if e.host == h)})" for h in vanished}
        return Verdict(
            LOST,
            f"hard failure: {', '.join(vanished)} lost (every rank killed by a SIGKILL the launcher did not send)",
            lost=vanished,
            why=why,
        )
    # the first failure: the earliest report; among exits seen at the same moment a death by a signal comes first
    # (the peers of an aborted or segfaulted rank exit with an error because it died, not the other way round)
    first = min(bad, key=lambda e: (e.at, e.code >= 0))
    if not first.host:
        return Verdict(NOBODY, f"rank failure with no host to blame: {first.describe()}")
    return Verdict(SUSPECT, f"rank failure: {first.describe()}", suspects=[first.host])


def attribute_nan(records: Sequence[NanRecord], previous: Sequence[NanRecord] = ()) -> Verdict:
    """The verdict for a NaNDetector stop from the records of this attempt (and the previous NaN stop's)."""
    if not records:
        return Verdict(NOBODY, f"soft failure: NaN (exit {NAN_EXIT_CODE}) with no host named")
    hosts = sorted(dict.fromkeys(r.host for r in records))
    groups = sorted({g for r in records for g in r.ep_groups})
    units = groups if all(r.ep_groups for r in records) else hosts
    bad = next((r.bad for r in records if r.bad is not None), None) or sum(len(r.ranks) for r in records)
    world = next((r.world for r in records if r.world is not None), None)
    step = next((r.step for r in records if r.step is not None), None)
    where = f"{bad} rank{'s' if bad != 1 else ''}" + (f" of {world}" if world else "") + f" on {', '.join(hosts)}"
    if groups:
        where += f" (expert-parallel group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))})"
    if len(units) > 1:
        return Verdict(
            DIVERGED,
            f"divergence: non-finite values at step {step} on {where}: more than one "
            f"{'expert-parallel group' if units is groups else 'node'} at once is the model or the data (learning "
            "rate, a bad batch), not a node; nobody is taken out",
            ep_groups=groups,
        )
    before = {r.host for r in previous}
    if previous and step is not None and previous[0].step == step and not before & set(hosts):
        return Verdict(
            DIVERGED,
            f"divergence: step {step} went non-finite again on other nodes ({where}; before on "
            f"{', '.join(sorted(before))}): the data or the model replays it, not a node; nobody is taken out",
            ep_groups=groups,
        )
    return Verdict(SUSPECT, f"soft failure: NaN at step {step} on {where}", suspects=hosts, ep_groups=groups)


def attribute_hang(
    silent: Sequence[int], records: dict[int, dict[str, Any]], steps: dict[int, int], stopped_hosts: Sequence[str]
) -> Verdict:
    """The verdict for a hang: ``silent`` ranks sent nothing for the timeout; ``records`` / ``steps`` are every
    rank's last heartbeat record and step; ``stopped_hosts`` are the hosts of its stopped ranks (either backend)."""
    if stopped_hosts:
        why = {h: "hang: a rank stopped (no progress, process state T)" for h in stopped_hosts}
        return Verdict(LOST, f"a rank stopped on {', '.join(stopped_hosts)}", lost=list(stopped_hosts), why=why)
    known = [r for r in silent if r in steps]
    if not known or not steps:
        return Verdict(NOBODY, "hang: no heartbeat to tell which rank stopped first")
    lowest = min(steps[r] for r in known)
    if lowest >= max(steps.values()):
        return Verdict(NOBODY, f"hang: every rank stopped at step {lowest}; no rank to blame")
    behind = [r for r in known if steps[r] == lowest]
    hosts = list(dict.fromkeys(str(records[r].get("host", "")) for r in behind if records[r].get("host")))
    ranks = ",".join(map(str, behind))
    return Verdict(
        SUSPECT if hosts else NOBODY,
        f"hang: rank{'s' if len(behind) > 1 else ''} {ranks} stopped first (step {lowest}, the others reached "
        f"{max(steps.values())})" + (f" on {', '.join(hosts)}" if hosts else ""),
        suspects=hosts,
    )


def attribute_unreachable(states: dict[str, str], verdict: Verdict) -> Verdict:
    """``verdict`` overruled by SLURM's view of the nodes after a failure: hosts it reports down or not responding
    (``states``: host -> State) are lost whatever else the ranks' ends suggested; a divergence stands."""
    if not states or verdict.kind == DIVERGED:
        return verdict
    hosts = sorted(states)
    why = {h: f"SLURM reports the node unreachable (State={states[h]})" for h in hosts}
    listed = ", ".join(f"{h} (State={states[h]})" for h in hosts)
    return Verdict(LOST, f"hard failure: {listed} unreachable; {verdict.reason}", lost=hosts, why=why)
