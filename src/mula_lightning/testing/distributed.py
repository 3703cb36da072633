"""Run a function on several real processes with ``torch.distributed`` and bring the results back.

Every multi-process test in the project goes through :func:`run_distributed_test`, so that process start-up,
rendezvous, simulated topologies, failure reporting and time-outs are written once.

How a run works:

1. The parent opens a ``TCPStore`` server on ``127.0.0.1`` with port 0, so the OS picks a free port and no other
   process can take it between choosing and binding (the classic "find a free port" race).
2. It starts ``world_size`` children from a fork server that imported torch and Lightning once (see
   :func:`~mula_lightning.testing.processes.start_context`; plain ``spawn`` where that is unavailable; both safe with
   threads and accelerators) and one watcher thread per child. Each child sets the launcher environment variables
   (``RANK``, ``LOCAL_RANK``, ...), connects to the store, initialises the default process group, calls
   ``fn(rank, world_size, **kwargs)``, destroys the group and sends the return value (or the traceback) back
   through a pipe.
3. The parent waits. A rank that raises makes the run fail with that rank's number and full traceback; the other
   ranks get a short grace period (they are usually stuck in a collective waiting for the failed peer) and are
   then killed. A rank that dies without raising (``os._exit``, a signal) is reported with its exit code. If the
   run is not finished after ``timeout`` seconds, every child is killed and a ``TimeoutError`` names the ranks
   that were still running.
4. Children never outlive the parent: each child watches its parent's sentinel and exits if the parent dies, and
   the parent kills whatever is left in a ``finally`` block.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from mula_lightning.testing.processes import (
    FAILURE_GRACE_S,
    DistributedTestError,
    child_env,
    exit_description,
    exit_when_parent_dies,
    first_failure_first,
    start_context,
)
from mula_lightning.utils.env_flags import env_flag

__all__ = ["DistributedTestError", "run_distributed_test", "run_pooled_test"]


@dataclass
class _Outcome:
    """What a watcher thread learned about its child."""

    status: str  # "running", then "ok", "error" (raised) or "died" (exited without a result)
    value: Any = None
    detail: str = ""
    finished_at: float = 0.0  # parent's monotonic clock: for the grace period
    reported_at: float = 0.0  # wall clock at which the child reported: for ordering failures


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    env: dict[str, str],
    timeout: float,
    kwargs: dict[str, Any],
    conn: Connection,
) -> None:
    """Entry point of one spawned rank; sends ``("ok", pickled value)`` or ``("error", text)`` through ``conn``.

    A failure is sent *before* the process group is destroyed: destroying it closes the sockets, which makes the
    peers fail with "connection closed", and the parent must see the root cause first.
    """
    exit_when_parent_dies()
    os.environ.update(env)
    dist = None
    try:
        import torch
        import torch.distributed as dist

        from mula_lightning.utils.device import device_for_local_rank

        torch.set_num_threads(1)
        if backend != "gloo":  # accelerator backends need the device chosen before the group exists
            device_type = {"nccl": "cuda", "xccl": "xpu"}.get(backend, "cpu")
            device = device_for_local_rank(int(env["LOCAL_RANK"]), int(env["MULA_RANKS_PER_GPU"]), device_type)
            getattr(torch, device.type).set_device(device)
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        value = fn(rank, world_size, **kwargs)
        message = ("ok", pickle.dumps(value), time.time())
        if dist.is_initialized():  # ``fn`` may have ended the groups itself (a finished ``mula fit`` does)
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything, including SystemExit, must reach the parent
        message = ("error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", time.time())
    try:
        conn.send(message)
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
    if message[0] == "error":
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)


def _watch(proc: Any, conn: Connection, outcome: _Outcome, done: threading.Condition) -> None:
    """Watcher thread: wait for the child's message or its death, whichever comes first, then record it."""
    ready = wait([conn, proc.sentinel])
    message = None
    if conn in ready or conn.poll():
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
    finished_at = time.monotonic()  # when the rank reported (or died), not when it finished cleaning up
    # Order failures by when the child sent them (same machine, same clock), not by when this thread woke up.
    reported_at = message[2] if message is not None else time.time()
    if message is None:
        proc.join()  # it has exited (the sentinel fired or the pipe hit EOF): this only collects the exit code
    status, value, detail = "died", None, f"{exit_description(proc.exitcode)} without reporting a result"
    if message is not None and message[0] == "ok":
        try:
            # Safe here: the bytes come through a pipe from a child this process started running the test's own
            # function, never from a file or another user (checkpoints are read by mula_lightning.utils.safe_load).
            status, value, detail = "ok", pickle.loads(message[1]), ""
        except Exception as exc:  # a value that pickles there but cannot be rebuilt here
            status, detail = "error", f"its return value could not be unpickled: {exc!r}"
    elif message is not None:
        status, detail = "error", message[1]
    with done:  # publish all fields at once: the main thread reads them under this lock
        outcome.status, outcome.value, outcome.detail = status, value, detail
        outcome.finished_at, outcome.reported_at = finished_at, reported_at
        done.notify_all()


def _stop(procs: list[Any], patience: float) -> None:
    """Let children exit on their own for up to ``patience`` seconds, then terminate, then kill what is left."""
    deadline = time.monotonic() + patience
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _check_picklable(fn: Callable[..., Any]) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"run_distributed_test needs a module-level function (spawned processes import it by name); "
            f"got {qualname!r}"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"run_distributed_test cannot pickle {fn!r}: {exc}") from exc


