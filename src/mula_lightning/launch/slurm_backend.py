"""The SLURM backend of ``mula launch``: an attempt's ranks started by ``srun`` steps, their ends read from srun.

An attempt is one ``srun --nodes N --nodelist ... --ntasks-per-node P`` step; SLURM starts the ranks (Lightning's
``SLURMEnvironment`` reads the task variables; ``MASTER_ADDR`` / ``MASTER_PORT`` are set by the launcher). Which
ranks failed is read from ``srun``'s own report lines (``srun: error: HOST: task 3: Killed``, ``... Exited with
exit code 1``, ``Node failure on HOST``), which are passed through to the launcher's stderr.

Under ``--in-job`` (:mod:`mula_lightning.launch.in_job`) the healthy ranks must outlive a failed one, and a failed
rank must be started again alone:

* the main step runs with ``--no-kill --kill-on-bad-exit=0 --wait=0 --distribution=block``: a task that ends, or
  a node that fails, ends neither the step nor its other tasks;
* each task runs through :mod:`mula_lightning.launch.slurm_task`, which gives it the job's rank numbers, writes its
  host and process id to ``CONTROL/r<rank>.<n>.pid`` and ``exec``\\ s the command;
* :meth:`SlurmAttempt.kill` SIGKILLs a rank's process on its node with ``srun --overlap --nodes 1 --ntasks 1
  --nodelist HOST kill -KILL PID`` (SLURM has no per-task signal) and waits until srun reports it ended;
  :meth:`SlurmAttempt.stopped_ranks` reads ``/proc/PID/stat`` the same way (a SIGSTOPped rank: state ``T``);
* :meth:`SlurmAttempt.replace` starts each failed rank in a step of its own, ``srun --overlap --nodes 1 --ntasks 1
  --nodelist HOST`` (``--overlap``: it shares the resources the main step holds; ``--srun-replace-args`` adds what
  the cluster needs, such as ``--gpus-per-node``), whose one task the shim numbers as the failed rank. Its report
  lines and its exit are that rank's.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from pathlib import Path

from mula_lightning.launch.backends import RankExit, free_port, signal_group

__all__ = ["SlurmAttempt", "parse_srun_line"]

#: seconds :meth:`SlurmAttempt.kill` waits for srun to report a killed rank's end (a node that no longer answers
#: never reports it: the rank counts as ended then, and its node is the launcher's to take out)
KILL_TIMEOUT_S = 30.0
#: ``srun --overlap`` commands run at once to kill ranks or read their state (the controller's load stays bounded)
PROBE_WORKERS = 32

# srun's report lines: "srun: error: nid001: task 3: Exited with exit code 1", "srun: error: nid001: tasks 0-3:
# Killed", "srun: error: Node failure on nid002"
_TASK_LINE = re.compile(r"srun: error: (?P<host>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)$")
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (?P<host>\S+)")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
# the wordings of strsignal() that srun prints for a task ended by a signal
_SIGNAL_WORDS = {
    "Killed": signal.SIGKILL,
    "Terminated": signal.SIGTERM,
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Illegal instruction": signal.SIGILL,
    "Floating point exception": signal.SIGFPE,
    "Interrupt": signal.SIGINT,
    "Hangup": signal.SIGHUP,
}


def _task_ids(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_srun_line(line: str) -> RankExit | None:
    """One of srun's report lines as a :class:`RankExit` (``None`` for any other line)."""
    match = _NODE_FAILURE.search(line)
    if match:
        return RankExit(match.group("host"), [], -int(signal.SIGKILL), node_failure=True)
    match = _TASK_LINE.search(line.strip())
    if not match:
        return None
    what = match.group("what").strip()
    code_match = _EXIT_CODE.search(what)
    detail = ""
    if code_match:
        code = int(code_match.group(1))
    else:  # "Killed", "Aborted (core dumped)", "Segmentation fault", ...: the task was killed by a signal
        sig = _SIGNAL_WORDS.get(what.split(" (")[0])
        code = -int(sig) if sig is not None else 1  # an unknown wording is an ordinary failure, never a lost node
        detail = "" if sig is not None else what
    return RankExit(match.group("host"), _task_ids(match.group("tasks")), code, detail=detail)


