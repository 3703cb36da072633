"""How one attempt's processes are started, watched and stopped: simulated nodes on this machine, or ``srun``.

Both backends start one attempt on a list of nodes and report, as it happens, which ranks exited and how
(:class:`RankExit`); the launcher (:mod:`mula_lightning.launch.launcher`) decides what a failure means.

* :class:`LocalAttempt`: node ``k`` is a group of ``P`` processes on this machine with ``MULA_NODE_NAME`` set to the
  node's name, rendezvous on loopback, and the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning, Fabric and
  plain ``torch.distributed`` code run unchanged. Each rank is the leader of its own process group, so stopping
  it also stops whatever it started (data-loader workers).
* :class:`~mula_lightning.launch.slurm_backend.SlurmAttempt`: ``srun`` steps (its own module).

Stopping (both): SIGTERM (plus SIGCONT, so that a stopped process can act on it), then SIGKILL after the grace
period; nothing is left running when :meth:`stop` returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalAttempt", "RankExit", "free_port", "process_stopped", "signal_group"]


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


def _mula_argv(command: Sequence[str]) -> list[str] | None:
    """The ``mula`` arguments of ``python -m mula_lightning.cli ARGS`` (what a warm spare can run), else None."""
    if len(command) > 3 and list(command[1:3]) == ["-m", "mula_lightning.cli"] and command[3] == "fit":
        return [str(a) for a in command[3:]]
    return None


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (gone already: nothing to do)."""
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
        spares: int = 0,
        port: int | None = None,
    ) -> None:
        self.nodes = list(nodes)
        self.nproc_per_node = nproc_per_node
        self.world_size = len(self.nodes) * nproc_per_node
        self.port = free_port() if port is None else port  # a given port: a store the launcher hosts
        self.procs: list[tuple[str, int, subprocess.Popen]] = []
        self._reported: set[int] = set()
        for rank in range(self.world_size):
            self.procs.append(self._spawn(command, rank, env, log_dir))
        #: warm spares (:mod:`mula_lightning.launch.spare`), for a ``mula fit`` command only; started by
        #: :meth:`fill_spares`, once the ranks are up (their imports do not compete with the ranks')
        self.spares: list[subprocess.Popen] = []
        self.spare_target = spares if _mula_argv(command) is not None else 0
        self._spare_env, self._spare_log = dict(env), (log_dir.parent / "spares.log" if log_dir else None)

    def fill_spares(self) -> int:
        """Start warm spares until :attr:`spare_target` are running (dead ones are reaped); how many were started."""
        self.spares = [proc for proc in self.spares if proc.poll() is None]
        started = max(0, self.spare_target - len(self.spares))
        for _ in range(started):
            self.spares.append(self._start_spare())
        return started

    def _start_spare(self) -> subprocess.Popen:
        out = open(self._spare_log, "ab") if self._spare_log else None  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [sys.executable, "-m", "mula_lightning.launch.spare"],
            env=self._spare_env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        if out is not None:
            out.close()
        return proc

    def _from_spare(
        self, command: Sequence[str], rank_env: dict[str, str], log: Path | None
    ) -> subprocess.Popen | None:
        """A warm spare turned into the rank of ``rank_env`` (:meth:`fill_spares` starts another later), or None."""
        argv = _mula_argv(command)
        while argv is not None and self.spares:
            proc = self.spares.pop(0)
            order = {"env": rank_env, "argv": argv, "log": str(log) if log else None}
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(order).encode() + b"\n")
                proc.stdin.close()
            except OSError:  # the spare died: try the next one
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                continue
            return proc
        return None

    def _spawn(
        self, command: Sequence[str], rank: int, env: Mapping[str, str], log_dir: Path | None, warm: bool = False
    ) -> tuple[str, int, subprocess.Popen]:
        node_rank, local_rank = divmod(rank, self.nproc_per_node)
        host = self.nodes[node_rank]
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(node_rank),
            "NODE_RANK": str(node_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "MULA_NODE_NAME": host,
        }
        if "GLOO_SOCKET_IFNAME" not in rank_env and sys.platform.startswith("linux"):
            rank_env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback rendezvous: keep gloo's sockets there too
        log = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            log = log_dir / f"{host}.rank{rank}.log"
        if warm and (spare := self._from_spare(command, rank_env, log)) is not None:
            return host, rank, spare
        out = open(log, "ab") if log is not None else None  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            list(command), env=rank_env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        return host, rank, proc

    def replace(
        self,
        ranks: Sequence[int],
        nodes: Sequence[str],
        command: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path | None = None,
    ) -> None:
        """In-job restart: a new process for each of ``ranks`` (on its node of ``nodes``, the attempt's nodes now:
        a buffer node where one was lost), same rendezvous address, a warm spare where one is ready; every other
        rank's process is kept. The processes of ``ranks`` must have ended (:meth:`kill` them first)."""
        self.nodes = list(nodes)
        for rank in ranks:
            old = self.procs[rank][2]
            if old.poll() is None:
                raise RuntimeError(f"rank {rank} (pid {old.pid}) is still running: kill it before replacing it")
            self.procs[rank] = self._spawn(command, rank, env, log_dir, warm=True)
            self._reported.discard(rank)

    def kill(self, ranks: Sequence[int]) -> None:
        """SIGKILL the processes (and their process groups) of ``ranks`` and reap them (stopped ones included).
        A process already reaped is left alone: its pid (and process group id) may belong to another process by
        now (a hang's victims are killed at detection and again with their node's ranks at the restart)."""
        for rank in ranks:
            if self.procs[rank][2].poll() is None:
                signal_group(self.procs[rank][2].pid, signal.SIGKILL)
        for rank in ranks:
            self.procs[rank][2].wait()
        self._reported.update(ranks)  # the launcher's own kills are never reported as exits

    def alive(self) -> list[int]:
        """The ranks whose process is running (stopped ones included)."""
        return [rank for _, rank, proc in self.procs if proc.poll() is None]

    def stopped_ranks(self, among: Sequence[int] | None = None) -> list[int]:
        """Ranks (of ``among``, default all) whose process is stopped (SIGSTOP: state ``T``)."""
        wanted = set(range(self.world_size) if among is None else among)
        return [r for _, r, proc in self.procs if r in wanted and proc.poll() is None and process_stopped(proc.pid)]

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

    def stop(self, grace_s: float) -> None:
        """SIGTERM (and SIGCONT) every rank's process group, SIGKILL what is left after ``grace_s``; reap all."""
        for _, _, proc in self.procs:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
                signal_group(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self.finished():
            time.sleep(0.05)
        for _, _, proc in self.procs:
            signal_group(proc.pid, signal.SIGKILL)  # also the group's other members, even if the leader exited
            proc.wait()
        for spare in self.spares:  # nothing of theirs to save: ended at once
            signal_group(spare.pid, signal.SIGKILL)
            spare.wait()
        self.spares = []
