"""What ``mula launch`` and its ranks agree on: environment variables, node names and the heartbeat record.

Why a leaf module: the launcher, the callbacks of the ranks (``Heartbeat``, ``FaultInjector``, ``NaNDetector``) and
plain scripts (a Fabric loop, a test's fake rank) all speak this protocol; none of them should have to import
Lightning to do so (a rank that only beats pays for ``torch.distributed``, not for Lightning).

The heartbeat: the launcher runs a small TCP server (:class:`~mula_lightning.launch.heartbeat_server.HeartbeatServer`)
and gives its ``host:port`` to every rank in ``MULA_HEARTBEAT``; a rank sends one JSON record under
``hb/<attempt>/<rank>``: ``step`` (optimizer steps done), ``phase`` (``setup``: the process group is formed and no
checkpoint loaded yet; ``start``, ``train``, ``validation``, ``end``; the first ``setup`` and ``start`` times stay in
every later record as ``setup_time`` and ``start_time``, since the server keeps only a rank's newest record),
``host``, ``pid``, ``seq`` (a counter, so that every beat changes the record) and ``time`` (the rank's clock; the
launcher measures silence on its own clock). On the wire one line per record, ``MHB1 <key> <JSON>``, answered with
``ok``: plain sockets, so that neither the launcher nor a process that only beats imports torch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTEMPT_ENV",
    "FAILED_HOSTS_ENV",
    "NAN_EVENTS_ENV",
    "FAULT_ENV",
    "FAULT_KINDS",
    "HEARTBEAT_ACK",
    "HEARTBEAT_ENV",
    "HEARTBEAT_MAGIC",
    "HEARTBEAT_MAX_LINE",
    "IN_JOB_ENV",
    "IN_JOB_OP_TIMEOUT_ENV",
    "IN_JOB_TIMEOUT_ENV",
    "HOSTED_STORE_ENV",
    "LAUNCH_ID_ENV",
    "LAUNCH_STARTED_ENV",
    "NAN_EXIT_CODE",
    "STUCK_EXIT_CODE",
    "NODE_NAME_ENV",
    "STRAGGLERS_ENV",
    "Fault",
    "HeartbeatClient",
    "NanRecord",
    "heartbeat_key",
    "heartbeat_line",
    "host_name",
    "parse_faults",
    "parse_heartbeat_line",
    "parse_nan_line",
    "resume_from_last",
]

#: ``host:port`` of the launcher's heartbeat server
HEARTBEAT_ENV = "MULA_HEARTBEAT"
#: the first word of every heartbeat line (the protocol's name and version)
HEARTBEAT_MAGIC = b"MHB1"
#: the server's answer to each record line it stored
HEARTBEAT_ACK = b"ok\n"
#: the longest line a server accepts (a record is a few hundred bytes)
HEARTBEAT_MAX_LINE = 65536
#: the attempt number the launcher gives each attempt (0 for the first)
ATTEMPT_ENV = "MULA_LAUNCH_ATTEMPT"
#: the launcher's file of NaN events (NaNDetector appends one JSON record per blamed host: :class:`NanRecord`)
NAN_EVENTS_ENV = "MULA_NAN_EVENTS_FILE"
#: kept for code that still reads it: the launcher's failed-hosts file (a host list, one name per line)
FAILED_HOSTS_ENV = "MULA_FAILED_HOSTS_FILE"
#: one id per launch, in every rank's environment (finds the processes of a launch)
LAUNCH_ID_ENV = "MULA_LAUNCH_ID"
#: when the launch began (Unix time, the launcher's clock): a checkpoint slot marked after it was saved by this launch
LAUNCH_STARTED_ENV = "MULA_LAUNCH_STARTED"
#: where rank 0 of StragglerDetection appends its reports (``mula launch``: ``<report dir>/stragglers.jsonl``)
STRAGGLERS_ENV = "MULA_STRAGGLERS_FILE"
#: injected faults for drills and tests: ``kill@step=5,node=node1;...`` (see :func:`parse_faults`)
FAULT_ENV = "MULA_FAULT"
#: exit code of every rank after NaNDetector found a non-finite loss or gradient (distinct from 1, signals and
#: SLURM's codes): a soft node failure
NAN_EXIT_CODE = 86
#: exit code of a rank that could not leave a broken attempt in an in-job restart (its main thread stayed blocked
#: after its connections were cut): the launcher starts a new process for it in the attempt it was to rejoin
STUCK_EXIT_CODE = 75
#: set by ``mula launch --in-job``: the file where the launcher announces each in-job restart (JSON: ``attempt``,
#: ``replaced_ranks``); ``mula fit`` then forms its process group itself and, when a peer fails, stays alive and
#: rejoins the attempt announced there (:mod:`mula_lightning.utils.in_job_restart`)
IN_JOB_ENV = "MULA_IN_JOB"
#: "1" when the job's store at ``MASTER_ADDR:MASTER_PORT`` is hosted by the launcher
#: (:mod:`mula_lightning.launch.store_host`): every rank, rank 0 included, connects to it as a client; unset, rank 0
#: hosts it in its own process
HOSTED_STORE_ENV = "MULA_STORE_HOSTED"
#: seconds a rank that left a broken attempt waits for the next one's announcement and for its peers
IN_JOB_TIMEOUT_ENV = "MULA_IN_JOB_TIMEOUT"
#: seconds after which a collective of an in-job attempt fails (``mula launch --collective-timeout``; unset: the
#: rejoin wait, ``MULA_IN_JOB_TIMEOUT``)
IN_JOB_OP_TIMEOUT_ENV = "MULA_IN_JOB_OP_TIMEOUT"
#: the node's name for simulated nodes (the local backend, the tests); the host name otherwise
NODE_NAME_ENV = "MULA_NODE_NAME"

log = logging.getLogger(__name__)


def host_name() -> str:
    """The node name used in reports and blame: ``MULA_NODE_NAME`` (simulated nodes, launchers), else SLURM's name
    of the node (``SLURMD_NODENAME``, the name the launcher's node pool and ``--nodelist`` use, which often differs
    from ``gethostname()``: ``nid001234`` vs ``nid001234.hsn.cluster``), else the hostname."""
    return os.environ.get(NODE_NAME_ENV) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def resume_from_last(args: list[str]) -> list[str]:
    """``args`` of ``mula fit`` with any ``--ckpt_path`` (both spellings) replaced by ``--ckpt_path last``: what a
    relaunch and an in-job restart run once this launch saved a slot (the newest valid slot, not the user's start
    point)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return [*kept, "--ckpt_path", "last"]


