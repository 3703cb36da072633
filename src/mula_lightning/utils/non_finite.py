"""``NonFiniteCheck``: find the rank whose loss or gradients went non-finite, stop every rank together, name the host.

Why (Aurora paper, Section 4, "Soft node failure handling"): a failing accelerator can keep running and produce
NaN/Inf locally. Once gradients are reduced the NaN is on every rank and nobody knows where it came from; one
optimizer step later the weights are NaN, and the next checkpoint is poisoned. Lightning's own
``check_finite_loss`` is never called by the Trainer and only looks at the loss.

This is the check without a Trainer, so that a Fabric or plain training loop gets it as ``mula fit`` does (through
the :class:`~mula_lightning.callbacks.NaNDetector` callback, which drives it from Lightning's hooks)::

    check = NonFiniteCheck(out_dir, ep_size=ep_size).watch(model)   # after the strategy set the model up
    ...
        check.loss(loss)              # before each backward
        fabric.backward(loss)
    ...
    check.step(step)                  # before clipping and optimizer.step(): `step` optimizer steps are done

What runs, per rank:

* before backward: ``isfinite(loss)`` (one small device op, no host sync);
* during backward: a gradient hook on every parameter (``Tensor.register_hook`` runs *before* the gradient is
  accumulated, i.e. before DDP's or :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`'s bucket
  hooks add it to a reduction) records, on the device, the order in which each tensor was first seen
  non-finite: the flags describe this rank's local values, never reduced ones;
* once per optimizer step, before the update (:meth:`NonFiniteCheck.step`): one all-reduce of one int per rank
  (the fused "this rank saw a non-finite value" flag), i.e. one collective and one host sync per step.

On detection every rank knows the offending ranks from that single all-reduce, so all leave together (nobody is
left waiting in a collective): the offending ranks' details are gathered, rank 0 writes the JSON report and
appends one line per offending host to the failed-hosts file (and to ``MULA_FAILED_HOSTS_FILE`` when ``mula launch``
set it): ``HOST step=S ranks=R,.. ep_groups=G,.. bad=B world=W``, from which the launcher tells a node's fault (one
host, or one expert-parallel group: a NaN crosses the dispatch all-to-all within the group) from the model's or the
data's (several at once: nobody is evicted), and every rank exits with :data:`NAN_EXIT_CODE` without running the
optimizer step, so the weights and every later checkpoint stay clean (no later code of the loop runs after the
event). Hosts are named by ``MULA_NODE_NAME`` when set (simulated nodes), else SLURM's node name or the hostname.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.parallel.params import local_tensor
from mula_lightning.utils.dist import all_gather_object, flag_device, is_distributed
from mula_lightning.utils.io import atomic_write_text
from mula_lightning.utils.launch_env import NAN_EVENTS_ENV, NAN_EXIT_CODE, NanRecord, host_name

__all__ = ["FAILED_HOSTS_NAME", "NAN_EVENTS_NAME", "REPORT_NAME", "NonFiniteCheck", "NonFiniteError"]

REPORT_NAME = "nan_report.json"
FAILED_HOSTS_NAME = "failed_hosts.txt"
NAN_EVENTS_NAME = "nan_events.jsonl"

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised on every rank instead of exiting (``NonFiniteCheck(..., exit_code=None)``); ``report`` is the event."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def _append_host(path: Path, host: str) -> None:
    """Add ``host`` to a host list (one name per line, as ``srun --exclude=$(paste -sd, FILE)`` reads it), once."""
    if path.exists() and host in path.read_text().split():
        return
    _append_line(path, host)


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class NonFiniteCheck:
    """The per-step non-finite check of one rank's model (see the module docstring).

    Args:
        report_dir: directory of ``nan_report.json``, of ``nan_events.jsonl`` (one JSON record per offending host
            and event: step, ranks, expert-parallel groups, the event's size) and of the failed-hosts file by
            default.
        failed_hosts_file: the host list the offending hosts are added to, one name per line, each once (default
            ``report_dir/failed_hosts.txt``). Under ``mula launch`` the launcher's ``nan_events.jsonl``
            (``MULA_NAN_EVENTS``) receives the events too (what it attributes from).
        exit_code: the exit status of every rank after a detection (default :data:`NAN_EXIT_CODE`); ``None``
            raises :class:`NonFiniteError` on every rank instead.
        max_tensors: how many offending tensors the report names per rank (first seen first).
        ep_size: the expert-parallel group size (consecutive ranks), so that the events name the groups.
        local_rank: this rank's index on its node, for the report (default ``LOCAL_RANK``).
    """

    def __init__(
        self,
        report_dir: str | Path,
        failed_hosts_file: str | Path | None = None,
        exit_code: int | None = NAN_EXIT_CODE,
        max_tensors: int = 8,
        ep_size: int = 1,
        local_rank: int | None = None,
    ) -> None:
        self.report_dir = Path(report_dir)
        self.failed_hosts_file = Path(failed_hosts_file) if failed_hosts_file else self.report_dir / FAILED_HOSTS_NAME
        self.exit_code = None if exit_code is None else int(exit_code)
        self.max_tensors = max_tensors
        self.ep_size = max(1, int(ep_size))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if local_rank is None else int(local_rank)
        self.device = "cpu"
        self._names: list[str] = []
        self._first: torch.Tensor | None = None  # [0]: loss, [i + 1]: parameter i; 0 = finite so far
        self._seq = 0
        self._handles: list[Any] = []
        self._loss: torch.Tensor | None = None

    def watch(self, module: torch.nn.Module) -> NonFiniteCheck:
        """Hook every trainable parameter of ``module`` (once the strategy set it up: its parameters are final)."""
        self.close()
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        device = params[0][1].device if params else torch.device("cpu")
        self.device = str(device)
        self._names = [n for n, _ in params]
        self._first = torch.zeros(len(params) + 1, dtype=torch.int64, device=device)
        self._handles = [p.register_hook(partial(self._on_grad, i + 1)) for i, (_, p) in enumerate(params)]
        return self

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _mark(self, index: int, value: torch.Tensor) -> None:
        assert self._first is not None, "NonFiniteCheck.watch(model) first"
        self._seq += 1
        first = self._first[index]
        self._first[index] = torch.where(~torch.isfinite(value).all() & (first == 0), self._seq, first)

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        self._mark(index, local_tensor(grad.detach()))  # a tensor-parallel gradient: this rank's part of it

    def loss(self, loss: torch.Tensor) -> None:
        """Before ``loss``'s backward: whether it is finite, on the device (no host sync)."""
        self._loss = loss.detach()
        self._mark(0, self._loss)

    def step(self, step: int) -> None:
        """Before the optimizer step that follows ``step`` completed ones (and before clipping): one all-reduce of
        one flag per rank; on every rank, exit (or raise) when any flag is set, else clear the flags."""
        assert self._first is not None, "NonFiniteCheck.watch(model) first"
        distributed = is_distributed() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        device = flag_device() if distributed else self._first.device
        flags = torch.zeros(world, dtype=torch.int32, device=device)
        flags[rank] = (self._first > 0).any().to(device)
        if distributed:
            dist.all_reduce(flags)
        bad_ranks = [r for r, flag in enumerate(flags.tolist()) if flag]  # the one host read of the step
        if bad_ranks:
            self._stop(int(step), bad_ranks)
        self._first.zero_()
        self._seq = 0

    def _local_report(self, rank: int) -> dict[str, Any]:
        assert self._first is not None
        first = self._first.tolist()
        order = sorted((seq, i) for i, seq in enumerate(first) if seq > 0)
        tensors = [("loss" if i == 0 else self._names[i - 1]) for _, i in order]
        return {
            "rank": rank,
            "host": host_name(),
            "device": self.device,
            "local_rank": self.local_rank,
            "loss": None if self._loss is None else float(self._loss.float().item()),
            "loss_finite": first[0] == 0,
            "first_offending_tensors": [t for t in tensors if t != "loss"][: self.max_tensors],
        }

    def _stop(self, step: int, bad_ranks: list[int]) -> None:
        distributed = is_distributed() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        mine = self._local_report(rank) if rank in bad_ranks else None
        offenders = [r for r in all_gather_object(mine) if r is not None]
        report = {
            "event": "non_finite",
            "step": step,  # optimizer steps completed before the one that was skipped
            "time": time.time(),
            "world_size": dist.get_world_size() if distributed else 1,
            "bad_ranks": bad_ranks,
            "ranks": offenders,
            "exit_code": self.exit_code,
            "failed_hosts_file": str(self.failed_hosts_file),
        }
        if rank == 0:
            self._write(report, offenders, step, bad_ranks)
        if distributed:
            dist.barrier()  # the report is on disk before anyone leaves
        where = ", ".join(
            f"rank {r['rank']} on {r['host']} ({r['first_offending_tensors'][:2] or 'loss'})" for r in offenders
        )
        how = "raising NonFiniteError" if self.exit_code is None else f"exiting with code {self.exit_code}"
        message = (
            f"non-finite values at step {step} from {where}; step skipped, {how} (report: "
            f"{self.report_dir / REPORT_NAME})"
        )
        if self.exit_code is None:
            raise NonFiniteError(message, report)
        log.error(f"NaNDetector: {message}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)  # now, on every rank: no later code (checkpoint, logger) may run after the event

    def _write(self, report: dict[str, Any], offenders: list[dict[str, Any]], step: int, bad_ranks: list[int]) -> None:
        """Rank 0: the JSON report, one event line per offending host, the host list."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.report_dir / REPORT_NAME, json.dumps(report, indent=1))
        events = [self.report_dir / NAN_EVENTS_NAME]
        if os.environ.get(NAN_EVENTS_ENV) and Path(os.environ[NAN_EVENTS_ENV]) != events[0]:
            events.append(Path(os.environ[NAN_EVENTS_ENV]))
        for host in dict.fromkeys(r["host"] for r in offenders):
            ranks = [r["rank"] for r in offenders if r["host"] == host]
            line = NanRecord(
                host,
                step=step,
                ranks=ranks,
                ep_groups=sorted({r // self.ep_size for r in ranks}) if self.ep_size > 1 else [],
                bad=len(bad_ranks),
                world=report["world_size"],
            ).line()
            for path in events:
                _append_line(path, line)
            _append_host(self.failed_hosts_file, host)
