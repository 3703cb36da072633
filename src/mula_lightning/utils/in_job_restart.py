"""In-job restart, the rank's side: a rank whose peer failed stays alive and rejoins the job's next attempt.

Why: a full relaunch stops every process of the job and starts them all again; at scale most of its cost is the
healthy processes re-importing torch and Lightning, re-forming their groups and re-reading their checkpoint shards,
for one rank that died. NVIDIA's resiliency extension restarts inside the running processes instead (abort, health
check, re-rendezvous, rerun); ``mula launch --in-job`` does the same for ``mula fit``: the processes of the healthy
ranks stay alive, the launcher starts a process only for each failed rank, and every rank re-forms the process
group under the next attempt number and resumes from the newest complete checkpoint.

How, under ``MULA_IN_JOB`` (:data:`~mula_lightning.utils.launch_env.IN_JOB_ENV`: the launcher's announcement file):

* **one store for the whole job**: a ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``, hosted by ``mula launch`` beside
  itself (``MULA_STORE_HOSTED``: :mod:`mula_lightning.launch.store_host`, as torchrun's agent hosts it), so that it
  outlives every rank and rank 0 restarts in-job like the others (without it, rank 0 hosts the store for as long
  as its process lives); each attempt's process group is formed on a ``PrefixStore`` of it
  (``mula/attempt<N>/``), so a new attempt needs no new port and never reads an older attempt's keys. The group is
  formed here, before Lightning's strategy sets up, which then finds it initialised and keeps it;
* **seeing a peer fail**: gloo raises at once in a rank whose collective reads from a peer that died (its socket
  closes: ``Connection closed by peer``); a hung peer (SIGSTOP, a frozen GPU) is SIGKILLed by the launcher after
  ``--hang-timeout``, which turns the wait into the same error. What a survivor catches is a *peer's* failure
  (:func:`is_peer_failure`: gloo's and c10d's connection errors, NCCL's abort, in the exception or its causes); any
  other error (this rank's own exception, a NaN, a full disk) ends this process as before, and the launcher replaces
  it or relaunches;
* **leaving the broken attempt** (:meth:`RestartGroup.leave`): end the W&B run, abort NCCL / XCCL communicators, cut
  the attempt's TCP connections (:func:`cut_connections`, keeping the store's and the heartbeat's: a gloo group closes
  its sockets only when it is freed, and a thread blocked in one of its collectives keeps it alive, so without the cut
  a rank still inside a collective with this one would wait until the group's timeout), let the checkpoint threads
  end (their collectives fail with the group: no write of theirs runs on once the next attempt loads a slot), destroy
  every group. NCCL: set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (the watchdog aborts a communicator whose collective
  cannot complete and raises, without ending the process) and a ``timeout`` a little above the hang timeout;
* **a survivor blocked on another survivor** (both alive, neither reading from the failed rank): a watcher thread
  reads the announcement file while an attempt runs; once a later attempt is announced it cuts the connections
  (again every :data:`RECUT_S`) and gives the groups' later operations a short timeout, and any error the stage
  raises after that counts as leaving. A main thread still inside the attempt :data:`STUCK_S` later ends the
  process with :data:`~mula_lightning.utils.launch_env.STUCK_EXIT_CODE`, and the launcher starts a new process
  for the rank in the announced attempt;
* **rejoining**: wait for the launcher to announce the next attempt in its file (:func:`announced_attempt`; written
  once the failed ranks' processes are gone, so none of them can join it), take its number (``MULA_LAUNCH_ATTEMPT``:
  faults, heartbeats and the group's prefix follow it) and run the stage again from the same configuration with
  ``--ckpt_path last`` (once a slot was completed in this process; a ``--ckpt_path`` of the user's is kept until
  then, as the launcher does).

Whether a failure is restarted in-job or by a full relaunch is the launcher's choice (for a relaunch it stops every
rank); a rank waits ``MULA_IN_JOB_TIMEOUT`` seconds (the launcher's ``--startup-timeout``) for the announcement and
for its peers, then fails like a rendezvous that never completes.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mula_lightning.utils.launch_env import (
    ATTEMPT_ENV,
    HEARTBEAT_ENV,
    HOSTED_STORE_ENV,
    IN_JOB_ENV,
    IN_JOB_OP_TIMEOUT_ENV,
    IN_JOB_TIMEOUT_ENV,
    STUCK_EXIT_CODE,
    resume_from_last,
)

__all__ = [
    "PEER_FAILURE_WORDS",
    "RestartGroup",
    "announced_attempt",
    "in_job_file",
    "in_job_op_timeout",
    "cut_connections",
    "in_job_timeout",
    "is_peer_failure",
    "resume_args",
    "run_in_job",
    "run_loop_in_job",
]

#: words of the errors a collective raises when a peer's process ended or aborted (gloo's transport, c10d's
#: socket layer, NCCL's abort), matched in the message of a ``RuntimeError`` or ``DistError`` and their causes
PEER_FAILURE_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "communicator was aborted",
    "process group was aborted",
    "remote process exited",
)
#: seconds between two reads of the launcher's announcement file while an attempt runs
WATCH_POLL_S = 0.5
#: seconds the main thread has to leave an attempt once the watcher cut its connections
STUCK_S = 20.0
#: seconds between two cuts of a broken attempt's connections while its main thread has not left it
RECUT_S = 0.2
#: the timeout of every operation a broken attempt's groups start after the cut (they fail instead of waiting)
CUT_OP_TIMEOUT_S = 5.0
#: seconds a rejoin waits by default (``MULA_IN_JOB_TIMEOUT``)
DEFAULT_TIMEOUT_S = 1800.0
#: the state of a listening socket in /proc/net/tcp
TCP_LISTEN = "0A"
#: seconds a checkpoint thread of the broken attempt may take to see its group fail and end
CHECKPOINT_THREAD_JOIN_S = 60.0


def in_job_file() -> Path | None:
    """The launcher's announcement file (``MULA_IN_JOB``), None when this run is not restarted in-job."""
    value = os.environ.get(IN_JOB_ENV, "").strip()
    return Path(value) if value else None


