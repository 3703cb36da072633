"""The job's ``TCPStore``, hosted beside the launcher for ``mula launch --in-job`` (as torchrun's agent hosts it).

Why: an in-job restart re-forms each attempt's process group on one store for the whole job (a prefix per attempt,
:mod:`mula_lightning.utils.in_job_restart`). When rank 0's process hosted it, rank 0 could never be restarted in-job:
its death took the store with it, so a fault of rank 0 or of its node (a quarter of the faults on 4 nodes, all of them
on one) fell back to a full relaunch. Hosted by a small process of the launcher's instead, the store outlives every
rank, and rank 0 is replaced like any other.

Why a process of its own: the launcher does not import torch (it starts in a fraction of a second and stays small);
this module's :func:`main` does, in a process of its own (:data:`SERVE`). It binds the port it is given
on the given host, writes ``ready PORT`` on its standard output and serves until its standard input ends (the
launcher closed it, or died): it never outlives the launch. Losing it (the process killed) is a store loss: the
launcher sees it end (:meth:`StoreHost.failure`), stops every rank (a group formed later, or the next restart,
would need it) and relaunches the job on a new store (:meth:`StoreHost.ensure`).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["StoreHost", "main"]

#: the store process's program (not ``-m``: the launcher's package imports this module, and runpy warns then)
SERVE = "import sys; from mula_lightning.launch.store_host import main; sys.exit(main(sys.argv[1:]))"
#: seconds the launcher waits for the store to listen (torch's import is most of it)
START_TIMEOUT_S = 120.0


class StoreHost:
    """The launcher's handle on the store process (torch-free): :meth:`ensure` before each attempt starts its ranks
    (it returns at once: the store imports torch while the ranks do, and their store clients retry their connection),
    :meth:`failure` while the attempt runs, :meth:`close` at the end (or the context manager)."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = START_TIMEOUT_S) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts = 0  # how many store processes were started (more than 1: a store was lost)
        self._ready = threading.Event()
        self._said: list[bytes] = []  # its output up to "ready PORT" (interpreter warnings may come first)
        self._started_at = 0.0

    def __enter__(self) -> StoreHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self, env: dict[str, str] | None = None) -> int:
        """The port of a live store: the running one, else a new one's, on a free port (started with ``env``: the
        launch's id in it lets a check for leftover processes find the store too)."""
        if self.alive():
            assert self.port is not None
            return self.port
        self.close()
        from mula_lightning.launch.backends import free_port

        self.port = free_port()
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "--host", self.host, "--port", str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C of the launcher's terminal is the launcher's to handle
        )
        self.starts += 1
        self._started_at = time.monotonic()
        ready, said = threading.Event(), []
        self._ready, self._said = ready, said

        def read() -> None:
            assert proc.stdout is not None
            for line in iter(proc.stdout.readline, b""):
                said.append(line)
                if line.split()[:1] == [b"ready"]:
                    ready.set()
                    return

        threading.Thread(target=read, name="mula-store-output", daemon=True).start()
        return self.port

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Whether the store listens, waiting at most ``timeout_s`` (default: its start timeout; no longer once its
        process ended)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not self._ready.wait(0.1):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                return self._ready.is_set()
        return True

    def failure(self) -> str | None:
        """Why the store cannot serve the job (it ended, or it did not listen within its start timeout, with what it
        said), None while it serves or may still start."""
        if self.proc is None:
            return None
        ended = self.proc.poll() is not None
        late = not self._ready.is_set() and time.monotonic() - self._started_at > self.timeout_s
        if not (ended or late):
            return None
        text = " ".join(b"".join(self._said).decode(errors="replace").split())[-500:] or "nothing"
        what = f"ended (exit {self.proc.returncode})" if ended else f"did not listen within {self.timeout_s:g} s"
        return f"the job's store on {self.host}:{self.port} {what}; it said: {text}"

    def close(self) -> None:
        """End the store: its input is closed (it exits), killed if it does not within 5 s."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mula_lightning.launch.store_host")
    parser.add_argument("--host", default="127.0.0.1", help="the address the ranks reach the store at")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    args = parser.parse_args(argv)
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        args.host, args.port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    print(f"ready {store.port}", flush=True)
    sys.stdin.buffer.read()  # until the launcher closes our input (or ends)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
