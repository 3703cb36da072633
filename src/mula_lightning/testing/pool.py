"""A pool of distributed workers for ``run_distributed_test(..., pool=True)``: start once, run many tests.

Why: a multi-process test spends most of its wall time before its first collective: a process per rank, the
imports of Lightning and this package (seconds of CPU each, on 2 cores), the rendezvous. torch's own suites keep
their ranks alive between tests (``MultiProcContinuousTest``); this pool does the same for the tests that opt in.

How it works:

* One :class:`WorkerGroup` per ``(world_size, ranks_per_node, ranks_per_gpu)``, started on first use: ``world_size``
  processes from the same fork server as :func:`~mula_lightning.testing.distributed.run_distributed_test`, with
  the same environment variables, each with the default gloo process group initialised once.
* A test sends each worker the function and its arguments as bytes, with the parent's ``sys.path`` (test modules
  imported after the pool started are found); each worker calls ``fn(rank, world_size, **kwargs)`` and sends back
  the pickled value or the traceback, exactly as a fresh rank would.
* Between tests each worker puts back what a fresh process would have: the environment, the working directory, the
  default dtype, grad mode, one CPU thread and torch's default seed (so ranks start with equal RNG states), and
  checks that its process group still works (a barrier). A test that raised, hung, died or broke its group stops the
  whole group (its peers may be stuck in a collective); the next test starts a fresh one. So does a worker whose
  threads grew past :data:`MAX_WORKER_THREADS` (the process groups tests leave behind: see :func:`_thread_count`).
  The failure itself is reported like :func:`run_distributed_test` reports it: the rank, its traceback or exit code,
  or the time-out.

What may not use the pool: tests that kill or stop their ranks, that need variables set before the process starts,
that create their own default process group (a Lightning strategy started in a fresh process does), that start
``mula`` subprocesses, or that patch module globals without putting them back.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import sys
import threading
import time
import traceback
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

__all__ = ["WorkerGroup", "close_pools", "run_on_pool"]

# torch's CPU generator in a fresh process is seeded with this constant: every test starts from that state
_TORCH_DEFAULT_SEED = 67280421310721


def _reset_process(env: dict[str, str], cwd: str) -> None:
    """What a fresh rank would have: environment, working directory, dtype, grad mode, threads, RNG."""
    import torch

    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.manual_seed(_TORCH_DEFAULT_SEED)


#: a worker holding more threads than this after a test is replaced by a fresh one (see :func:`_thread_count`)
MAX_WORKER_THREADS = 150


def _thread_count() -> int:
    """This process's threads (0 where ``/proc`` does not list them).

    Why: every process group a test creates stays alive in a worker (destroying them is not safe: DTensor's
    sharding caches keep meshes equal to the next test's, whose groups would be the destroyed ones), and each gloo
    group keeps a TCP loop thread that wakes every 10 ms. A worker that had run the loop tester's programs held 322
    such loops (966 threads) and spent a fifth of a core idle: every pooled group slowed the rest of the suite, more
    with every test. Past :data:`MAX_WORKER_THREADS` the group is stopped and the next test starts a fresh one.
    """
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _worker_main(rank: int, world_size: int, env: dict[str, str], timeout: float, conn: Connection) -> None:
    """One pooled rank: initialise the group once, then run ``("run", sys.path, payload)`` messages until told to
    stop (or the parent goes away)."""
    exit_when_parent_dies()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    baseline_env, cwd = dict(os.environ), os.getcwd()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] != "run":
            break
        _, path, payload = message
        sys.path[:] = path
        _reset_process(baseline_env, cwd)
        try:
            fn, kwargs = pickle.loads(payload)
            value = fn(rank, world_size, **kwargs)
            reply: tuple[Any, ...] = ("ok", pickle.dumps(value), time.time())
        except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
            reply = ("error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", time.time())
        conn.send(reply)  # first the result: a peer that hangs must not delay it
        healthy = reply[0] == "ok" and dist.is_initialized() and _thread_count() <= MAX_WORKER_THREADS
        if healthy:
            try:
                dist.barrier()  # the group still works: the next test can use it
            except Exception:  # noqa: BLE001
                healthy = False
        conn.send(("health", healthy))
        if not healthy:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerGroup:
    """``world_size`` pooled ranks with an initialised gloo group (see the module docstring)."""

    def __init__(self, world_size: int, ranks_per_node: int, ranks_per_gpu: int, timeout: float = 120.0) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.broken = False
        host = "127.0.0.1"
        self._store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
        ctx = start_context()
        self.procs, self.conns = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            env = child_env(rank, world_size, ranks_per_node, ranks_per_gpu, host, self._store.port)
            proc = ctx.Process(
                target=_worker_main, args=(rank, world_size, env, timeout, child_end), name=f"mula-pool{rank}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)

    def run(self, fn: Any, timeout: float, kwargs: dict[str, Any]) -> list[Any]:
        """``fn(rank, world_size, **kwargs)`` on every worker; the values in rank order, or the failure raised as
        :func:`run_distributed_test` raises it (the group is then stopped)."""
        payload = pickle.dumps((fn, kwargs))
        for conn in self.conns:
            conn.send(("run", list(sys.path), payload))
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any, float]] = {}
        first_failure: float | None = None
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending:
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
            left = limit - time.monotonic()
            if left <= 0:
                break
            live = [s for s, r in sentinels.items() if self.conns[r] in pending]
            ready = wait([*pending, *live], timeout=left)
            seen_at = time.time()  # a death is dated when first seen: before the errors it causes in its peers
            for item in ready:
                rank = pending[item] if item in pending else sentinels[item]
                conn = self.conns[rank]
                if conn not in pending:
                    continue
                message = None
                try:
                    if conn.poll():
                        message = conn.recv()
                except (EOFError, OSError):  # the pipe's write end died with the worker
                    message = None
                else:
                    if message is None and item is conn:
                        continue  # readable without a whole message yet
                if message is None:
                    self.procs[rank].join(1.0)
                    detail = f"{exit_description(self.procs[rank].exitcode)} without reporting a result"
                    message = ("died", detail, seen_at)
                del pending[conn]
                results[rank] = message
                if message[0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
        failed = first_failure_first({r: m for r, m in results.items() if m[0] != "ok"})
        running = sorted(pending.values())
        if failed or running or not self._healthy():
            self.close(kill=True)
        if failed:
            parts = [
                f"--- rank {r} {'raised' if results[r][0] == 'error' else 'died'} ---\n{results[r][1]}" for r in failed
            ]
            still = f"; ranks {running} were still running and were killed" if running else ""
            raise DistributedTestError(
                f"rank {failed[0]} failed (failed ranks, first failure first: {failed}{still})\n\n"
                + "\n\n".join(parts),
                {r: results[r][1] for r in failed},
            )
        if running:
            raise TimeoutError(
                f"run_distributed_test(pool=True) timed out after {timeout:g} s: ranks {running} of {self.world_size} "
                "had not finished and were killed"
            )
        # Safe here: the bytes come through a pipe from a worker this process started running the test's own
        # function, never from a file or another user.
        return [pickle.loads(results[r][1]) for r in range(self.world_size)]

    def _healthy(self, timeout: float = 30.0) -> bool:
        """Every worker's check after a successful test: its group still works (a barrier), within ``timeout``."""
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not conn.poll(left) or conn.recv() != ("health", True):
                    return False
            except (EOFError, OSError):
                return False
        return True

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``); the group can no longer be used."""
        self.broken = True
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("stop",))
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self.conns:
            conn.close()


_GROUPS: dict[tuple[int, int, int], WorkerGroup] = {}  # in order of last use
_LOCK = threading.Lock()
#: groups kept alive at once (each worker holds torch, Lightning and the package: a few hundred MB)
MAX_GROUPS = 3


def run_on_pool(
    fn: Any, world_size: int, ranks_per_node: int, ranks_per_gpu: int, timeout: float, kwargs: dict[str, Any]
) -> list[Any]:
    """Run ``fn`` on the pooled group of this layout, starting (or restarting) it when needed."""
    key = (world_size, ranks_per_node, ranks_per_gpu)
    with _LOCK:
        group = _GROUPS.get(key)
        if group is None or group.broken or not all(p.is_alive() for p in group.procs):
            if group is not None:
                group.close(kill=True)
            group = WorkerGroup(world_size, ranks_per_node, ranks_per_gpu, timeout)
        _GROUPS.pop(key, None)
        _GROUPS[key] = group
        while len(_GROUPS) > MAX_GROUPS:
            _GROUPS.pop(next(iter(_GROUPS))).close()
    return group.run(fn, timeout, kwargs)


def close_pools() -> None:
    """Stop every pooled group (at exit, or for a test that needs the CPUs to itself)."""
    with _LOCK:
        for group in _GROUPS.values():
            group.close()
        _GROUPS.clear()


atexit.register(close_pools)
