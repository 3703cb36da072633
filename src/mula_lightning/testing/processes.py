"""What a fresh rank and a pooled rank share: the launcher variables, the fork server, the parent watch, and how a
failure is named. A leaf of :mod:`mula_lightning.testing` (imported by ``distributed`` and ``pool``, importing
neither)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
from multiprocessing import get_context, parent_process
from multiprocessing.connection import wait

__all__ = [
    "FAILURE_GRACE_S",
    "DistributedTestError",
    "child_env",
    "exit_description",
    "exit_when_parent_dies",
    "first_failure_first",
    "start_context",
]

# After the first failing rank, how long the others may take to finish (or fail) before they are killed. Peers of a
# failed rank normally block in a collective, so waiting for the full timeout would only slow the test down.
FAILURE_GRACE_S = 2.0


class DistributedTestError(RuntimeError):
    """One or more ranks of :func:`run_distributed_test` failed; the message has each rank's traceback.

    Attributes:
        failures: ``{rank: description}`` for every rank that failed, the first failure first.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


#: what a rank's error says when a peer's process went away under a collective (gloo's TCP pairs, NCCL / XCCL)
_LOST_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|remote process exited", re.I)


def first_failure_first(failures: dict[int, tuple[str, str, float]]) -> list[int]:
    """The failed ranks (``{rank: (status, detail, when)}``, status ``"error"`` or ``"died"``), the cause first.

    By time, except that a rank whose error says a peer's connection was lost comes after the ranks that died: the
    death caused it, but the parent sees a death only when its wait wakes for it, which can be after the peer's
    error report arrived (a death cannot be dated more precisely from outside)."""
    died = any(status == "died" for status, _, _ in failures.values())

    def key(rank: int) -> tuple[bool, float]:
        status, detail, when = failures[rank]
        consequence = died and status == "error" and bool(_LOST_PEER.search(detail))
        return consequence, when

    return sorted(failures, key=key)


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def child_env(
    rank: int, world_size: int, ranks_per_node: int, ranks_per_gpu: int, host: str, port: int
) -> dict[str, str]:
    """The variables a real launcher (torchrun, SLURM + Lightning) would set, for one simulated rank."""
    node = rank // ranks_per_node
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "MULA_NODE_NAME": f"node{node}",
        "MULA_RANKS_PER_NODE": str(ranks_per_node),
        "MULA_RANKS_PER_GPU": str(ranks_per_gpu),
        # The parent owns the store server: code that initialises a group from env:// must connect as a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }
    # Keep gloo's sockets on loopback: the host name may resolve to an interface that is not reachable.
    if "GLOO_SOCKET_IFNAME" not in os.environ and sys.platform.startswith("linux"):
        if any(name == "lo" for _, name in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def exit_when_parent_dies() -> None:
    """Daemon thread in the child: leave at once if the parent process disappears (no orphans)."""
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_context():
    """The multiprocessing context for ranks: a fork server with torch already imported, else ``spawn``.

    Every child of a fork server starts as a copy of one fresh process that imported torch and Lightning once (no
    threads, no accelerator context, no process group), so starting 8 ranks costs milliseconds instead of 8
    interpreter + torch + Lightning imports (about 4 s of CPU each), with the isolation of ``spawn``.
    ``MULA_TEST_START_METHOD=spawn`` forces plain spawn.
    """
    method = os.environ.get("MULA_TEST_START_METHOD", "forkserver")
    if method == "forkserver" and sys.platform != "win32":
        ctx = get_context("forkserver")
        # not this package: preloading it would pin it to the path it had when the server started (a worktree or
        # another checkout would then run the wrong copy); children import it after their sys.path is set.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning"])
        return ctx
    return get_context("spawn")