@dataclass
class _Step:
    """One srun process: its task ``t`` is rank ``ranks[t]`` on ``hosts[t]`` (pid file ``keys[t]``)."""

    proc: subprocess.Popen
    ranks: list[int]
    hosts: list[str]
    keys: list[str]
    events: list[RankExit] = field(default_factory=list)  # parsed, not yet collected
    named: int = 0  # report lines that named a task of this step
    collected: bool = False  # its end was turned into the ranks' exits
    reader: threading.Thread | None = None


class SlurmAttempt:
    """The srun steps of one attempt (see the module docstring); a rank's latest process is the one that counts."""

    def __init__(
        self,
        command: Sequence[str],
        nodes: Sequence[str],
        nproc_per_node: int,
        env: Mapping[str, str],
        srun: str = "srun",
        extra_args: Sequence[str] = (),
        in_job: bool = False,
        control_dir: Path | None = None,
        master: tuple[str, int] | None = None,
        replace_args: Sequence[str] = (),
    ) -> None:
        self.nodes = list(nodes)
        self.nproc_per_node = nproc_per_node
        self.world_size = len(self.nodes) * nproc_per_node
        self.srun, self.in_job, self.replace_args = srun, in_job, list(replace_args)
        if in_job and control_dir is None:
            raise ValueError("an in-job SLURM attempt needs a control folder (its ranks' pid files)")
        self.control = Path(control_dir) if control_dir is not None else None
        addr, port = master if master is not None else (self.nodes[0], free_port())
        self.master = (addr, port)
        self._lock = threading.Lock()
        self._steps: list[_Step] = []
        self._owner: list[tuple[_Step, int]] = []  # rank -> (its step, its task there)
        self._ended: dict[int, int] = {}  # rank -> exit code of its latest process, once known
        self._killed: set[int] = set()  # ranks the launcher killed: their ends are never reported as exits
        self._unreported: list[RankExit] = []  # collected by kill(), for the next poll()
        self._incarnation = [0] * self.world_size
        self._pids: dict[int, int] = {}  # rank -> pid of its latest process, once a pid file was read
        layout = [
            f"--nodes={len(self.nodes)}",
            f"--nodelist={','.join(self.nodes)}",
            f"--ntasks-per-node={nproc_per_node}",
            f"--ntasks={self.world_size}",
        ]
        if in_job:  # a task's end or a node's failure ends neither the step nor its other tasks
            layout += ["--no-kill", "--kill-on-bad-exit=0", "--wait=0", "--distribution=block"]
            command = self._shim(command)
        self.argv = [srun, *layout, *extra_args, *command]
        hosts = [self.nodes[r // nproc_per_node] for r in range(self.world_size)]
        ranks = list(range(self.world_size))
        step = self._run(self.argv, env, ranks, hosts, [f"r{r}.0" for r in ranks])
        self._owner = [(step, r) for r in ranks]

    # ------------------------------------------------------------------ steps
    def _shim(self, command: Sequence[str], rank: int | None = None, key: str = "") -> list[str]:
        out = [sys.executable, "-m", "mula_lightning.launch.slurm_task", "--control", str(self.control)]
        out += ["--world-size", str(self.world_size), "--nproc-per-node", str(self.nproc_per_node)]
        if rank is not None:
            out += ["--rank", str(rank), "--key", key]
        return [*out, "--", *command]

    def _run(self, argv: list[str], env: Mapping[str, str], ranks: list[int], hosts: list[str], keys: list[str]):
        step_env = {**env, "MASTER_ADDR": self.master[0], "MASTER_PORT": str(self.master[1])}
        proc = subprocess.Popen(argv, env=step_env, stderr=subprocess.PIPE, start_new_session=True)
        step = _Step(proc, ranks, hosts, keys)
        step.reader = threading.Thread(target=self._read, args=(step,), name="srun-stderr", daemon=True)
        step.reader.start()
        self._steps.append(step)
        return step

    def _read(self, step: _Step) -> None:
        """Drain one srun's stderr to the end whatever it holds: bytes, split on newlines (a line of any length),
        decoded with replacement; a failure to echo or parse one line never stops the reading (a reader that died
        would let the pipe fill and block every rank that writes to stderr)."""
        assert step.proc.stderr is not None
        for raw in iter(step.proc.stderr.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            with contextlib.suppress(Exception):
                sys.stderr.write(line)  # srun's and the ranks' stderr reach the user
            try:
                event = parse_srun_line(line)
            except Exception:  # noqa: BLE001 - a line that does not parse is not a report line
                event = None
            if event is not None:
                with self._lock:
                    step.events.append(event)

    def _collect(self) -> list[RankExit]:
        """Turn the steps' new report lines, and the ends of srun processes, into the ends of the ranks they own
        now (a rank replaced since is not the step's any more); the launcher's own kills are recorded, not
        returned."""
        out: list[RankExit] = []
        for step in self._steps:
            code = step.proc.poll()
            if code is not None and not step.collected and step.reader is not None:
                step.reader.join(timeout=5)
            with self._lock:
                events, step.events = step.events, []
            for event in events:
                if event.node_failure:
                    tasks = [t for t, h in enumerate(step.hosts) if h == event.host]
                else:
                    tasks = [t for t in event.ranks if 0 <= t < len(step.ranks)]
                step.named += 1
                ranks = self._end(step, tasks, event.code)
                if ranks:
                    out.append(with_fields(event, ranks=ranks))
            if code is not None and not step.collected:
                step.collected = True
                left = [t for t in range(len(step.ranks)) if self._owner[step.ranks[t]] == (step, t)]
                left = [t for t in left if step.ranks[t] not in self._ended]
                if code != 0 and not step.named:  # srun failed without naming a task (a refused step, a bad list)
                    ranks = self._end(step, left, code)
                    if step is self._steps[0]:
                        out.append(RankExit("", [], code))  # no host to blame
                    elif ranks:  # a replacement's step: its one rank
                        out.append(RankExit(step.hosts[0], ranks, code))
                    continue
                for t in left:  # tasks srun did not name ended well (srun names every task that failed)
                    ranks = self._end(step, [t], 0)
                    if ranks:
                        out.append(RankExit(step.hosts[t], ranks, 0))
        return out

    def _end(self, step: _Step, tasks: list[int], code: int) -> list[int]:
        """Record that ``tasks`` of ``step`` ended with ``code``; the ranks to report (owned, not killed by us)."""
        ranks = []
        for t in tasks:
            rank = step.ranks[t]
            if self._owner[rank] != (step, t) or rank in self._ended:
                continue
            self._ended[rank] = code
            if rank not in self._killed:
                ranks.append(rank)
        return ranks

    # ------------------------------------------------------------------ what the launcher asks
    def poll(self) -> list[RankExit]:
        """The ranks that ended since the last call (an exit code 0 once their step ended)."""
        out, self._unreported = self._unreported + self._collect(), []
        return out

    def finished(self) -> bool:
        """Every srun process ended and its report was read (a failure not yet collected shows at the next poll)."""
        return all(s.proc.poll() is not None for s in self._steps) and all(s.collected for s in self._steps)

    def succeeded(self) -> bool:
        return self.finished() and all(self._ended.get(r) == 0 for r in range(self.world_size))

    def alive(self) -> list[int]:
        """The ranks whose latest process is not known to have ended."""
        return [r for r in range(self.world_size) if r not in self._ended and self._owner[r][0].proc.poll() is None]

    @property
    def pids(self) -> list[int]:
        """Each rank's process id on its node where a pid file was read already (-1 elsewhere: reading thousands of
        files on a shared file system during a restart is not free; the launcher takes the pids from the ranks'
        heartbeats once every rank reported)."""
        return [self._pids.get(r, -1) for r in range(self.world_size)] if self.in_job else []

    def _where(self, rank: int) -> tuple[str, int] | None:
        """(host, pid) of ``rank``'s latest process, from its pid file (None while the file is not there)."""
        step, task = self._owner[rank]
        if self.control is None:
            return None
        try:
            info = json.loads((self.control / f"{step.keys[task]}.pid").read_text())
            host, pid = str(info["host"]), int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._pids[rank] = pid
        return host, pid

    def _on_nodes(self, orders: dict[str, list[str]], timeout_s: float) -> dict[str, str]:
        """Run ``orders[host]`` (a command) on each host in a step beside the job's (``srun --overlap``); each
        host's standard output ("" when it failed or did not answer in ``timeout_s``)."""

        def run(host: str) -> str:
            argv = [self.srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", *orders[host]]
            try:
                done = subprocess.run(argv, capture_output=True, timeout=timeout_s, start_new_session=True)
            except (OSError, subprocess.TimeoutExpired):
                return ""
            return done.stdout.decode(errors="replace")

        if not orders:
            return {}
        with ThreadPoolExecutor(min(PROBE_WORKERS, len(orders))) as pool:
            return dict(zip(orders, pool.map(run, orders), strict=True))

    def kill(self, ranks: Sequence[int], timeout_s: float = KILL_TIMEOUT_S) -> None:
        """SIGKILL the latest process of each of ``ranks`` on its node and wait until srun reports it ended (a
        replacement step's srun is killed too); a rank not reported within ``timeout_s`` counts as ended (its node
        does not answer). Ranks already ended are left alone; their ends are never reported as exits."""
        alive = set(self.alive())
        live = [r for r in ranks if r in alive]
        self._killed.update(ranks)
        orders: dict[str, list[str]] = {}
        for rank in live:
            where = self._where(rank)
            if where is not None:
                orders.setdefault(where[0], ["kill", "-KILL"]).append(str(where[1]))
        self._on_nodes(orders, timeout_s)
        for rank in self._unreported_after(live, timeout_s):
            step, _ = self._owner[rank]
            if len(step.ranks) == 1:
                signal_group(step.proc.pid, signal.SIGKILL)
            self._ended[rank] = -int(signal.SIGKILL)
            sys.stderr.write(f"mula launch: rank {rank}'s end was not reported within {timeout_s:g} s of its kill\n")

    def _unreported_after(self, ranks: Sequence[int], timeout_s: float) -> list[int]:
        """The ranks of ``ranks`` whose end srun has not reported within ``timeout_s`` (their reports collected
        meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._unreported += self._collect()
            waiting = [r for r in ranks if r not in self._ended]
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.05)

    def stopped_ranks(self, among: Sequence[int] | None = None) -> list[int]:
        """Ranks (of ``among``, default every live one) whose process is stopped (SIGSTOP: state ``T``), read from
        ``/proc/PID/stat`` on their nodes: one ``srun --overlap`` per host, :data:`PROBE_WORKERS` at a time (on a
        hang of every rank of 1,000 nodes, some 30 rounds of srun)."""
        wanted = [r for r in (self.alive() if among is None else among) if r not in self._ended]
        where = {r: w for r in wanted if (w := self._where(r)) is not None}
        orders: dict[str, list[str]] = {}
        for host, pid in where.values():
            orders.setdefault(host, ["cat"]).append(f"/proc/{pid}/stat")
        said = self._on_nodes(orders, 20.0)
        stopped: set[tuple[str, int]] = set()
        for host, text in said.items():
            for line in text.splitlines():
                pid, _, rest = line.partition(" (")
                state = rest.rpartition(")")[2].split()[:1]
                if pid.strip().isdigit() and state and state[0] in ("T", "t"):
                    stopped.add((host, int(pid)))
        return [r for r, w in where.items() if w in stopped]

    def replace(
        self,
        ranks: Sequence[int],
        nodes: Sequence[str],
        command: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path | None = None,
    ) -> None:
        """In-job restart: a step of its own for each of ``ranks`` on its node of ``nodes`` (the attempt's nodes now:
        a buffer node where one was lost), numbered as that rank; every other rank's process is kept. The ranks'
        processes must have ended (:meth:`kill` them first). Their output goes where the main step's goes
        (``log_dir`` is the local backend's)."""
        if not self.in_job:
            raise RuntimeError("a rank can be started alone only in an in-job SLURM attempt")
        self._unreported += self._collect()
        alive = set(self.alive())
        running = [r for r in ranks if r in alive]
        if running:
            raise RuntimeError(f"ranks {running} are still running: kill them before replacing them")
        self.nodes = list(nodes)
        for rank in ranks:
            self._incarnation[rank] += 1
            key = f"r{rank}.{self._incarnation[rank]}"
            host = self.nodes[rank // self.nproc_per_node]
            layout = ["--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--kill-on-bad-exit=0"]
            argv = [self.srun, *layout, *self.replace_args, *self._shim(command, rank, key)]
            self._owner[rank] = (self._run(argv, env, [rank], [host], [key]), 0)
            self._ended.pop(rank, None)
            self._pids.pop(rank, None)
            self._killed.discard(rank)

    def stop(self, grace_s: float) -> None:
        """SIGTERM every srun (it forwards the signal to its tasks), SIGKILL after ``grace_s`` (SLURM then ends the
        steps' tasks itself)."""
        for step in self._steps:
            if step.proc.poll() is None:
                signal_group(step.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for step in self._steps:
            try:
                step.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(step.proc.pid, signal.SIGKILL)
                step.proc.wait()
        for step in self._steps:
            if step.reader is not None:
                step.reader.join(timeout=5)
