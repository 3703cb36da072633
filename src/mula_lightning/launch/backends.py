"""How one attempt's processes are started, watched and stopped: simulated nodes on this machine, or ``srun``.

Both backends start one attempt on a list of nodes and report, as it happens, which ranks exited and how
(:class:`RankExit`); the launcher (:mod:`mula_lightning.launch.launcher`) decides what a failure means.

* :class:`LocalAttempt`: node ``k`` is a group of ``P`` processes on this machine with ``MULA_NODE_NAME`` set to the
  node's name, rendezvous on loopback, and the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning, Fabric and
  plain ``torch.distributed`` code run unchanged. Each rank is the leader of its own process group, so stopping
  it also stops whatever it started (data-loader workers).
* :class:`SlurmAttempt`: one ``srun --nodes N --nodelist ... --ntasks-per-node P`` step; SLURM starts the ranks
  (Lightning's ``SLURMEnvironment`` reads the task variables; ``MASTER_ADDR`` / ``MASTER_PORT`` are set by the
  launcher). Which ranks failed is read from ``srun``'s own report lines (``srun: error: HOST: task 3: Killed``,
  ``... Exited with exit code 1``, ``Node failure on HOST``), which are passed through to the launcher's stderr.

Stopping (both): SIGTERM (plus SIGCONT, so that a stopped process can act on it), then SIGKILL after the grace
period; nothing is left running when :meth:`stop` returns.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalAttempt", "RankExit", "SlurmAttempt", "free_port", "parse_srun_line", "process_stopped"]


@dataclass
class RankExit:
    """Ranks that ended, as the backend saw it: ``code`` is the exit status, ``-signal`` when killed by one; ``host``
    is empty when the backend could not say where (srun failing before any task ran)."""

    host: str
    ranks: list[int]
    code: int
    at: float = field(default_factory=time.monotonic)
    node_failure: bool = False  # SLURM reported the node itself as failed (hard evidence)
    detail: str = ""  # srun's own wording, when it is not one this module knows

    @property
    def killed(self) -> bool:
        """The process vanished: killed by a signal (SIGKILL, a segfault, the OOM killer), not an orderly exit."""
        return self.code < 0

    def describe(self) -> str:
        if self.node_failure:
            return f"node failure on {self.host} (SLURM)"
        if self.detail:
            how = f"ended: {self.detail}"
        elif self.code < 0:
            try:
                how = f"killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"killed by signal {-self.code}"
        else:
            how = f"exited with code {self.code}"
        ranks = ",".join(map(str, self.ranks))
        return f"{self.host} rank{'s' if len(self.ranks) > 1 else ''} {ranks} {how}"


def free_port() -> int:
    """A TCP port free on this machine now (for the rendezvous of the next attempt)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP / SIGTSTP: state ``T`` in ``/proc``); False where ``/proc`` is absent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class LocalAttempt:
    """``len(nodes) x nproc_per_node`` processes of ``command`` on this machine, node ``k`` named ``nodes[k]``."""

    def __init__(
        self,
        command: Sequence[str],
        nodes: Sequence[str],
        nproc_per_node: int,
        env: Mapping[str, str],
        log_dir: Path | None = None,
    ) -> None:
        self.nodes = list(nodes)
        self.nproc_per_node = nproc_per_node
        world = len(self.nodes) * nproc_per_node
        port = free_port()
        self.procs: list[tuple[str, int, subprocess.Popen]] = []
        self._reported: set[int] = set()
        for node_rank, host in enumerate(self.nodes):
            for local_rank in range(nproc_per_node):
                rank = node_rank * nproc_per_node + local_rank
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(nproc_per_node),
                    "GROUP_RANK": str(node_rank),
                    "NODE_RANK": str(node_rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "MULA_NODE_NAME": host,
                }
                if "GLOO_SOCKET_IFNAME" not in rank_env and sys.platform.startswith("linux"):
                    rank_env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback rendezvous: keep gloo's sockets there too
                out = None
                if log_dir is not None:
                    log_dir.mkdir(parents=True, exist_ok=True)
                    out = open(log_dir / f"{host}.rank{rank}.log", "ab")  # noqa: SIM115 (closed in stop/poll)
                proc = subprocess.Popen(
                    list(command),
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    start_new_session=True,
                )
                if out is not None:
                    out.close()  # the child holds its own descriptor
                self.procs.append((host, rank, proc))

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, _, p in self.procs]

    def poll(self) -> list[RankExit]:
        """The ranks that ended since the last call."""
        ended = []
        now = time.monotonic()  # one poll cannot tell which of its exits came first: they share one time
        for host, rank, proc in self.procs:
            code = proc.poll()
            if code is not None and rank not in self._reported:
                self._reported.add(rank)
                ended.append(RankExit(host, [rank], code, at=now))
        return ended

    def finished(self) -> bool:
        return all(proc.poll() is not None for _, _, proc in self.procs)

    def succeeded(self) -> bool:
        return all(proc.poll() == 0 for _, _, proc in self.procs)

    def stopped_hosts(self) -> list[str]:
        """Hosts with a rank that is stopped (a SIGSTOPped process makes no progress and never exits)."""
        return list(dict.fromkeys(h for h, _, p in self.procs if p.poll() is None and process_stopped(p.pid)))

    def stop(self, grace_s: float) -> None:
        """SIGTERM (and SIGCONT) every rank's process group, SIGKILL what is left after ``grace_s``; reap all."""
        for _, _, proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
                _signal_group(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self.finished():
            time.sleep(0.05)
        for _, _, proc in self.procs:
            _signal_group(proc.pid, signal.SIGKILL)  # also the group's other members, even if the leader exited
            proc.wait()


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


class SlurmAttempt:
    """One ``srun`` step over ``nodes``; its report lines say which ranks ended and how."""

    def __init__(
        self,
        command: Sequence[str],
        nodes: Sequence[str],
        nproc_per_node: int,
        env: Mapping[str, str],
        srun: str = "srun",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.nodes = list(nodes)
        port = free_port()
        self.argv = [
            srun,
            f"--nodes={len(self.nodes)}",
            f"--nodelist={','.join(self.nodes)}",
            f"--ntasks-per-node={nproc_per_node}",
            f"--ntasks={len(self.nodes) * nproc_per_node}",
            *extra_args,
            *command,
        ]
        step_env = {**env, "MASTER_ADDR": self.nodes[0], "MASTER_PORT": str(port)}
        self.proc = subprocess.Popen(self.argv, env=step_env, stderr=subprocess.PIPE, start_new_session=True)
        self._lock = threading.Lock()
        self._pending: list[RankExit] = []
        self._reader = threading.Thread(target=self._read, name="srun-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Drain srun's stderr to the end whatever it holds: bytes, split on newlines (a line of any length),
        decoded with replacement; a failure to echo or parse one line never stops the reading (a reader that died
        would let the pipe fill and block every rank that writes to stderr)."""
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            with contextlib.suppress(Exception):
                sys.stderr.write(line)  # srun's and the ranks' stderr reach the user
            try:
                event = parse_srun_line(line)
            except Exception:  # noqa: BLE001 - a line that does not parse is not a report line
                event = None
            if event is not None:
                with self._lock:
                    self._pending.append(event)

    def poll(self) -> list[RankExit]:
        code = self.proc.poll()
        if code is not None:
            self._reader.join(timeout=5)
        with self._lock:
            ended, self._pending = self._pending, []
        if code not in (None, 0) and not ended and not getattr(self, "_exit_reported", False):
            self._exit_reported = True  # srun failed without naming a task (a refused step, a bad node list)
            ended.append(RankExit("", [], code))  # no host to blame
        return ended

    def finished(self) -> bool:
        return self.proc.poll() is not None

    def succeeded(self) -> bool:
        return self.proc.poll() == 0

    def stopped_hosts(self) -> list[str]:
        return []  # not visible from the batch host

    def stop(self, grace_s: float) -> None:
        """SIGTERM srun (it forwards the signal to every task), SIGKILL after ``grace_s`` (SLURM then ends the
        step's tasks itself)."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=5)
