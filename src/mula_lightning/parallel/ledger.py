"""Communication ledger: what every collective in this package sent, per rank, per topology level.

Tests use it to prove that a parallel layer moves exactly the bytes its closed-form count says; benchmarks use it
to print bytes per collective per level against the ZeRO-topo paper's Tables VII-VIII and the MoE dispatch formulas.

Byte convention (documented once, used everywhere): ``bytes_sent`` is what *this rank* puts on the wire for one
call, assuming the bandwidth-optimal ring algorithm (the algorithm NCCL / oneCCL / gloo use for large messages and
the one the ZeRO papers' ``psi * (d - 1) / d`` volumes assume). For a group of ``d`` ranks:

============== ===================== ====================== ===============================================
op             bytes_in (this rank)  bytes_out (this rank)  bytes_sent (this rank)
============== ===================== ====================== ===============================================
all_gather     n                     d * n                  (d - 1) * n        = (d - 1) / d of the output
reduce_scatter N                     N / d                  (d - 1) * N / d    = (d - 1) / d of the input
all_reduce     N                     N                      2 * (d - 1) * N / d (reduce-scatter + all-gather)
all_to_all     sum of input splits   sum of output splits   input bytes minus the split it keeps for itself
============== ===================== ====================== ===============================================

Levels: a group's level is the narrowest piece of hardware that holds all its ranks, from the ZeRO-topo paper's
three bandwidth tiers: ``"gcd"`` (ranks on one physical GPU: the two GCDs of an MI250X, the two tiles of an Intel
Max GPU), ``"intra_node"``, ``"inter_node"``; ``"self"`` for a group of one. It is derived from a
:class:`~mula_lightning.parallel.hardware.HardwareTopology` (by default read from ``MULA_RANKS_PER_NODE`` /
``LOCAL_WORLD_SIZE`` and ``MULA_RANKS_PER_GPU``, or discovered from ``MULA_NODE_NAME`` / host names) unless the
caller passes an explicit label such as ``"ep"``.

Cost when not recording: collectives check :func:`is_recording` (one global read) and skip everything else.
Recording is process-wide, not per thread, because autograd may run backward collectives on its own threads;
appends take a lock, so concurrent recording is safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.parallel.hardware import LEVELS, HardwareTopology

__all__ = [
    "LEVELS",
    "CommLedger",
    "CommRecord",
    "CommTotals",
    "is_recording",
    "record_collective",
    "record_functional_collectives",
    "ring_bytes_sent",
]


def ring_bytes_sent(op: str, group_size: int, bytes_in: int, self_bytes: int = 0) -> int:
    """Bytes one rank sends for one collective under the ring convention in the module docstring.

    Args:
        op: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``.
        group_size: ranks in the group (``d``).
        bytes_in: bytes of this rank's input tensor.
        self_bytes: for ``all_to_all`` only, the bytes of the split this rank sends to itself (never on the wire).

    Returns:
        The bytes sent, rounded down where ``bytes_in`` is not divisible by ``d`` (all_reduce).
    """
    d = group_size
    if op == "all_gather":
        return (d - 1) * bytes_in
    if op == "reduce_scatter":
        return (d - 1) * bytes_in // d
    if op == "all_reduce":
        return 2 * (d - 1) * bytes_in // d
    if op == "all_to_all":
        return bytes_in - self_bytes
    raise ValueError(f"unknown collective {op!r}; expected all_gather, reduce_scatter, all_reduce or all_to_all")


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by one rank (see the module docstring for the byte convention)."""

    op: str
    ranks: tuple[int, ...]
    rank: int
    level: str
    dtype: str
    bytes_in: int
    bytes_out: int
    bytes_sent: int
    phase: str | None = None
    tag: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CommTotals:
    """Sums over a set of records."""

    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_sent: int = 0

    def add(self, record: CommRecord) -> None:
        self.count += 1
        self.bytes_in += record.bytes_in
        self.bytes_out += record.bytes_out
        self.bytes_sent += record.bytes_sent


