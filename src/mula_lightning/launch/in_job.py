"""The launcher's half of an in-job restart: whether a failure can be restarted in-job, and doing it.

Why a module of its own: the relaunch loop (:mod:`mula_lightning.launch.launcher`) is the launcher's core and stays
as it was; an in-job restart is one more way out of a failed attempt, tried first under ``--in-job``. The rank's
half (leaving the broken group, waiting for the announcement, rejoining) is
:mod:`mula_lightning.utils.in_job_restart`; the whole protocol is described in docs/launch.md ("In-job restart").

:class:`InJobRestarts` is mixed into :class:`~mula_lightning.launch.launcher.Launcher` and uses its pool, report,
options and current attempt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mula_lightning.launch.heartbeat_server import HeartbeatServer
from mula_lightning.launch.node_pool import NodePool, OutOfNodesError
from mula_lightning.launch.report import AttemptRecord, LaunchReport
from mula_lightning.utils.io import atomic_write_text
from mula_lightning.utils.launch_env import STUCK_EXIT_CODE

__all__ = ["InJobRestarts"]


class InJobRestarts:
    """The in-job restart of :class:`~mula_lightning.launch.launcher.Launcher` (see the module docstring)."""

    # what the launcher provides (its options are ``LaunchOptions``, typed loosely: the launcher imports this module)
    options: Any
    pool: NodePool
    report: LaunchReport
    world_size: int
    launch_id: str
    report_dir: Path
    in_job_file: Path
    _current: AttemptRecord
    _restarting: bool
    _attempt_command: Callable[[int], list[str]]
    _env: Callable[[HeartbeatServer, int], dict[str, str]]
    _local_command: Callable[[list[str]], list[str]]
    _announce_failure: Callable[..., None]

    def _announce_attempt(self, attempt: int, replaced: list[int]) -> None:
        """Tell the ranks that left a broken attempt which attempt to rejoin (``--in-job``; written atomically, after
        the replaced ranks' old processes are gone, so that none of them can join it)."""
        if self.options.in_job:
            text = json.dumps({"attempt": attempt, "replaced_ranks": replaced, "launch_id": self.launch_id})
            atomic_write_text(self.in_job_file, text)

    def _in_job_refusal(self, handle: Any, failed: list[int], exited_ok: set[int], why_not: str) -> str | None:
        """None when the failure of ``failed`` can be restarted in-job; else why not ("" when ``--in-job`` is off)."""
        opts = self.options
        if not opts.in_job:
            return ""
        if why_not:
            return why_not
        if not hasattr(handle, "replace"):
            return f"the {opts.backend} backend starts every rank in one step: one rank cannot be started alone"
        if self._restarting:
            return f"a second fault before the in-job restart of attempt {self._current.attempt} completed"
        if exited_ok:
            return f"ranks {','.join(map(str, sorted(exited_ok)))} had already finished"
        if not set(handle.alive()) - set(failed):
            return "no rank is left alive"
        if self._current.attempt >= opts.max_restarts:
            return f"all {opts.max_restarts} restarts are used"
        return None

    def _restart_in_job(
        self, handle: Any, record: AttemptRecord, failed: list[int], server: HeartbeatServer
    ) -> AttemptRecord | None:
        """Start a process for each failed rank, and for every rank of a node taken out (on the buffer node that
        takes its place); the other processes stay and rejoin as the next attempt. None (every rank stopped) when
        that cannot be: no buffer node is left."""
        opts = self.options
        victims = set(failed)
        for host in record.failed_hosts:
            victims |= {k * opts.nproc_per_node + j for k, h in enumerate(record.nodes) if h == host
                        for j in range(opts.nproc_per_node)}  # fmt: skip
        try:
            nodes = self.pool.choose(swap_slow=False)
        except OutOfNodesError as err:
            handle.stop(opts.grace_s)
            self._announce_failure(record, str(err))
            return None
        self._announce_failure(record)
        ranks = sorted(victims)
        handle.kill(ranks)
        attempt = record.attempt + 1
        command = self._attempt_command(attempt)
        after = self.report.start_attempt(attempt, nodes, command)
        after.started_by, after.replaced_ranks = "in-job", ranks
        log_dir = self.report_dir / "logs" / f"attempt{attempt}"
        self._announce_attempt(attempt, ranks)
        handle.replace(ranks, nodes, self._local_command(command), self._env(server, attempt), log_dir)
        after.pids = list(handle.pids)
        self._restarting, self._current = True, after
        hosts = ", ".join(dict.fromkeys(nodes[r // opts.nproc_per_node] for r in ranks))
        kept = self.world_size - len(ranks)
        self.report.event(
            f"attempt {attempt} (in-job): rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} restarted "
            f"on {hosts}; the other {kept} ranks keep their processes and rejoin from the newest checkpoint",
            attempt=attempt,
            nodes=nodes,
            replaced_ranks=ranks,
        )
        return after

    def _replace_stuck(self, handle: Any, record: AttemptRecord, bad: list[Any], server: HeartbeatServer) -> bool:
        """Ranks that ended with :data:`~mula_lightning.utils.launch_env.STUCK_EXIT_CODE` while an in-job restart
        forms its attempt (survivors whose main thread stayed blocked in the broken attempt after their connections
        were cut) get new processes in that same attempt: its group cannot form without them, so no rank trained in
        it yet and nothing is redone twice. False (the failure is handled as any other) for any other exit, outside
        a restart."""
        stuck = sorted({r for e in bad for r in e.ranks})
        if not (self._restarting and bad and all(e.code == STUCK_EXIT_CODE for e in bad)):
            return False
        log_dir = self.report_dir / "logs" / f"attempt{record.attempt}"
        handle.kill(stuck)  # reaped already: only their stray children, if any
        handle.replace(stuck, record.nodes, self._local_command(record.command), self._env(server, record.attempt),
                       log_dir)  # fmt: skip
        record.replaced_ranks = sorted({*record.replaced_ranks, *stuck})
        record.pids = list(handle.pids)
        plural = "s" if len(stuck) > 1 else ""
        self.report.event(
            f"attempt {record.attempt} (in-job): rank{plural} {','.join(map(str, stuck))} could not leave attempt "
            f"{record.attempt - 1} (exit {STUCK_EXIT_CODE}: blocked after the cut) and get{'' if plural else 's'} a "
            "new process in this attempt",
            attempt=record.attempt,
            replaced_ranks=stuck,
        )
        return True