def in_job_timeout() -> float:
    """``MULA_IN_JOB_TIMEOUT``: seconds a rank that left a broken attempt waits for the next one (default 1800)."""
    return _env_seconds(IN_JOB_TIMEOUT_ENV, "a rejoin may wait (e.g. 1800)") or DEFAULT_TIMEOUT_S


def in_job_op_timeout() -> float | None:
    """``MULA_IN_JOB_OP_TIMEOUT``: seconds after which an attempt's collective fails; None when unset (the groups
    keep the rejoin wait, :func:`in_job_timeout`, as their timeout)."""
    return _env_seconds(IN_JOB_OP_TIMEOUT_ENV, "a collective may wait (e.g. 60)")


def _env_seconds(name: str, what: str) -> float | None:
    """The positive seconds in the variable ``name``, None when unset; a ValueError naming it and ``what`` the
    seconds are for otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: expected the seconds {what}")
    return seconds


def announced_attempt(path: Path, after: int, timeout_s: float, poll_s: float = 0.1) -> tuple[int, list[int]]:
    """Wait until the launcher announces an attempt later than ``after`` in ``path``; ``(attempt, replaced
    ranks)``. Raises ``TimeoutError`` after ``timeout_s`` (the launcher chose a relaunch and stops every rank
    first, so only a launcher that died leaves a rank waiting that long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            if int(record["attempt"]) > after:
                return int(record["attempt"]), [int(r) for r in record.get("replaced_ranks", [])]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no attempt after {after} was announced in {path} within {timeout_s:g} s ({IN_JOB_TIMEOUT_ENV}): "
                "is mula launch still running?"
            )
        time.sleep(poll_s)


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from, or while handling) says that a peer of a collective
    failed, rather than this rank: see :data:`PEER_FAILURE_WORDS`."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RuntimeError):  # DistError (DistBackendError, DistNetworkError) is a RuntimeError
            text = str(current).lower()
            if any(word in text for word in PEER_FAILURE_WORDS):
                return True
        stack += [current.__cause__, current.__context__, getattr(current, "original", None)]
    return False


def resume_args(args: Sequence[str], saved: bool) -> list[str]:
    """``args`` of a stage run again in-job: ``--ckpt_path last`` when a slot was ``saved`` in this process (or the
    args already resume from ``last``), replacing the user's ``--ckpt_path``; unchanged otherwise (the user's start
    point is still the newest)."""
    return resume_from_last(list(args)) if saved else list(args)