@dataclass(eq=False)
class CommLedger:
    """Captures the collectives of this process while active (``with CommLedger() as ledger: ...``).

    Several ledgers may be active at once (nested captures); each gets every record. Entering without a
    topology reads :meth:`HardwareTopology.from_env` at that moment.

    Attributes:
        topology: the layout used to derive levels; ``None`` until entered, unless given.
    """

    topology: HardwareTopology | None = None
    _records: list[CommRecord] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __enter__(self) -> CommLedger:
        if self.topology is None:
            self.topology = HardwareTopology.from_env()
        _activate(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _deactivate(self)

    @property
    def records(self) -> list[CommRecord]:
        """A copy of the records so far, in call order."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def add(
        self,
        op: str,
        ranks: Sequence[int],
        rank: int,
        dtype: torch.dtype | str,
        bytes_in: int,
        bytes_out: int,
        bytes_sent: int,
        level: str | None = None,
        phase: str | None = None,
        tag: str | None = None,
    ) -> CommRecord:
        """Append one record; ``level`` defaults to the topology level of ``ranks``."""
        ranks = tuple(ranks)
        if level is None:
            topology = self.topology or HardwareTopology.from_env()
            level = topology.level_of(ranks)
        record = CommRecord(op, ranks, rank, level, str(dtype), bytes_in, bytes_out, bytes_sent, phase, tag)
        with self._lock:
            self._records.append(record)
        return record

    def select(self, **where: Any) -> list[CommRecord]:
        """Records whose fields equal the given values, e.g. ``select(op="all_gather", phase="backward")``."""
        unknown = set(where) - set(CommRecord.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown record fields {sorted(unknown)}; known: {list(CommRecord.__dataclass_fields__)}")
        return [r for r in self.records if all(getattr(r, k) == v for k, v in where.items())]

    def total(self, **where: Any) -> CommTotals:
        """Totals over :meth:`select` (all records without arguments)."""
        totals = CommTotals()
        for record in self.select(**where):
            totals.add(record)
        return totals

    def summary(self, by: Iterable[str] = ("op", "level")) -> dict[tuple[Any, ...], CommTotals]:
        """Totals grouped by the given record fields, in first-seen order (default: per (op, level))."""
        keys = tuple(by)
        out: dict[tuple[Any, ...], CommTotals] = {}
        for record in self.records:
            out.setdefault(tuple(getattr(record, k) for k in keys), CommTotals()).add(record)
        return out

    def format_summary(self, by: Iterable[str] = ("op", "level")) -> str:
        """The summary as an aligned text table (for benchmarks and logs)."""
        keys = tuple(by)
        rows = [(*map(str, key), str(t.count), str(t.bytes_sent)) for key, t in self.summary(keys).items()]
        header = (*keys, "calls", "bytes_sent")
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
        lines = ("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])
        return "\n".join(lines)

    def __iter__(self) -> Iterator[CommRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


# Active ledgers. Replaced as a whole under the lock (copy on write) so the hot-path read needs no lock.
_ACTIVE: tuple[CommLedger, ...] = ()
_ACTIVE_LOCK = threading.Lock()


def _activate(ledger: CommLedger) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE = (*_ACTIVE, ledger)


def _deactivate(ledger: CommLedger) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE = tuple(active for active in _ACTIVE if active is not ledger)


def is_recording() -> bool:
    """True while at least one ledger is capturing; collectives call this before doing any bookkeeping."""
    return bool(_ACTIVE)


def record_collective(
    op: str,
    group: Any,
    tensor_in: torch.Tensor,
    tensor_out: torch.Tensor,
    bytes_sent: int,
    level: str | None = None,
    phase: str | None = None,
    tag: str | None = None,
) -> None:
    """Add one collective call of this rank to every active ledger (returns at once when none is active).

    Args:
        op: collective name (see :func:`ring_bytes_sent`).
        group: the process group (``None`` for the default group).
        tensor_in: this rank's input, as the caller sees it (its bytes are ``bytes_in``).
        tensor_out: this rank's output (its bytes are ``bytes_out``).
        bytes_sent: bytes this rank sends, from :func:`ring_bytes_sent`.
        level: explicit level label (e.g. ``"ep"``); by default derived from the group's ranks.
        phase: ``"forward"`` / ``"backward"`` for autograd collectives, else ``None``.
        tag: free-form label of the call site (e.g. ``"moe.dispatch.input"``).
    """
    ledgers = _ACTIVE
    if not ledgers:
        return
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    rank = dist.get_rank()
    bytes_in = tensor_in.numel() * tensor_in.element_size()
    bytes_out = tensor_out.numel() * tensor_out.element_size()
    for ledger in ledgers:
        ledger.add(op, ranks, rank, tensor_in.dtype, bytes_in, bytes_out, bytes_sent, level, phase, tag)


_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


def record_functional_collectives() -> Any:
    """A context in which the collectives DTensor issues (tensor parallelism's activation all-reduces,
    all-gathers and reduce-scatters, through ``torch.distributed._functional_collectives``) are recorded in the
    active ledgers like this package's own, tagged ``"dtensor"``. It is a ``TorchDispatchMode`` of the calling
    thread: backward collectives are seen where backward runs in that thread (always on the CPU)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    functional = torch.ops._c10d_functional
    ops = {getattr(functional, name).default: op for name, op in _FUNCTIONAL_OPS.items()}

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            op = ops.get(func)
            if op is not None and is_recording():
                group = _resolve_process_group(args[-1])
                d, tensor = dist.get_world_size(group), args[0]
                sent = ring_bytes_sent(op, d, tensor.numel() * tensor.element_size())
                record_collective(op, group, tensor, out, sent, tag="dtensor")
            return out

    return _Recorder()
