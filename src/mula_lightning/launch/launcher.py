"""The attempt loop of ``mula launch``: start, watch, classify the failure, take failed nodes out, relaunch.

Why (Aurora paper, Section 4): at hundreds of nodes a week-long run meets hard node failures (a node dies) and soft
ones (a node keeps running but produces NaN); the paper relaunches from the newest checkpoint on healthy nodes,
with buffer nodes allocated up front. torchrun's elastic agent restarts on the same nodes only; this loop also
chooses the nodes.

One attempt runs the command on N nodes x P ranks (:mod:`~mula_lightning.launch.backends`) and ends when:

* every rank exits 0: the launch succeeds;
* a rank exits non-zero or is killed: the launcher waits ``settle_s`` for the other ranks of that moment, then
  asks :mod:`~mula_lightning.launch.attribution` what it means: a node is lost only on hard evidence (SLURM's node
  failure report, every rank of a node killed by a SIGKILL the launcher did not send); an abort, a segfault, an exit
  code or a NaN on one node makes the node a suspect, taken out only when it is blamed again in the next attempt;
  NaN on ranks of several nodes (or expert-parallel groups), or the same step going non-finite again on other
  nodes, is the model or the data: the launch stops with :data:`EXIT_DIVERGED` and nobody is evicted;
* no heartbeat (:class:`~mula_lightning.callbacks.heartbeat.Heartbeat`) from a rank for ``hang_timeout_s`` (or none
  at all within ``startup_timeout_s``: a rendezvous that never completes), also after a rank reported the end of
  training without exiting: a hang. Hosts with a stopped process are taken out; otherwise the hosts of the ranks
  that fell behind (lowest step) are suspects. ``hang_timeout_s = 0`` turns hang detection off (a command that
  sends no heartbeats).

While an attempt runs, the launcher also reads ``stragglers.jsonl`` (``MULA_STRAGGLERS_FILE``: the reports of
:class:`~mula_lightning.callbacks.straggler_detection.StragglerDetection`): a node named in ``straggler_reports``
reports in a row is *slow*; the run goes on, and the next attempt, when a failure causes one, runs on a buffer node
in its place if one is free.

With ``in_job`` (``--in-job``, ``mula fit`` or a script under ``run_loop_in_job``) a failure is first
offered to the in-job restart: the verdict is applied as for a relaunch, then the failed ranks' processes (all ranks
of a node taken out) are killed, the next attempt is announced in ``REPORT_DIR/in_job.json`` and only those ranks
get new processes (warm spares where ready; under SLURM one-task ``srun --overlap`` steps,
:mod:`~mula_lightning.launch.slurm_backend`; on a buffer node for a node taken out), while every other rank keeps its
process and rejoins (:mod:`mula_lightning.utils.in_job_restart`). It falls back to the relaunch below, saying why,
for a NaN, a second failure before the restarted attempt reloaded, ranks that already finished, a hang with nobody to
blame, no buffer node, the last restart, a loss of the job's store (which the launcher hosts in a process of its own,
:mod:`~mula_lightning.launch.store_host`, so that rank 0 restarts in-job like any other rank).

Then every process of the attempt is stopped (SIGTERM, SIGKILL after ``grace_s``; none is left), N healthy nodes
are chosen among active + buffer - failed, and the command is relaunched. Every attempt of ``mula fit``, the first
included, runs with ``--ckpt_path last`` (DualCheckpoint's newest valid slot; with none yet Lightning starts fresh),
so a job that SLURM requeues or a user resubmits continues its run; a ``--ckpt_path`` the user gave is kept until
a rank reports a checkpoint saved by this launch. The launch stops with :data:`EXIT_OUT_OF_NODES` when fewer than
N healthy nodes remain and :data:`EXIT_RESTARTS_EXHAUSTED` when ``max_restarts`` relaunches were used;
checkpoints are never touched by the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mula_lightning.launch.attribution import (
    DIVERGED,
    LOST,
    SUSPECT,
    NanRecord,
    Verdict,
    attribute_exits,
    attribute_hang,
    attribute_nan,
    attribute_unreachable,
    parse_nan_line,
)
from mula_lightning.launch.backends import LocalAttempt, RankExit
from mula_lightning.launch.heartbeat_server import HeartbeatServer
from mula_lightning.launch.hostlist import allocation_nodes, no_kill_warning, unreachable_nodes
from mula_lightning.launch.in_job import InJobRestarts
from mula_lightning.launch.node_pool import NodePool, OutOfNodesError
from mula_lightning.launch.report import AttemptRecord, LaunchReport
from mula_lightning.launch.slurm_backend import SlurmAttempt
from mula_lightning.launch.store_host import StoreHost
from mula_lightning.utils.launch_env import (
    ATTEMPT_ENV,
    FAILED_HOSTS_ENV,
    HEARTBEAT_ENV,
    HOSTED_STORE_ENV,
    IN_JOB_ENV,
    IN_JOB_OP_TIMEOUT_ENV,
    IN_JOB_TIMEOUT_ENV,
    LAUNCH_ID_ENV,
    LAUNCH_STARTED_ENV,
    NAN_EVENTS_ENV,
    NAN_EXIT_CODE,
    STRAGGLERS_ENV,
    resume_from_last,
)

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_INTERRUPTED",
    "EXIT_OUT_OF_NODES",
    "EXIT_RESTARTS_EXHAUSTED",
    "LaunchOptions",
    "Launcher",
    "command_for_attempt",
]

#: fewer healthy nodes than ``--nnodes`` remain
EXIT_OUT_OF_NODES = 3
#: ``--max-restarts`` relaunches were used and the last attempt failed too
EXIT_RESTARTS_EXHAUSTED = 4
#: non-finite values the model or the data caused (several nodes at once, or the same step again elsewhere)
EXIT_DIVERGED = 5
#: seconds between rewrites of the report while an attempt runs (events rewrite it at once)
REPORT_EVERY_S = 10.0
#: the launcher itself was stopped (SIGINT / SIGTERM, e.g. ``scancel``); every rank was stopped first
EXIT_INTERRUPTED = 130


@dataclass
class LaunchOptions:
    """What ``mula launch`` was asked to do (see :mod:`mula_lightning.launch.cli` for each option's meaning)."""

    command: list[str]
    nnodes: int
    nproc_per_node: int = 1
    buffer_nodes: int = 0
    max_restarts: int = 3
    hang_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0
    grace_s: float = 15.0
    settle_s: float = 2.0
    poll_s: float = 0.2
    report_dir: str = "launch"
    backend: str = "local"
    nodes: list[str] = field(default_factory=list)
    srun: str = "srun"
    srun_args: list[str] = field(default_factory=list)
    heartbeat_host: str = ""
    straggler_reports: int = 3
    in_job: bool = False
    spares: int | None = None  # warm spares under --in-job; None: one node's worth (nproc_per_node)
    rejoin_timeout_s: float = 300.0  # an in-job restart not reloaded on every rank by then falls back to a relaunch
    collective_timeout_s: float = 0.0  # in-job: the attempts' collectives time out after this (0: --startup-timeout)
    srun_replace_args: list[str] = field(default_factory=list)  # in-job, slurm: srun options of a replacement's step

    def check(self) -> None:
        """Refuse values that cannot work, naming them."""
        if not self.command:
            raise ValueError("no command to launch: mula launch [OPTIONS] -- mula fit --config ...")
        for name in ("nnodes", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be at least 1")
        for name in ("buffer_nodes", "max_restarts", "straggler_reports", "spares"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be >= 0")
        for name in ("hang_timeout_s", "startup_timeout_s", "rejoin_timeout_s", "collective_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} ({getattr(self, name)}) must be >= 0 (0 = off)")
        if self.grace_s <= 0:
            raise ValueError(f"--grace ({self.grace_s}) must be > 0 seconds")
        if self.backend not in ("local", "slurm"):
            raise ValueError(f"--backend {self.backend!r}: expected local or slurm")


def _fit_index(command: Sequence[str]) -> int | None:
    """Index of the ``fit`` word when ``command`` runs ``mula fit`` (console script or ``-m mula_lightning.cli``)."""
    for i in range(1, len(command)):
        before = command[i - 1]
        if command[i] == "fit" and (Path(before).name == "mula" or before == "mula_lightning.cli"):
            return i
    return None


def _user_ckpt_path(command: Sequence[str]) -> bool:
    return any(arg == "--ckpt_path" or arg.startswith("--ckpt_path=") for arg in command)


def command_for_attempt(
    command: Sequence[str], attempt: int, nnodes: int, nproc_per_node: int, keep_user_ckpt: bool = False
) -> list[str]:
    """The command line of one attempt: ``mula fit`` gets the node layout (``--trainer.num_nodes`` /
    ``--trainer.devices``) and ``--ckpt_path last`` on every attempt, the first included (a requeued or resubmitted
    job resumes from the newest valid slot; with no slot yet Lightning starts fresh), replacing any ``--ckpt_path``
    of the user's unless ``keep_user_ckpt`` (no checkpoint of this launch exists yet, so the user's start point is
    still the newest). Any other command runs unchanged. ``attempt`` is kept for the report and the callers."""
    out = list(command)
    if _fit_index(out) is None:
        return out
    if not (keep_user_ckpt and _user_ckpt_path(out)):
        out = resume_from_last(out)
    return [*out, "--trainer.num_nodes", str(nnodes), "--trainer.devices", str(nproc_per_node)]


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Launcher(InJobRestarts):
    """Runs :class:`LaunchOptions` to the end; :meth:`run` returns the exit code."""

    def __init__(self, options: LaunchOptions) -> None:
        options.check()
        self.options = options
        if options.nodes:
            all_nodes = list(options.nodes)
        elif options.backend == "slurm":
            all_nodes = allocation_nodes()
        else:
            all_nodes = [f"node{k}" for k in range(options.nnodes + options.buffer_nodes)]
        wanted = options.nnodes + options.buffer_nodes
        if len(all_nodes) < wanted:
            raise ValueError(
                f"--nnodes {options.nnodes} + --buffer-nodes {options.buffer_nodes} = {wanted} nodes, but only "
                f"{len(all_nodes)} are available ({', '.join(all_nodes)})"
            )
        self.pool = NodePool(all_nodes[:wanted], options.nnodes)
        self.report_dir = Path(options.report_dir)
        self.failed_hosts_file = self.report_dir / "failed_hosts.txt"  # the hosts taken out, one name per line
        self.nan_events_file = self.report_dir / "nan_events.jsonl"  # NaNDetector's records, one JSON per line
        self.stragglers_file = self.report_dir / "stragglers.jsonl"  # StragglerDetection's reports, one per line
        self.in_job_file = self.report_dir / "in_job.json"  # the attempt the ranks of an in-job restart rejoin
        self._stragglers_offset = 0  # bytes of it already read
        self._straggler_streak: dict[str, int] = {}  # host -> reports in a row that named it (this attempt)
        self.launch_id = uuid.uuid4().hex[:12]
        self.started = time.time()  # a slot marked after it was saved by this launch (``mula fit``'s resume check)
        settings = {k: v for k, v in asdict(options).items() if k != "command"}
        settings.update(command=list(options.command), nodes=list(self.pool.nodes), launch_id=self.launch_id)
        self.report = LaunchReport(self.report_dir, settings)
        self.store = StoreHost(self._store_address())  # the job's store under --in-job, started with attempt 0
        self.world_size = options.nnodes * options.nproc_per_node
        self.saved = False  # a rank reported a checkpoint saved during this launch
        self._previous_nan: list[NanRecord] = []  # the NaN records of the previous attempt, if it stopped on NaN
        self._current: AttemptRecord | None = None  # the newest attempt (in-job restarts make one without a relaunch)
        self._restarting = False  # an in-job restart is under way: a fault now falls back to a relaunch

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def interrupted(signum: int, frame: Any) -> None:
            raise _Interrupted(signum)

        for sig in previous:
            signal.signal(sig, interrupted)
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        with HeartbeatServer(self.options.heartbeat_host) as server, self.store:
            return self._attempts(server)

    def _attempts(self, server: HeartbeatServer) -> int:
        opts = self.options
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.failed_hosts_file.touch()
        self.nan_events_file.touch()
        self.stragglers_file.touch()
        self._stragglers_offset = self.stragglers_file.stat().st_size
        if opts.backend == "slurm" and (warning := no_kill_warning()) is not None:
            self.report.event(f"warning: {warning}", no_kill=False)
        previous: AttemptRecord | None = None  # the attempt before, when it failed
        attempt = 0
        while True:
            slow = dict(self.pool.slow)
            try:
                nodes = self.pool.choose()
            except OutOfNodesError as err:
                return self._finish("out_of_nodes", EXIT_OUT_OF_NODES, str(err))
            for host in (h for h in slow if h in self.pool.failed):
                self._list_failed(host)
                self.report.event(f"{host} is replaced by a buffer node: {slow[host]}", slow_host=host)
            self._straggler_streak = {}
            command = self._attempt_command(attempt)
            record = self.report.start_attempt(attempt, nodes, command)
            record.started_by = "launch" if attempt == 0 else "relaunch"
            self.report.event(
                f"attempt {attempt}: {self.world_size} ranks on {', '.join(nodes)}"
                + (" (resuming from the newest checkpoint, if any)" if "last" in command[-5:] else ""),
                attempt=attempt,
                nodes=nodes,
            )
            handle = None
            self._current = record
            self._announce_attempt(attempt, [])
            try:
                handle = self._start(command, nodes, self._env(server, attempt), attempt)
                record.pids = list(getattr(handle, "pids", []))
                ok = self._watch(handle, record, server, previous)
            except _Interrupted as err:
                if handle is not None:
                    handle.stop(opts.grace_s)
                record = self._current
                record.outcome, record.ended = "interrupted", time.time()
                return self._finish("interrupted", EXIT_INTERRUPTED, f"stopped by {err}; every rank was stopped")
            record = self._current  # in-job restarts made new attempts within the same processes
            attempt, nodes = record.attempt, record.nodes
            if ok:
                return self._finish("succeeded", 0, f"finished in attempt {attempt} on {', '.join(nodes)}")
            if record.outcome == DIVERGED:
                return self._finish(DIVERGED, EXIT_DIVERGED, record.reason)
            previous = record
            if attempt >= opts.max_restarts:
                return self._finish(
                    "restarts_exhausted",
                    EXIT_RESTARTS_EXHAUSTED,
                    f"attempt {attempt} failed ({record.reason}) and all {opts.max_restarts} restarts are used",
                )
            attempt += 1

    def _attempt_command(self, attempt: int) -> list[str]:
        """The command line of ``attempt`` (:func:`command_for_attempt`; the user's ``--ckpt_path`` kept until a rank
        reported a slot saved by this launch)."""
        opts = self.options
        return command_for_attempt(
            opts.command, attempt, opts.nnodes, opts.nproc_per_node, keep_user_ckpt=not self.saved
        )

    def _env(self, server: HeartbeatServer, attempt: int) -> dict[str, str]:
        """The environment of every rank of ``attempt``."""
        env = {
            **os.environ,
            HEARTBEAT_ENV: server.address,
            ATTEMPT_ENV: str(attempt),
            FAILED_HOSTS_ENV: str(self.failed_hosts_file.resolve()),
            NAN_EVENTS_ENV: str(self.nan_events_file.resolve()),
            STRAGGLERS_ENV: str(self.stragglers_file.resolve()),
            LAUNCH_ID_ENV: self.launch_id,
            LAUNCH_STARTED_ENV: f"{self.started:.3f}",
        }
        env.pop(IN_JOB_ENV, None)
        env.pop(HOSTED_STORE_ENV, None)
        if self._hosts_store():  # a rejoin may wait as long as a start
            env[IN_JOB_ENV] = str(self.in_job_file.resolve())
            env[HOSTED_STORE_ENV] = "1"
            env[IN_JOB_TIMEOUT_ENV] = f"{self.options.startup_timeout_s or 1800:g}"
            if self.options.collective_timeout_s:
                env[IN_JOB_OP_TIMEOUT_ENV] = f"{self.options.collective_timeout_s:g}"
        return env

    def _start(self, command: list[str], nodes: list[str], env: dict[str, str], attempt: int) -> Any:
        opts = self.options
        port = None
        if self._hosts_store():
            if self.store.port is not None and not self.store.alive():
                self.report.event(f"the job's store ended (port {self.store.port}): a new one serves attempt {attempt}")
            port = self.store.ensure({**os.environ, LAUNCH_ID_ENV: self.launch_id})
        if opts.backend == "slurm":
            return SlurmAttempt(
                command,
                nodes,
                opts.nproc_per_node,
                env,
                srun=opts.srun,
                extra_args=opts.srun_args,
                in_job=opts.in_job,
                control_dir=self.report_dir / "slurm" / f"attempt{attempt}",
                master=(self.store.host, port) if port is not None else None,
                replace_args=opts.srun_replace_args,
            )
        return LocalAttempt(
            self._local_command(command),
            nodes,
            opts.nproc_per_node,
            env,
            spares=(opts.nproc_per_node if opts.spares is None else opts.spares) if opts.in_job else 0,
            log_dir=self.report_dir / "logs" / f"attempt{attempt}",
            port=port,
        )

    def _hosts_store(self) -> bool:
        """Whether the launcher hosts the job's store (:mod:`~mula_lightning.launch.store_host`): under ``--in-job``,
        so that rank 0 restarts in-job like any other rank."""
        return self.options.in_job

    def _store_address(self) -> str:
        """The address the ranks reach the job's store at: this host's (``--heartbeat-host``, else its name) under
        SLURM, where the ranks run on other nodes; loopback for the local backend."""
        if self.options.backend != "slurm":
            return "127.0.0.1"
        import socket

        return self.options.heartbeat_host or socket.gethostname()

    @staticmethod
    def _local_command(command: list[str]) -> list[str]:
        if command and command[0] == "mula":  # this interpreter, whatever PATH holds
            return [sys.executable, "-m", "mula_lightning.cli", *command[1:]]
        return command

    def _finish(self, outcome: str, code: int, message: str) -> int:
        self.report.event(message if code == 0 else f"error: {message}", outcome=outcome, exit_code=code)
        self.report.finish(outcome, code, message)
        return code

    # ------------------------------------------------------------------ one attempt
    def _watch(
        self, handle: Any, record: AttemptRecord, server: HeartbeatServer, previous: AttemptRecord | None
    ) -> bool:
        """Watch one attempt until it succeeds (True) or fails (False; stopped, hosts marked, record filled). An
        in-job restart goes on watching the same processes as the next attempt (``self._current``)."""
        opts = self.options
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # rank -> (record text, launcher clock when it last changed)
        records: dict[int, dict[str, Any]] = {}
        steps: dict[int, int] = {}
        exited_ok: set[int] = set()  # processes known to have exited 0 (a rank that only reported "end" may hang)
        events_offset = self.nan_events_file.stat().st_size
        written = start
        self._restarting = False  # an in-job restart whose ranks have not all reloaded yet
        while True:
            exits = handle.poll()
            now = time.monotonic()
            lost = self.store.failure() if self._hosts_store() else None
            if lost is not None:  # a store loss: every rank's next store operation fails; a relaunch on a new one
                handle.stop(opts.grace_s)
                record.outcome, record.ended, record.reason = "failed", time.time(), lost
                self._announce_failure(record, "the job's store was lost")
                return False
            for rank, beat in server.read(record.attempt, self.world_size).items():
                text = json.dumps(beat, sort_keys=True)
                if seen.get(rank, ("",))[0] != text:
                    seen[rank] = (text, now)
                    records[rank] = beat
                    self._note_beat(record, beat, previous)
                    steps[rank] = int(beat["step"])
            if len(records) == self.world_size and not any(b.get("phase") == "setup" for b in records.values()):
                self._restarting = False
                if -1 in record.pids or len(record.pids) != self.world_size:  # SLURM: known once the ranks beat
                    record.pids = [int(records[r].get("pid", -1)) for r in range(self.world_size)]
                if hasattr(handle, "fill_spares") and handle.fill_spares():  # the ranks are up: warm the spares
                    self.report.write()
            self._read_stragglers(record)
            if now - written > REPORT_EVERY_S:  # the progress (last step) reaches the report now and then
                written = now
                self.report.write()
            for ended in exits:
                if ended.code == 0:
                    exited_ok.update(ended.ranks)
            bad = [e for e in exits if e.code != 0]
            if bad and self._replace_stuck(handle, record, bad, server):
                bad = []
            hang = None if bad or handle.finished() else self._hang(seen, records, exited_ok, start, now)
            if bad or hang is not None:
                if bad:  # a rank that reported the end of training cannot rejoin either (under SLURM its exit 0
                    # is known only once the whole step ended)
                    done = exited_ok | {r for r, b in records.items() if b.get("phase") == "end"}
                    after = self._on_exit_failure(handle, record, bad, events_offset, done, server)
                else:
                    after = self._on_hang(handle, record, hang, records, steps, now, server)  # type: ignore[arg-type]
                if after is None:
                    return False
                previous, record = record, after  # in-job: the same processes, the next attempt
                start, seen, records, steps, exited_ok = time.monotonic(), {}, {}, {}, set()
                events_offset = self.nan_events_file.stat().st_size
                continue
            if handle.finished():
                if handle.succeeded():
                    handle.stop(opts.grace_s)  # every rank ended: what is left is a warm spare or a stray child
                    record.outcome, record.ended = "succeeded", time.time()
                    self.report.write()
                    return True
                continue  # a failure not yet reported by poll(): the next round sees it
            time.sleep(opts.poll_s)

    def _note_beat(self, record: AttemptRecord, beat: dict[str, Any], previous: AttemptRecord | None) -> None:
        """Progress, the resume point and the moments of a restart's cost (rank clocks: the beats' ``time``)."""
        at = float(beat.get("time") or time.time())
        for phase in ("setup", "start"):  # processes up and the group formed / checkpoint loaded, training starts
            when = beat.get(f"{phase}_time")
            if isinstance(when, (int, float)):
                old = getattr(record, f"{phase}_at")
                setattr(record, f"{phase}_at", float(when) if old is None else min(old, float(when)))
        if beat.get("phase") == "setup":  # before the checkpoint is loaded: its step is not the run's
            return
        step = int(beat["step"])
        redo = previous.last_step if previous is not None else None
        if record.caught_up_at is None and redo is not None and step >= redo:  # the steps lost are done again
            record.caught_up_at = at
        self.saved |= bool(beat.get("saved"))
        record.last_step = step if record.last_step is None else max(record.last_step, step)
        if record.resumed_from_step is None and beat.get("resumed_from") is not None:
            record.resumed_from_step = int(beat["resumed_from"])
        first_train = beat.get("first_train_time")
        if record.first_step_at is None and first_train is not None:
            record.first_step_at = float(first_train)
            if previous is not None and previous.failure_at is not None:
                record.time_lost_s = round(record.first_step_at - previous.failure_at, 3)
                self.report.event(
                    f"attempt {record.attempt}: first step after resuming from step {record.resumed_from_step}; "
                    f"time lost {record.time_lost_s:.1f} s",
                    attempt=record.attempt,
                    resumed_from_step=record.resumed_from_step,
                    time_lost_s=record.time_lost_s,
                )

    def _read_stragglers(self, record: AttemptRecord) -> None:
        """Count, per host, the straggler reports in a row that named it; at ``straggler_reports`` the host is slow."""
        limit = self.options.straggler_reports
        try:
            size = self.stragglers_file.stat().st_size
        except OSError:
            return
        if size <= self._stragglers_offset or not limit:
            return
        with open(self.stragglers_file, "rb") as fh:
            fh.seek(self._stragglers_offset)
            chunk = fh.read(size - self._stragglers_offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._stragglers_offset += len(complete)
        for line in complete.splitlines():
            try:
                report = json.loads(line)
                named = {s["host"]: s for s in report["stragglers"]}
            except (ValueError, KeyError, TypeError):
                continue  # not a report: skipped, never fatal
            self._straggler_streak = {h: self._straggler_streak.get(h, 0) + 1 for h in named}
            for host, count in self._straggler_streak.items():
                if count != limit or host in self.pool.slow or not self._known_host(host, "a straggler report"):
                    continue
                s = named[host]
                why = (
                    f"straggler in {count} reports in a row (last at step {report.get('step')}: rank {s.get('rank')} "
                    f"fell behind in {s.get('section')}, relative score {s.get('relative')})"
                )
                self.pool.mark_slow(host, why)
                record.straggler_hosts.append(host)
                spare = "no buffer node is free"
                if self.pool.buffer:
                    spare = "a buffer node replaces it at the next relaunch"
                self.report.event(f"attempt {record.attempt}: {host} is slow, a {why}; {spare}", straggler=host)

    def _hang(
        self,
        seen: dict[int, tuple[str, float]],
        records: dict[int, dict[str, Any]],
        ended: set[int],
        start: float,
        now: float,
    ) -> tuple[list[int], float] | None:
        """``(silent ranks, when they went silent)`` when the attempt hangs, else None. ``ended``: ranks whose
        process exited 0; a rank that reported the end of training but did not exit is still watched. A rank whose
        last beat is ``setup`` (it is loading a checkpoint) has the startup timeout, not the hang timeout; while an
        in-job restart is under way, the shorter of it and ``rejoin_timeout_s`` (then the restart falls back to a
        relaunch)."""
        opts = self.options
        if opts.hang_timeout_s == 0:
            return None
        startup = opts.startup_timeout_s or float("inf")
        if self._restarting and opts.rejoin_timeout_s:
            startup = min(startup, opts.rejoin_timeout_s)
        if not seen:
            return (list(range(self.world_size)), start) if now - start > startup else None
        silent = []
        for rank in range(self.world_size):
            if rank in ended:
                continue
            since = seen[rank][1] if rank in seen else start
            limit = opts.hang_timeout_s if rank in seen and records[rank].get("phase") != "setup" else startup
            if now - since > limit:
                silent.append(rank)
        if not silent:
            return None
        return silent, min(seen[r][1] if r in seen else start for r in silent)

    def _on_exit_failure(
        self,
        handle: Any,
        record: AttemptRecord,
        bad: list[RankExit],
        events_offset: int,
        exited_ok: set[int],
        server: HeartbeatServer,
    ) -> AttemptRecord | None:
        """A rank ended badly: the in-job restart's next attempt when one is possible, else None (every rank
        stopped, the record filled, the pool updated: the caller relaunches or gives up)."""
        opts = self.options
        first = bad[0]
        record.failure_at = time.time() - (time.monotonic() - first.at)
        deadline = time.monotonic() + opts.settle_s  # the other ranks of the same moment
        while time.monotonic() < deadline and not handle.finished():
            time.sleep(0.05)
            bad += [e for e in handle.poll() if e.code != 0]
        bad += [e for e in handle.poll() if e.code != 0]
        record.detected_at = time.time()
        nan = any(e.code == NAN_EXIT_CODE for e in bad)
        if nan:
            with open(self.nan_events_file) as fh:
                fh.seek(events_offset)
                nan_records = [r for r in map(parse_nan_line, fh) if r is not None]
            verdict = attribute_nan(nan_records, self._previous_nan)
            self._previous_nan = nan_records
        else:
            verdict = attribute_exits(bad, opts.nproc_per_node)
            self._previous_nan = []
        failed = sorted({r for e in bad for r in e.ranks})
        refusal = self._in_job_refusal(handle, failed, exited_ok, "a NaN ends every rank (NaNDetector)" if nan else "")
        if refusal is None:
            record.ended, record.outcome = time.time(), "failed"
            self._apply(record, verdict)
            if record.outcome == DIVERGED:
                handle.stop(opts.grace_s)
                self._announce_failure(record)
                return None
            return self._restart_in_job(handle, record, failed, server)
        handle.stop(opts.grace_s)  # after the classification's evidence is in: the launcher's own kills never count
        record.ended = time.time()
        record.outcome = "failed"
        self._apply(record, verdict)
        self._announce_failure(record, refusal)
        return None

    def _on_hang(
        self,
        handle: Any,
        record: AttemptRecord,
        hang: tuple[list[int], float],
        records: dict[int, dict[str, Any]],
        steps: dict[int, int],
        now: float,
        server: HeartbeatServer,
    ) -> AttemptRecord | None:
        """A hang: the in-job restart's next attempt when the hung ranks are known (a stopped process, or ranks
        behind the others) and the rest may stay, else None (every rank stopped, as for :meth:`_on_exit_failure`)."""
        silent, since = hang
        record.failure_at = time.time() - (now - since)
        record.detected_at = time.time()
        victims = list(handle.stopped_ranks(silent))
        per_node = self.options.nproc_per_node
        stopped = list(dict.fromkeys(record.nodes[r // per_node] for r in victims))  # a stopped rank is silent
        known = {r: steps[r] for r in silent if r in steps}
        if not victims and known and min(known.values()) < max(steps.values()):
            victims = [r for r, step in known.items() if step == min(known.values())]
        unknown = "" if victims else "no rank of the hang is known to be the one that stopped"
        finished = {r for r, b in records.items() if b.get("phase") == "end"} - set(victims)
        refusal = self._in_job_refusal(handle, victims, finished, unknown)
        if refusal is None:
            handle.kill(victims)  # the survivors' collectives with them fail now: they rejoin
        else:
            handle.stop(self.options.grace_s)
        record.ended, record.outcome = time.time(), "hang"
        self._previous_nan = []
        verdict = attribute_hang(silent, records, steps, stopped)
        self._apply(record, verdict)
        ended = [r for r in silent if records.get(r, {}).get("phase") == "end"]
        if not records:
            record.reason = f"hang: no rank reported within the startup timeout ({self.options.startup_timeout_s:g} s)"
        else:
            quiet = now - since  # at detection: the stop that follows (up to --grace) is not silence
            what = "reported the end of training but did not exit" if ended and ended == silent else "silent"
            record.reason = (
                f"hang: ranks {','.join(map(str, silent))} {what} for {quiet:.0f} s (timeout "
                f"{self.options.hang_timeout_s:g} s) at step {max(steps.values(), default=0)}; {verdict.reason}"
            )
        if refusal is None:
            return self._restart_in_job(handle, record, victims, server)
        self._announce_failure(record, refusal)
        return None

    def _apply(self, record: AttemptRecord, verdict: Verdict) -> None:
        """Carry out a verdict on the pool: lost hosts out now, suspects counted, otherwise the chain broken. Under
        SLURM the attempt's nodes that ``scontrol`` reports down or not responding are lost first."""
        if self.options.backend == "slurm":
            verdict = attribute_unreachable(unreachable_nodes(record.nodes), verdict)
        record.reason = verdict.reason
        record.ep_groups = list(verdict.ep_groups)
        if verdict.kind == DIVERGED:
            record.outcome = DIVERGED
            self.pool.clear_suspects()
            return
        if verdict.kind == LOST:
            for host in verdict.lost:
                self._fail_host(record, host, verdict.why.get(host, verdict.reason))
            return
        known = [h for h in verdict.suspects if self._known_host(h, verdict.reason)]
        if verdict.kind == SUSPECT and known:
            record.suspect_hosts = known
            for host in self.pool.mark_suspects(known, verdict.reason):
                record.failed_hosts.append(host)
                self._list_failed(host)
        else:
            self.pool.clear_suspects()

    def _known_host(self, host: str, why: str) -> bool:
        """Whether ``host`` is one of the pool's nodes; an unknown name is reported, never dropped silently."""
        if host in self.pool.nodes:
            return True
        self.report.event(
            f"warning: {why!r} names host {host!r}, which is not one of this launch's nodes "
            f"({', '.join(self.pool.nodes)}); nobody is taken out for it (do the ranks report the node names the "
            "pool uses? under SLURM they use SLURMD_NODENAME)",
            unknown_host=host,
        )
        return False

    def _fail_host(self, record: AttemptRecord, host: str, why: str) -> None:
        if self._known_host(host, why) and host not in record.failed_hosts:
            self.pool.mark_failed(host, why)
            record.failed_hosts.append(host)
            self._list_failed(host)

    def _list_failed(self, host: str) -> None:
        """Add a host taken out to ``failed_hosts.txt`` (one name per line, each once: what a job script passes to
        ``srun --exclude=$(paste -sd, failed_hosts.txt)``; the reasons are in the launch report)."""
        if host not in self.failed_hosts_file.read_text().split():
            with open(self.failed_hosts_file, "a") as fh:
                fh.write(host + "\n")

    def _announce_failure(self, record: AttemptRecord, refusal: str | None = None) -> None:
        """The failure's event; ``refusal``: why it was not restarted in-job (under ``--in-job``)."""
        out = f"; taken out: {', '.join(record.failed_hosts)}" if record.failed_hosts else ""
        sus = f"; suspect: {', '.join(record.suspect_hosts)}" if record.suspect_hosts else ""
        fallback = f"; no in-job restart ({refusal}): every rank is stopped" if refusal else ""
        self.report.event(
            f"attempt {record.attempt} failed {_after_step(record.last_step)}: {record.reason}{out}{sus}{fallback}",
            attempt=record.attempt,
            reason=record.reason,
            failed_hosts=record.failed_hosts,
            step=record.last_step,
        )


def _after_step(step: int | None) -> str:
    """Where an attempt failed, in the 1-based steps of ``MULA_FAULT`` and the progress lines: ranks report the steps
    they completed, so a failure reported after step 4 happened in step 5 (a fault ``kill@step=5``), not "at step 4"."""
    if step is None:
        return "before its first step"
    return f"after step {step} (in step {step + 1})"