class RestartGroup:
    """This job's store (the launcher's with ``MULA_STORE_HOSTED``, else rank 0's for the life of its process) and the
    attempts' process groups on it.

    Args:
        timeout_s: how long joining an attempt may wait for every rank (the replacement's start included).
    """

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise ValueError(f"{IN_JOB_ENV} is set but {', '.join(missing)} is not: start the ranks with mula launch")
        self.kept_sockets = set(tcp_sockets())  # the connections made before any group: never cut
        self._watching: int | None = None  # the attempt :meth:`watch` watches
        self._watch_lock = threading.Lock()  # no cut once :meth:`unwatch` returned (the next attempt's are safe)
        self.cut_attempt: int | None = None  # the last attempt the watcher cut (it was announced over)
        self.op_timeout = in_job_op_timeout()
        self._timed: set[int] = set()  # the groups given ``op_timeout`` (by id) in the watched attempt
        self.rank = int(os.environ["RANK"])
        #: this process serves the job's store (rank 0 when the launcher does not host it): it must not end first
        self.hosts_store = self.rank == 0 and os.environ.get(HOSTED_STORE_ENV, "") != "1"
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            None,
            self.hosts_store,
            timeout=self.timeout,
            wait_for_workers=False,
        )

    @staticmethod
    def backend() -> str:
        """gloo for CPU tensors, plus NCCL or XCCL for the accelerator's (what Lightning would pick for each)."""
        import torch

        if torch.cuda.is_available():
            return "cpu:gloo,cuda:nccl"
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return "cpu:gloo,xpu:xccl"
        return "gloo"

    def join(self, attempt: int) -> None:
        """Form the default process group of ``attempt`` (collective over every rank of the job)."""
        import torch.distributed as dist

        store = dist.PrefixStore(f"mula/attempt{attempt}/", self.store)
        dist.init_process_group(
            self.backend(), store=store, rank=self.rank, world_size=self.world_size, timeout=self.timeout
        )
        if self.op_timeout is not None:  # formed with the rejoin's wait; its collectives get theirs
            _set_timeouts([dist.group.WORLD], self.op_timeout)

    def watch(self, announcements: Path, attempt: int, poll_s: float = WATCH_POLL_S) -> None:
        """Until :meth:`unwatch`, cut this process's attempt connections (and abort NCCL / XCCL communicators) as
        soon as the launcher announces an attempt after ``attempt``: a rank whose collective waits for another
        survivor (both alive, neither reading from the failed rank) would otherwise wait until the group's timeout;
        the cut makes its collective fail, and it leaves and rejoins like the others."""
        self._watching = attempt
        self._timed = set()

        def run() -> None:
            while self._watching == attempt:
                if self.op_timeout is not None:
                    self._time_new_groups(attempt)
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    if int(json.loads(announcements.read_text())["attempt"]) > attempt:
                        self._cut_until_left(attempt)
                        return
                time.sleep(poll_s)

        threading.Thread(target=run, name="mula-in-job-watch", daemon=True).start()

    def _time_new_groups(self, attempt: int) -> None:
        """Give every group of the attempt made since the last poll (the strategy's, the checkpoint's) the
        collective timeout ``op_timeout``: it bounds how long a collective can stay blocked after the attempt is
        cut (gloo wakes a send queued behind a full socket buffer only at its timeout)."""
        import torch.distributed as dist

        with self._watch_lock:
            if self._watching != attempt or not (dist.is_available() and dist.is_initialized()):
                return
            fresh = [g for g in list(dist.distributed_c10d._world.pg_map) if id(g) not in self._timed]
            if fresh:
                _set_timeouts(fresh, float(self.op_timeout or 0))
                self._timed.update(id(g) for g in fresh)

    def unwatch(self) -> None:
        """The main thread left the watched attempt: from now on the watcher cuts nothing."""
        with self._watch_lock:
            self._watching = None

    def was_cut(self, attempt: int) -> bool:
        """Whether the watcher cut ``attempt`` (the launcher announced a later one): whatever that attempt's stage
        raised since, this rank is a survivor and rejoins."""
        return self.cut_attempt == attempt

    def _cut_until_left(self, attempt: int, grace_s: float = STUCK_S) -> None:
        """Cut the attempt's connections (abort NCCL / XCCL, give the groups' later operations a short timeout)
        and cut again every :data:`RECUT_S` (a connection made since: gloo connects some pairs lazily) until the
        main thread leaves the attempt. A main thread still inside it after ``grace_s`` is blocked where no cut
        reaches (a store wait, a lock, a gloo operation that never sees the cut): its stacks go to the log and the
        process ends with :data:`~mula_lightning.utils.launch_env.STUCK_EXIT_CODE`; the launcher starts a new
        process for this rank in the announced attempt (whose group cannot form without it, so nobody trained in
        it), instead of every rank waiting for it until the rejoin timeout."""
        deadline = time.monotonic() + grace_s
        first = True
        while time.monotonic() < deadline:
            with self._watch_lock:
                if self._watching != attempt:
                    return
                cut_connections(self.kept_sockets | set(job_sockets()))
                if first:
                    self.cut_attempt, first = attempt, False
                    self._shorten_timeouts()
                    self._abort_communicators()
            time.sleep(RECUT_S)
        if self._watching != attempt:
            return
        ends = "this process ends (the launcher replaces it)"
        if self.hosts_store:  # it waits (the collective timeout, the rejoin's): its end would take the store along
            ends = "it keeps waiting: its process hosts the job's store"
        _say(f"rank {self.rank}: still inside attempt {attempt} {grace_s:g} s after its connections were cut; its "
             f"threads' stacks follow, and {ends}")  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        if not self.hosts_store:
            os._exit(STUCK_EXIT_CODE)

    @staticmethod
    def _shorten_timeouts(seconds: float = CUT_OP_TIMEOUT_S) -> None:
        """Every group's later operations time out after ``seconds`` (the attempt is over: one entered now must
        fail, not wait the group's timeout for a peer that left)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _set_timeouts(list(dist.distributed_c10d._world.pg_map), seconds)

    @staticmethod
    def _abort_communicators() -> None:
        """Abort the NCCL / XCCL communicators of every group: their collectives then fail instead of waiting.
        Never gloo's (so not ``_abort_process_group``): a gloo group's abort blocks until its worker threads end
        and stops them, so a collective queued behind the ones in flight (the main thread's, behind a backward's
        asynchronous reductions) never runs and its caller waits forever; the cut ends gloo's collectives."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        for group in list(dist.distributed_c10d._world.pg_map):
            for device in ("cuda", "xpu"):
                with contextlib.suppress(Exception):  # no backend for that device in this group
                    backend = group._get_backend(torch.device(device))
                    if "gloo" not in type(backend).__name__.lower():
                        backend.abort()

    def close(self) -> None:
        """Destroy the process groups and drop the store (in the process that hosts it, its server ends), before the
        interpreter does: a store or group left to interpreter shutdown can end the process with ``terminate
        called`` (:func:`~mula_lightning.utils.dist.release_process_groups`)."""
        from mula_lightning.utils.dist import release_process_groups

        with contextlib.suppress(Exception):
            release_process_groups()
        self.store = None

    def leave(self) -> None:
        """Leave the broken attempt: end this process's W&B run, abort the groups' communicators (NCCL, XCCL), cut
        the attempt's connections to its peers, wait for its checkpoint threads (their collectives fail with it),
        destroy every process group and free what the attempt held.

        Why cut connections: a gloo group closes its sockets only when the group object is freed, and a thread
        blocked in one of its collectives (a checkpoint write, or the main thread of a peer waiting for this rank)
        keeps it alive, so without the cut a peer that is still inside a collective with this rank would wait for
        it until the group's timeout; with it, that peer's collective fails at once and the peer rejoins as well.
        """
        from mula_lightning.utils.dist import release_process_groups

        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish(exit_code=1)
        self.unwatch()
        self._abort_communicators()
        cut_connections(self.kept_sockets | set(job_sockets()))
        for thread in threading.enumerate():
            if thread.name.startswith("mula-checkpoint-") and thread is not threading.current_thread():
                thread.join(CHECKPOINT_THREAD_JOIN_S)
        release_process_groups()
        gc.collect()