def heartbeat_key(attempt: int, rank: int) -> str:
    """The key of one rank's record in one attempt (attempts never read each other's records)."""
    return f"hb/{attempt}/{rank}"


def heartbeat_line(key: str, record_json: str) -> bytes:
    """One record on the wire: ``MHB1 <key> <JSON>`` and a newline (``json.dumps`` never writes a newline)."""
    return b" ".join((HEARTBEAT_MAGIC, key.encode(), record_json.encode())) + b"\n"


def parse_heartbeat_line(line: bytes) -> tuple[str, dict[str, Any]] | None:
    """``(key, record)`` of a heartbeat line (without its newline); None for anything else: another protocol, a
    key that is not ``hb/<attempt>/<rank>``, a record that is not a JSON object."""
    magic, _, rest = line.partition(b" ")
    key, _, payload = rest.partition(b" ")
    if magic != HEARTBEAT_MAGIC:
        return None
    try:
        prefix, attempt, rank = key.decode("ascii").split("/")
        record = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        return None
    if prefix != "hb" or not attempt.isdigit() or not rank.isdigit() or not isinstance(record, dict):
        return None
    return heartbeat_key(int(attempt), int(rank)), record


class HeartbeatClient:
    """Writes this rank's heartbeat records; does nothing without an address (``MULA_HEARTBEAT`` unset).

    A beat never blocks the caller: it leaves the newest record for a sender thread, which connects, writes and, on
    a server error (the launcher restarted, a network blip), drops the connection, waits (1 s, doubled per
    failure up to 60 s) and tries again with the newest record then. A training step therefore never waits for the
    server, and beats resume by themselves when it answers again. Only changed records are sent, so a rank whose
    training loop stops (a hang) falls silent for the launcher even though its sender thread lives on.

    Args:
        address: ``host:port`` of the launcher's heartbeat server (default: ``MULA_HEARTBEAT``).
        connect_timeout_s: how long to wait for the server when connecting, and for each acknowledgement.
    """

    #: seconds before the first retry after a server error; doubled per failure up to :attr:`MAX_BACKOFF_S`
    FIRST_BACKOFF_S = 1.0
    MAX_BACKOFF_S = 60.0

    def __init__(self, address: str | None = None, connect_timeout_s: float = 60.0) -> None:
        self.address = address if address is not None else os.environ.get(HEARTBEAT_ENV, "")
        self.connect_timeout_s = connect_timeout_s
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        self._conn: socket.socket | None = None
        self._seq = 0
        self._backoff = 0.0
        self._cond = threading.Condition()
        self._pending: tuple[str, str] | None = None  # the newest record not yet written: (key, JSON)
        self._busy = False  # the sender is writing a record
        self._sender: threading.Thread | None = None
        self._closed = False
        self._saved = False  # a checkpoint was saved by this process
        self._resumed_from: int | None = None  # the step of this process's first beat (after any resume)
        self._first_train_time: float | None = None  # when its first training step ended
        self._phase_times: dict[str, float] = {}  # when it first reported "setup" and "start" (sticky)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def _connect(self) -> socket.socket:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{HEARTBEAT_ENV}={self.address!r}: expected host:port")
        # the timeout also bounds each send and acknowledgement: a server that stops answering is an error
        return socket.create_connection((host.strip("[]"), int(port)), timeout=self.connect_timeout_s)

    def beat(self, step: int, phase: str = "train", rank: int | None = None, saved: bool = False) -> None:
        """Hand this rank's new record to the sender thread (returns at once; see the class docstring).

        ``saved``: a checkpoint was saved by this process (sticky; the launcher then resumes from the newest slot
        rather than from a ``--ckpt_path`` the user gave).
        """
        if not self.enabled:
            return
        self._saved |= bool(saved)
        rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0) if rank is None else rank
        self._seq += 1
        now = time.time()
        if self._resumed_from is None and phase != "setup":  # a setup beat comes before the checkpoint is loaded
            self._resumed_from = int(step) - 1 if phase == "train" else int(step)
        if phase == "train" and self._first_train_time is None:
            self._first_train_time = now
        if phase in ("setup", "start"):
            self._phase_times.setdefault(f"{phase}_time", now)
        record = {
            "step": int(step),
            "phase": phase,
            "host": host_name(),
            "pid": os.getpid(),
            "seq": self._seq,
            "time": now,
            "resumed_from": self._resumed_from,
            "first_train_time": self._first_train_time,
            "saved": self._saved,
            **self._phase_times,
        }
        with self._cond:
            self._pending = (heartbeat_key(self.attempt, rank), json.dumps(record))
            self._cond.notify_all()
            if not self._closed and (self._sender is None or not self._sender.is_alive()):
                self._sender = threading.Thread(target=self._send_forever, name="mula-heartbeat", daemon=True)
                self._sender.start()
                atexit.register(self.close)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the newest record is written (at most ``timeout_s``); whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the sender once its write in flight (if any) is done, at most ``timeout_s``; registered with
        ``atexit``, so that a process that ends closes its connection after its last record rather than in the
        middle of one (the server would count a truncated line as a protocol error)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            if not self._busy and self._conn is not None:
                self._conn.close()
                self._conn = None

    def _send_forever(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                (key, value), self._pending = self._pending, None
                self._busy = True
            ok = self._send(key, value)
            with self._cond:
                self._busy = False
                if not ok and self._pending is None:
                    self._pending = (key, value)  # retried after the backoff unless a newer record came
                self._cond.notify_all()
            if not ok:
                with self._cond:  # the backoff, cut short by close()
                    self._cond.wait_for(lambda: self._closed, timeout=self._backoff)

    def _send(self, key: str, value: str) -> bool:
        try:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.sendall(heartbeat_line(key, value))
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = self._conn.recv(len(HEARTBEAT_ACK) - len(answer))
                if not chunk:
                    raise ConnectionError("the heartbeat server closed the connection")
                answer += chunk
            if answer != HEARTBEAT_ACK:
                raise ConnectionError(f"the heartbeat server answered {answer!r}")
        except (OSError, ValueError) as err:  # training goes on; retried after a backoff
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            first = self._backoff == 0.0
            self._backoff = min(self.MAX_BACKOFF_S, self._backoff * 2 or self.FIRST_BACKOFF_S)
            if first:
                log.warning(
                    "heartbeat: cannot reach the launcher's heartbeat server at %s (%s); retrying with backoff",
                    self.address,
                    err,
                )
            return False
        if self._backoff:
            log.warning("heartbeat: the launcher's server at %s answers again", self.address)
        self._backoff = 0.0
        return True


@dataclass
class NanRecord:
    """One host of a NaN event, as NaNDetector appends it to the NaN-events file: one JSON object per line.

    ``ranks``: this host's non-finite ranks; ``ep_groups``: their expert-parallel groups; ``bad``: non-finite ranks
    in the whole event; ``world``: the world size; ``step``: optimizer steps completed before the skipped one.
    (The failed-hosts file beside it holds the host names only, one per line, for ``srun --exclude``.)
    """

    host: str
    step: int | None = None
    ranks: list[int] = field(default_factory=list)
    ep_groups: list[int] = field(default_factory=list)
    bad: int | None = None
    world: int | None = None

    def line(self) -> str:
        """The record as one line of the NaN-events file (JSON)."""
        return json.dumps({"host": self.host, "step": self.step, "ranks": self.ranks, "ep_groups": self.ep_groups,
                           "bad": self.bad, "world": self.world})  # fmt: skip

    def legacy_line(self) -> str:
        """The ``HOST key=value ...`` line earlier versions appended to the failed-hosts file."""
        parts = [self.host]
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.ranks:
            parts.append("ranks=" + ",".join(map(str, self.ranks)))
        if self.ep_groups:
            parts.append("ep_groups=" + ",".join(map(str, self.ep_groups)))
        if self.bad is not None:
            parts.append(f"bad={self.bad}")
        if self.world is not None:
            parts.append(f"world={self.world}")
        return " ".join(parts)


def parse_nan_line(line: str) -> NanRecord | None:
    """A NaN-events line (JSON) as a :class:`NanRecord`; None for a blank line. An earlier version's ``HOST
    key=value ...`` line, or a host name alone, is read too. Unknown keys and bad values are skipped (the host is
    what matters)."""
    if not line.strip():
        return None
    if line.lstrip().startswith("{"):
        try:
            data = json.loads(line)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("host"), str):
            return None
        record = NanRecord(data["host"])
        for key in ("step", "bad", "world"):
            if isinstance(data.get(key), int):
                setattr(record, key, data[key])
        for key in ("ranks", "ep_groups"):
            if isinstance(data.get(key), list):
                setattr(record, key, [v for v in data[key] if isinstance(v, int)])
        return record
    host, *items = line.split()
    record = NanRecord(host)
    for item in items:
        key, _, value = item.partition("=")
        try:
            if key in ("step", "bad", "world"):
                setattr(record, key, int(value))
            elif key in ("ranks", "ep_groups"):
                setattr(record, key, [int(v) for v in value.split(",") if v])
        except ValueError:
            continue
    return record


