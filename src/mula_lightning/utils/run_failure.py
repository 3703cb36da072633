"""``RunFailure``: an exception raised after a run's processes started, reported with its traceback.

Why: ``mula`` answers a bad input found before launch with one line naming the values: that is what a user needs
when a path or a size is wrong. An out-of-memory error, an NCCL timeout or a bug at step 50,000 is another thing:
the one line hides where it happened. So the training commands wrap whatever escapes the Trainer once it started
(after the preflight checks) in a ``RunFailure``, and the console script prints its traceback, every line prefixed
with the rank (``[rank 3] ...``), once per rank, before the one-line summary.
"""

from __future__ import annotations

import os
import traceback

__all__ = ["RunFailure", "current_rank"]


def current_rank() -> int:
    """This process's global rank: the process group's, else ``RANK`` (torchrun, SLURM via Lightning), else
    ``SLURM_PROCID``, else ``LOCAL_RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class RunFailure(RuntimeError):
    """``original`` escaped a run after its processes started; :attr:`report` is its rank-prefixed traceback."""

    def __init__(self, original: BaseException, rank: int | None = None) -> None:
        self.original = original
        self.rank = current_rank() if rank is None else rank
        text = "".join(traceback.format_exception(type(original), original, original.__traceback__))
        self.report = "".join(f"[rank {self.rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
        super().__init__(f"rank {self.rank}: {type(original).__name__}: {original}")