def _set_timeouts(groups: list, seconds: float) -> None:
    """The timeout of every later collective of ``groups`` (a backend that cannot change its timeout keeps it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=seconds)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.10
    for group in groups:
        with contextlib.suppress(Exception):
            set_timeout(timeout, group)


def tcp_sockets() -> dict[int, tuple[int, int]]:
    """This process's TCP connections on Linux: file descriptor -> (local port, remote port); empty elsewhere.
    Listening sockets are left out (gloo's listener thread ends the process when its socket is shut down)."""
    inodes: dict[int, int] = {}
    try:
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    inodes[int(target[8:-1])] = int(name)
    except OSError:
        return {}
    out: dict[int, tuple[int, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            next(fh, None)
            for line in fh:
                fields = line.split()
                if len(fields) > 9 and int(fields[9]) in inodes and fields[3] != TCP_LISTEN:
                    local, remote = fields[1].rpartition(":")[2], fields[2].rpartition(":")[2]
                    out[inodes[int(fields[9])]] = (int(local, 16), int(remote, 16))
    return out


def job_sockets() -> list[int]:
    """The descriptors of the connections that outlive an attempt: to and from the job's store
    (``MASTER_PORT``) and to the launcher's heartbeat server (``MULA_HEARTBEAT``)."""
    ports = {int(os.environ.get("MASTER_PORT", "0") or 0)}
    ports.add(int(os.environ.get(HEARTBEAT_ENV, "").rpartition(":")[2] or 0))
    ports.discard(0)
    return [fd for fd, (local, remote) in tcp_sockets().items() if local in ports or remote in ports]


def cut_connections(keep: set[int]) -> int:
    """Shut down (both directions) every TCP connection of this process but ``keep`` (descriptors), without closing
    the descriptors, which their owners still hold and close; returns how many were cut."""
    cut = 0
    for fd in tcp_sockets():
        if fd in keep:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            finally:
                sock.detach()  # the descriptor stays its owner's
    return cut


_Result = TypeVar("_Result")


def run_in_job(stage: Callable[[list[str]], _Result], args: Sequence[str], saved: Callable[[], bool]) -> _Result:
    """Run ``stage(args)`` in the attempts of this job until it returns: after a peer's failure, leave the group,
    wait for the launcher's next attempt and run the stage again in it (``--ckpt_path last`` once ``saved()``); any
    other error propagates (after this process's groups and store are closed: an orderly exit)."""
    announcements = in_job_file()
    if announcements is None:
        return stage(list(args))
    timeout = in_job_timeout()
    group = RestartGroup(timeout)
    current = list(args)
    try:
        while True:
            attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
            group.join(attempt)
            group.watch(announcements, attempt)
            try:
                return stage(current)
            except BaseException as err:
                # a peer's failure, or any error once the launcher announced the attempt over (a collective that
                # timed out or failed in another way after the cut): this rank survives it
                if not (is_peer_failure(err) or (isinstance(err, Exception) and group.was_cut(attempt))):
                    raise
                failure = _first_line(err)
            finally:
                group.unwatch()
            # out of the handler: the exception, its traceback and the broken attempt's Trainer are released, so
            # that leave() can free the attempt's process groups
            _say(f"rank {group.rank}: a peer failed in attempt {attempt} ({failure}); this process stays")
            group.leave()
            nxt, replaced = announced_attempt(announcements, attempt, timeout)
            if group.rank in replaced:  # the launcher replaces this rank too (its node was taken out)
                raise RuntimeError(f"rank {group.rank} is replaced in attempt {nxt}: this process ends")
            _say(f"rank {group.rank}: rejoining as attempt {nxt} (ranks {replaced} replaced)")
            os.environ[ATTEMPT_ENV] = str(nxt)
            current = resume_args(args, saved())
    finally:
        group.close()


def run_loop_in_job(main: Callable[..., _Result], *args: Any, **kwargs: Any) -> _Result:
    """``main(*args, **kwargs)`` of a Fabric (or plain) training script, in the restart loop of :func:`run_in_job`
    under ``mula launch --in-job``: after a peer's failure this process leaves the broken attempt, waits for the
    launcher's next one and calls ``main`` again with the same arguments; without ``MULA_IN_JOB`` it is one call.

    What ``main`` must do (``examples/fabric_pretrain.py`` does all of it; docs/launch.md, "Fabric scripts"):
    build everything (``Fabric``, model, optimizer, loaders) inside the call; resume from its own newest complete
    checkpoint when there is one (:meth:`~mula_lightning.callbacks.DualCheckpoint.load_fabric`: a survivor and a
    replaced rank then start from the same slot, and a step after it is recomputed, never applied twice); report
    to the launcher (:class:`~mula_lightning.utils.launched_loop.LaunchedLoop`). The process group of each attempt
    is formed here before ``main`` runs: ``fabric.launch()`` finds it initialised and keeps it.
    """
    return run_in_job(lambda _args: main(*args, **kwargs), [], saved=lambda: False)


def _first_line(err: BaseException) -> str:
    text = " ".join(str(getattr(err, "original", err)).split())
    return text[:200]


def _say(text: str) -> None:
    print(f"mula fit: {text}", file=sys.stderr, flush=True)
