"""The launcher's end of the heartbeat: a small TCP server that keeps the newest record of every rank.

Why not ``torch.distributed.TCPStore`` (what the launcher used before): the launcher and the ranks' heartbeat client
only exchange "the newest record of rank R in attempt A"; a store server costs every ``mula launch`` (and every
process that only beats) the import of torch, about a second and a half of CPU per process, and its native client
inside a daemon thread could abort an interpreter at shutdown. The protocol (:mod:`mula_lightning.utils.launch_env`)
is one line per record over one persistent connection per rank, acknowledged with ``ok``:

    MHB1 hb/<attempt>/<rank> {"step": 12, "phase": "train", ...}\\n   ->   ok\\n

One thread serves every connection with a selector (epoll on Linux): thousands of ranks that each send a record per
optimizer step are a few thousand small reads per second. A line that is not a record (another program on the port,
a truncated or oversized line) closes that connection and is counted, never stored. ``read`` never blocks on the
network: it copies what the server thread has stored.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Any

from mula_lightning.utils.launch_env import HEARTBEAT_ACK, HEARTBEAT_MAX_LINE, heartbeat_key, parse_heartbeat_line

__all__ = ["HeartbeatServer"]


class HeartbeatServer:
    """Listens on ``0.0.0.0:port`` (0: a free port) and keeps the newest record per (attempt, rank).

    Args:
        host: the address the ranks reach this machine at (``--heartbeat-host``; default 127.0.0.1), put in
            :attr:`address` for ``MULA_HEARTBEAT``.
        port: the port to listen on (0: one the OS picks, so no other process can take it between choosing and
            binding).
    """

    def __init__(self, host: str = "", port: int = 0) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("0.0.0.0", port))
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"{host or '127.0.0.1'}:{self.port}"
        self.rejected = 0  # connections closed for a line that was not a record
        self._records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._buffers: dict[socket.socket, bytearray] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mula-heartbeat-server", daemon=True)
        self._thread.start()

    def read(self, attempt: int, world_size: int) -> dict[int, dict[str, Any]]:
        """The newest record of every rank of ``attempt`` that has sent one (a copy; never waits for a rank)."""
        with self._lock:
            found = {rank: self._records.get(heartbeat_key(attempt, rank)) for rank in range(world_size)}
        return {rank: dict(record) for rank, record in found.items() if record is not None}

    def close(self) -> None:
        """Stop serving and close every connection (the ranks' clients back off and retry: no rank fails)."""
        if self._closed:
            return
        self._closed = True
        # the serving thread may already have seen _closed at its 1 s select timeout and closed the other end: the
        # wake-up is then unneeded and its send fails (EPIPE), which must not fail the launcher's shutdown
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        self._wake_w.close()

    def __enter__(self) -> HeartbeatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(timeout=1.0):
                    if key.data == "wake":
                        break
                    if key.data is None:
                        self._accept()
                    else:
                        self._receive(key.fileobj)  # type: ignore[arg-type]
        finally:
            for conn in list(self._buffers):
                self._drop(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, for example: the rank's client retries after its backoff
                return
            conn.setblocking(False)
            self._buffers[conn] = bytearray()
            self._selector.register(conn, selectors.EVENT_READ, "conn")

    def _receive(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the rank closed its connection (it ended, or its client reconnects)
            self._drop(conn)
            return
        buffer = self._buffers[conn]
        buffer += data
        acks = 0
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            parsed = parse_heartbeat_line(line)
            if parsed is None:
                self.rejected += 1
                self._drop(conn)
                return
            key, record = parsed
            with self._lock:
                self._records[key] = record
            acks += 1
        if len(buffer) > HEARTBEAT_MAX_LINE:
            self.rejected += 1
            self._drop(conn)
            return
        if acks:
            try:
                conn.sendall(HEARTBEAT_ACK * acks)  # a few bytes into an empty socket buffer: never blocks long
            except OSError:
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._buffers.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()
