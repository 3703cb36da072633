"""SLURM host lists: ``nid[001-003,007],login1`` -> ``["nid001", "nid002", "nid003", "nid007", "login1"]``.

Why: ``mula launch`` picks the nodes of each attempt out of the job's allocation (``SLURM_JOB_NODELIST``), which
SLURM gives in its compressed syntax. ``scontrol show hostnames`` expands it and is used when it is on ``PATH``;
the parser here is the same expansion for machines without it (a login node's container, tests) and checks what
``scontrol`` would refuse: unbalanced brackets, reversed ranges, empty names.

The syntax: comma-separated items (commas inside brackets belong to the bracket); an item is literal text with
any number of bracket groups, each a comma list of numbers or ``lo-hi`` ranges; zero padding of the first number of
a range is kept (``[08-10]`` -> ``08, 09, 10``); several groups give the cartesian product in order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["UNREACHABLE_STATES", "allocation_nodes", "expand_hostlist", "no_kill_warning", "unreachable_nodes"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(spec: str) -> list[str]:
    """``spec`` cut at the commas outside brackets; brackets must balance."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {spec!r}: nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {spec!r}: ']' without '[' at position {i}")
        elif char == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {spec!r}: '[' is never closed")
    items.append(spec[start:])
    return items


def _expand_group(group: str, spec: str) -> list[str]:
    """The numbers of one bracket group (``001-003,7``), with the zero padding of each range's first number."""
    out: list[str] = []
    for part in group.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"host list {spec!r}: {part!r} in [{group}] is not a number or a lo-hi range")
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text) if hi_text is not None else int(lo_text)
        if hi < lo:
            raise ValueError(f"host list {spec!r}: range {part!r} runs backwards ({lo} > {hi})")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def _expand_item(item: str, spec: str) -> list[str]:
    names = [""]
    for match in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        literal, group = match.group(1), match.group(2)
        if group is not None and not group.strip():
            raise ValueError(f"host list {spec!r}: empty brackets in {item!r}")
        if group:
            names = [n + literal + g for n in names for g in _expand_group(group, spec)]
        elif literal:
            names = [n + literal for n in names]
    return names


def expand_hostlist(spec: str) -> list[str]:
    """The host names of a SLURM host list, in order, duplicates kept once.

    Raises:
        ValueError: naming the list and the part that does not parse (or an empty host name).
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("host list is empty")
    hosts: list[str] = []
    for item in _split_top_level(spec):
        if not item.strip():
            raise ValueError(f"host list {spec!r}: an empty host name (two commas in a row, or a trailing comma)")
        hosts += _expand_item(item.strip(), spec)
    return list(dict.fromkeys(hosts))


def allocation_nodes(env: Mapping[str, str] | None = None) -> list[str]:
    """The nodes of the current SLURM allocation: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), expanded by
    ``scontrol show hostnames`` when it is on ``PATH``, else by :func:`expand_hostlist`.

    Raises:
        ValueError: outside an allocation (neither variable set), or when ``scontrol`` refuses the list.
    """
    env = os.environ if env is None else env
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        raise ValueError(
            "the slurm backend needs a SLURM allocation: SLURM_JOB_NODELIST is not set (run inside sbatch/salloc, "
            "or use --backend local)"
        )
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return expand_hostlist(spec)
    proc = subprocess.run([scontrol, "show", "hostnames", spec], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise ValueError(f"scontrol show hostnames {spec!r} failed ({proc.returncode}): {proc.stderr.strip()}")
    return list(dict.fromkeys(line.strip() for line in proc.stdout.splitlines() if line.strip()))


def no_kill_warning(env: Mapping[str, str] | None = None) -> str | None:
    """Why node replacement may not work in this SLURM job, or None when the job was submitted with ``--no-kill``.

    Without ``--no-kill`` SLURM ends the whole allocation when one of its nodes fails, the launcher included, so the
    buffer nodes are never used for a hard failure. ``scontrol --json show job $SLURM_JOB_ID`` says so
    (``kill_on_node_fail``); when it cannot be asked (no job id, no ``scontrol``, a SLURM without ``--json``) the
    warning says that it could not tell.
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    fix = "submit with `sbatch --no-kill` (or `#SBATCH --no-kill`) so that a failed node does not end the allocation"
    if not job or scontrol is None:
        return f"cannot tell whether this SLURM job survives a node failure (no SLURM_JOB_ID or scontrol); {fix}"
    try:
        proc = subprocess.run([scontrol, "--json", "show", "job", job], capture_output=True, text=True, timeout=30)
        jobs = json.loads(proc.stdout)["jobs"] if proc.returncode == 0 else []
        kill = jobs[0]["kill_on_node_fail"] if jobs else None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError):
        kill = None
    if kill is None:
        return f"cannot tell whether SLURM job {job} survives a node failure (scontrol --json show job); {fix}"
    if kill:
        return f"SLURM job {job} was submitted without --no-kill: a node failure ends the whole job; {fix}"
    return None


#: SLURM node states (``scontrol show node``'s ``State=``, ``+``-joined flags) that mean the node itself is gone
UNREACHABLE_STATES = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "POWER_DOWN", "POWERED_DOWN"})


def unreachable_nodes(hosts: list[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``host -> State`` for the hosts SLURM reports down or not responding (``scontrol show node -o``); empty when
    ``scontrol`` is missing or does not answer (no evidence is no evidence)."""
    env = os.environ if env is None else env
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None or not hosts:
        return {}
    try:
        proc = subprocess.run(
            [scontrol, "show", "node", "-o", ",".join(hosts)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in proc.stdout.splitlines():
        name, state = re.search(r"NodeName=(\S+)", line), re.search(r"\bState=(\S+)", line)
        if name is None or state is None or name.group(1) not in hosts:
            continue
        flags = {flag.rstrip("*~#!%$@^-") for flag in state.group(1).split("+")}
        if flags & UNREACHABLE_STATES or "*" in state.group(1):  # a trailing * marks a node not responding
            found[name.group(1)] = state.group(1)
    return found