def run_distributed_test(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    ranks_per_node: int | None = None,
    ranks_per_gpu: int | None = None,
    timeout: float = 120.0,
    pool: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes with an initialised process group.

    ``fn`` must be a module-level function (not a lambda, closure or method): spawned children are fresh
    interpreters that import it by its qualified name (in a script, call this under
    ``if __name__ == "__main__":``, since each child re-imports the main module). ``kwargs`` and the return values
    must be picklable.
    Inside ``fn`` the default process group is ready (``torch.distributed`` calls work), each child uses one
    CPU thread, and these variables are set: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (= ``NODE_RANK``), ``MASTER_ADDR``, ``MASTER_PORT``, ``MULA_NODE_NAME`` (``node0``, ...),
    ``MULA_RANKS_PER_NODE`` and ``MULA_RANKS_PER_GPU``.

    Args:
        fn: module-level function ``fn(rank, world_size, **kwargs)``.
        world_size: number of processes.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (CUDA) or ``"xccl"`` (XPU); accelerator backends pin each rank to
            device ``LOCAL_RANK // ranks_per_gpu``.
        ranks_per_node: simulate nodes of this many consecutive ranks (default: one node holding every rank).
        ranks_per_gpu: simulate this many consecutive ranks per GPU (default 1), e.g. 2 for the two GCDs of an
            MI250X or the two tiles of an Intel Max GPU; only sets ``MULA_RANKS_PER_GPU`` on gloo.
        timeout: seconds the whole run may take, including start-up; also the collectives' own time-out.
        pool: run on the pooled workers of :mod:`mula_lightning.testing.pool` (started once per layout and reused:
            no process start, import or rendezvous per test) instead of fresh processes; gloo only; for functions
            that leave their process as they found it (see that module). ``MULA_TEST_POOL=0`` turns pooling off.
        **kwargs: passed to ``fn`` on every rank.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        ValueError: for a world size or topology that does not divide, or an ``fn`` that cannot be pickled.
        DistributedTestError: when a rank raised (message: its rank and traceback) or died without a result
            (message: its exit code).
        TimeoutError: when some ranks had not finished after ``timeout`` seconds (message: those ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    ranks_per_gpu = 1 if ranks_per_gpu is None else ranks_per_gpu
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide world_size ({world_size})")
    if ranks_per_gpu < 1 or ranks_per_node % ranks_per_gpu:
        raise ValueError(f"ranks_per_gpu ({ranks_per_gpu}) must divide ranks_per_node ({ranks_per_node})")
    _check_picklable(fn)
    if pool and backend == "gloo" and env_flag("MULA_TEST_POOL", True):
        from mula_lightning.testing.pool import run_on_pool

        return run_on_pool(fn, world_size, ranks_per_node, ranks_per_gpu, timeout, kwargs)

    import torch.distributed as dist

    host = "127.0.0.1"
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = start_context()
    done = threading.Condition()
    procs, outcomes, threads = [], [_Outcome(status="running") for _ in range(world_size)], []
    succeeded = False
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            env = child_env(rank, world_size, ranks_per_node, ranks_per_gpu, host, store.port)
            proc = ctx.Process(
                target=_child_main,
                args=(fn, rank, world_size, backend, env, timeout, kwargs, send_end),
                name=f"mula-rank{rank}",
                daemon=True,
            )
            proc.start()
            send_end.close()  # the child holds the only write end, so its death reads as EOF here
            procs.append(proc)
            thread = threading.Thread(target=_watch, args=(proc, recv_end, outcomes[rank], done), daemon=True)
            thread.start()
            threads.append(thread)
        _wait_for_ranks(outcomes, done, timeout)
        succeeded = True
    finally:
        # After a success the children are only tearing down; after a failure or a timeout they may be stuck.
        _stop(procs, patience=5.0 if succeeded else 0.0)
        for thread in threads:
            thread.join(5.0)
        del store
    return [outcome.value for outcome in outcomes]


def _wait_for_ranks(outcomes: list[_Outcome], done: threading.Condition, timeout: float) -> None:
    """Block until every rank finished, one failed (plus a grace period), or the timeout passed; raise on failure."""
    deadline = time.monotonic() + timeout
    with done:
        while True:
            running = [r for r, o in enumerate(outcomes) if o.status == "running"]
            failed = [r for r, o in enumerate(outcomes) if o.status in ("error", "died")]
            if not running:
                break
            if failed:
                first_failure = min(outcomes[r].finished_at for r in failed)
                limit = min(deadline, first_failure + FAILURE_GRACE_S)
            else:
                limit = deadline
            now = time.monotonic()
            if now >= limit:
                break
            done.wait(limit - now)
        # Snapshot under the lock: watcher threads may still be writing after the children get killed.
        running = [r for r, o in enumerate(outcomes) if o.status == "running"]
        failed = first_failure_first(
            {r: (o.status, o.detail, o.reported_at) for r, o in enumerate(outcomes) if o.status in ("error", "died")}
        )
        details = {r: outcomes[r].detail for r in failed}
        raised = {r for r in failed if outcomes[r].status == "error"}
    if failed:
        parts = [f"--- rank {r} {'raised' if r in raised else 'died'} ---\n{details[r]}" for r in failed]
        still = f"; ranks {running} were still running and were killed" if running else ""
        raise DistributedTestError(
            f"rank {failed[0]} failed (failed ranks, first failure first: {failed}{still})\n\n" + "\n\n".join(parts),
            details,
        )
    if running:
        raise TimeoutError(
            f"run_distributed_test timed out after {timeout:g} s: ranks {running} of {len(outcomes)} had not "
            f"finished and were killed"
        )


def run_pooled_test(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> list[Any]:
    """:func:`run_distributed_test` on the pooled workers (``pool=True``): for test modules whose rank functions
    leave their process as they found it (see :mod:`mula_lightning.testing.pool`)."""
    return run_distributed_test(fn, world_size, pool=True, **kwargs)
