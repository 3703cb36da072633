"""``torch.distributed`` helpers every package shares: is a group up, this rank, object collectives, flag devices.

Each works without an initialised process group (one process: rank 0 of 1, collectives are identities), so callers
need no ``if dist.is_initialized()`` of their own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_object",
    "all_true",
    "broadcast_object",
    "flag_device",
    "is_distributed",
    "rank_world",
    "release_process_groups",
]


def is_distributed() -> bool:
    """Whether a default process group exists (``torch.distributed`` available and initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without one."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def release_process_groups() -> None:
    """Destroy every process group of this process (and so drop its store) now, before the interpreter's shutdown
    does: a group or store left to shutdown is freed in no set order with the other threads' objects and has ended a
    rank that had finished training with ``terminate called without an active exception`` (SIGABRT), an exit the
    launcher takes for a fault. Only once the ranks' collectives are over (a finished stage): a group with a peer
    still inside a collective waits for it in the shutdown."""
    if is_distributed():
        dist.destroy_process_group()


def flag_device(group: Any = None) -> torch.device:
    """Where a collective's tensor must live for the backend of ``group`` (default: the default group; CPU for gloo)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "xccl":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def all_true(ok: bool, group: Any = None) -> bool:
    """True on every rank iff ``ok`` is true on every rank of ``group`` (one all-reduce of one element)."""
    if not is_distributed():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def broadcast_object(value: Any, src: int = 0) -> Any:
    """``value`` of rank ``src`` on every rank (picklable objects; ranks of one job only, never a file)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` in ``group``, in rank order (picklable objects; ranks of one job only, never a file)."""
    if not is_distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