FAULT_KINDS = ("kill", "hang", "nan", "exception", "abort", "slow", "diskfull")
_INT_KEYS = ("step", "rank", "local_rank", "attempt", "ms")


@dataclass(frozen=True)
class Fault:
    """One injected failure: ``kind`` at optimizer step ``step`` where ``node`` / ``rank`` / ``local_rank`` match
    (``slow``: every step from ``step`` on takes ``ms`` milliseconds longer there)."""

    kind: str
    step: int
    node: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    attempt: int = 0
    ms: int = 0

    def applies(self, host: str, rank: int, local_rank: int, attempt: int) -> bool:
        return (
            self.attempt == attempt
            and self.node in (None, host)
            and self.rank in (None, rank)
            and self.local_rank in (None, local_rank)
        )


#: the kinds that may also fire during the Trainer's set-up (``step=0``: before the checkpoint is loaded, as a second
#: fault during a restart does)
SETUP_FAULT_KINDS = ("kill", "hang", "exception", "abort")


def parse_faults(spec: str) -> list[Fault]:
    """``"kind@key=value,...;..."`` -> faults.

    Raises:
        ValueError: naming the part that does not parse (unknown kind or key, a step that is not a positive int).
    """
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, at, args = part.partition("@")
        if kind not in FAULT_KINDS or not at:
            raise ValueError(f"{FAULT_ENV}: {part!r}: expected KIND@step=S[,node=..] with KIND one of {FAULT_KINDS}")
        fields: dict[str, Any] = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in (*_INT_KEYS, "node"):
                raise ValueError(
                    f"{FAULT_ENV}: {part!r}: {item!r} is not one of step=, node=, rank=, local_rank=, attempt=, ms="
                )
            if key in _INT_KEYS:
                if not value.isdigit():
                    raise ValueError(f"{FAULT_ENV}: {part!r}: {key}={value!r} is not a non-negative integer")
                fields[key] = int(value)
            else:
                fields[key] = value
        if "step" not in fields or (fields["step"] < 1 and kind not in SETUP_FAULT_KINDS):
            raise ValueError(
                f"{FAULT_ENV}: {part!r}: step=S (S >= 1, the optimizer step it happens at; 0, during the set-up, for "
                f"{'/'.join(SETUP_FAULT_KINDS)}) is required"
            )
        if (kind == "slow") != (fields.get("ms", 0) > 0):
            raise ValueError(f"{FAULT_ENV}: {part!r}: ms=M (M >= 1) is required by slow and taken by no other kind")
        faults.append(Fault(kind=kind, **fields))
    return faults
