"""Autograd-aware collectives along dim 0, named as in Algorithm 1 of the Aurora MoE paper, with ledger records.

Legend: ``d`` = ranks in the group, ``n`` = rows (dim 0) of this rank's input, ``*`` = the trailing dims.

Algorithm 1 (FastSparseMoE with expert parallelism) communicates through three functions:

* ``forward_allgather_backward_reducescatter`` (lines 11-12): every EP rank sees every rank's tokens and routing
  weights. Forward all-gathers ``(n, *) -> (d * n, *)``; backward reduce-scatters (SUM) the ``(d * n, *)``
  gradient back to ``(n, *)``, adding up the partial gradients every rank computed for the same token.
* ``forward_reducescatter_backward_allgather`` (line 116): each rank holds partial outputs for all tokens from
  its local experts; forward sums them and keeps its own rows, ``(d * n, *) -> (n, *)``; backward all-gathers
  the ``(n, *)`` output gradient so every rank has the gradient for all rows.
* ``forward_allgather`` (line 13): the routing indices; integers, so no gradient.

``all_to_all_single`` (variable split sizes, backward = the reverse all-to-all) serves the all-to-all dispatcher;
``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_reduce`` are plain (no-grad) functional wrappers
for optimizers and sharding engines. Every call adds a record to the active communication ledgers
(:mod:`mula_lightning.parallel.ledger`), with the bytes it sends under the ring convention documented there;
the backward of an autograd collective records with ``phase="backward"``.

Dtypes: data-movement collectives (all-gather, all-to-all) send tensors of a dtype not every backend handles
(bool, float8, int16, unsigned 16-64 bit, complex; gloo refuses float8, int16 and uint16/32/64) as their raw bytes
viewed as ``uint8``, which is exact. Reductions accept only dtypes the backends reduce (floats, int8/uint8,
int32, int64) and refuse others with a ``TypeError``. gloo in torch 2.14 moves and reduces int32 and int64
natively (checked bit-exact, e.g. values above 2**62), so indices need no conversion.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.parallel.ledger import is_recording, record_collective, ring_bytes_sent
from mula_lightning.utils.device import BACKEND_FOR_DEVICE

__all__ = [
    "all_gather_into_tensor",
    "all_gather_reads_own_chunk",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "exchange_split_counts",
    "exchange_split_sizes",
    "forward_allgather",
    "forward_allgather_backward_reducescatter",
    "forward_reducescatter_backward_allgather",
    "gather_from_owners",
    "reduce_scatter_single",
    "reduce_to_owners",
    "reduce_scatter_tensor",
]

# torch >= 2.14 renamed the tensor collectives; older versions (the project supports torch >= 2.9) have the old names.
#: ``dist.all_gather_single(out, x, group=..., async_op=...)`` under either name (no autograd, no ledger record).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: process-group backends whose all-gather may take as input this rank's own chunk of the output: NCCL's "in-place"
#: all-gather (``sendbuff == recvbuff + rank * sendcount``, documented), and gloo, whose torch binding gathers into a
#: temporary and copies the chunks out afterwards. XCCL and MPI are not documented to allow it (MPI needs its own
#: ``MPI_IN_PLACE``), so their callers keep a separate input.
_ALL_GATHER_IN_PLACE = frozenset({"nccl", "gloo"})


def all_gather_reads_own_chunk(group: Any, device: torch.device) -> bool:
    """Whether ``all_gather_single(out, out[r * n : (r + 1) * n], group)`` is safe on ``group`` for tensors on
    ``device`` (rank ``r``, chunks of ``n``): no copy of the input, and no input buffer held while the gather runs.

    A group with one backend per device type (``"cpu:gloo,cuda:nccl"``) answers for ``device``'s.
    """
    return backend_for_device(str(dist.get_backend(group)), device.type) in _ALL_GATHER_IN_PLACE


def backend_for_device(backend: str, device_type: str) -> str:
    """The backend of a process group's ``backend`` string that moves ``device_type`` tensors: ``"gloo"`` for
    ``("gloo", "cpu")``, ``"nccl"`` for ``("cpu:gloo,cuda:nccl", "cuda")``, ``""`` when none does."""
    if ":" not in backend:
        return backend
    return dict(item.split(":", 1) for item in backend.split(",")).get(device_type, "")


class _SumOnWait:
    """The work of :func:`reduce_scatter_single` on gloo: waits for the all-to-all, then sums what arrived. Until
    then it holds a receive buffer of the input's size (``holds_input_copy``: callers that launch many bound how
    many are in flight)."""

    holds_input_copy = True

    def __init__(self, work: Any, recv: torch.Tensor, out: torch.Tensor, size: int) -> None:
        self.work, self.recv, self.out, self.size, self.done = work, recv, out, size, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
            _sum_chunks(self.recv, self.out, self.size)
            self.recv, self.done = None, True
        return True


def _sum_chunks(recv: torch.Tensor, out: torch.Tensor, size: int) -> None:
    """``out = recv[0] + recv[1] + ...`` over the ``size`` equal chunks of ``recv``, in rank order, in the dtype."""
    torch.sum(recv.view(size, -1), dim=0, dtype=out.dtype, out=out.view(-1))


def reduce_scatter_single(
    out: torch.Tensor, x: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.14): no autograd, no ledger record.

    On gloo a SUM goes as an all-to-all of the chunks and a local sum (in rank order) instead: gloo emulates its
    reduce-scatter, and measured on 2 cores (fp32 inputs of 1-16 MiB) the all-to-all + sum takes 0.47-0.51 of its
    time at 2 ranks and 0.24-0.47 at 4. Each rank sends the same ``(d - 1) / d`` of its input as the ring algorithm,
    so the ledger's records stand; NCCL and XCCL keep their native reduce-scatter. With ``async_op=True`` the
    returned work's ``wait`` completes the sum.
    """
    size = dist.get_world_size(group)
    if x.numel() != out.numel() * size or x.dtype != out.dtype:
        raise ValueError(
            f"reduce-scatter over {size} ranks: input of {x.numel()} {x.dtype} elements for an output of "
            f"{out.numel()} {out.dtype} (the input must hold {size} x the output, same dtype)"
        )
    cpu_backend = backend_for_device(str(dist.get_backend(group)), "cpu")
    native = op != dist.ReduceOp.SUM or x.device.type != "cpu" or cpu_backend != "gloo"
    if native or size == 1:
        return _torch_reduce_scatter_single(out, x, op=op, group=group, async_op=async_op)
    x = x.contiguous()
    recv = torch.empty_like(x)
    work = dist.all_to_all_single(recv, x, group=group, async_op=async_op)
    if async_op:
        return _SumOnWait(work, recv, out, size)
    _sum_chunks(recv, out, size)
    return None


class _WaitAll:
    """Several launched works as one: ``wait`` waits for each."""

    holds_input_copy = False

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def reduce_to_owners(x: torch.Tensor, sizes: list[int], group: Any, via: str = "auto") -> tuple[Any, torch.Tensor]:
    """A reduce-scatter (SUM) of uneven chunks, launched asynchronously: rank ``r`` of ``group`` receives the sum
    over the ranks of ``x``'s ``r``-th chunk (``sizes[r]`` elements, in rank order). Returns ``(work, out)``; ``out``
    holds this rank's reduced chunk once ``work.wait()`` returned.

    Why: an owner-aligned layout (the sharded Muon's: whole matrices per rank) cannot split into equal chunks
    without padding the buffers up to the largest owner's share. On gloo (CPU) it goes as one uneven all-to-all and
    a local sum, as :func:`reduce_scatter_single` does; elsewhere as one ``reduce`` to each owner of a non-empty
    chunk (NCCL and XCCL reduce in place on the owner; ``x`` outside this rank's chunk may be overwritten). Each rank
    sends ``(d - 1) / d`` of ``x`` either way on average, as a reduce-scatter does. ``via`` (``"all_to_all"`` or
    ``"reduce"``) forces one of the two, so that a CPU test checks the accelerators' path.
    """
    if via not in ("auto", "all_to_all", "reduce"):
        raise ValueError(f"via {via!r} must be 'auto', 'all_to_all' or 'reduce'")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != size or sum(sizes) != x.numel():
        raise ValueError(f"chunks {sizes} over {size} ranks do not split an input of {x.numel()} elements")
    starts = [sum(sizes[:r]) for r in range(size + 1)]
    gloo = x.device.type == "cpu" and backend_for_device(str(dist.get_backend(group)), "cpu") == "gloo"
    if via == "all_to_all" or (via == "auto" and gloo):
        recv = torch.empty(sizes[rank] * size, dtype=x.dtype, device=x.device)
        out = torch.empty(sizes[rank], dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(
            recv, x, output_split_sizes=[sizes[rank]] * size, input_split_sizes=sizes, group=group, async_op=True
        )
        return _SumOnWait(work, recv, out, size), out
    works = [
        dist.reduce(x[starts[r] : starts[r + 1]], dst=dist.get_global_rank(group, r), group=group, async_op=True)
        for r in range(size)
        if sizes[r]
    ]
    return _WaitAll(works), x[starts[rank] : starts[rank + 1]]


def gather_from_owners(x: torch.Tensor, sizes: list[int], group: Any) -> Any:
    """The all-gather of :func:`reduce_to_owners`' layout, launched asynchronously: every rank's chunk ``r`` of ``x``
    becomes rank ``r``'s (one broadcast from each owner of a non-empty chunk). Returns the work to wait for."""
    size = dist.get_world_size(group)
    if len(sizes) != size or sum(sizes) != x.numel():
        raise ValueError(f"chunks {sizes} over {size} ranks do not split an output of {x.numel()} elements")
    starts = [sum(sizes[:r]) for r in range(size + 1)]
    works = [
        dist.broadcast(x[starts[r] : starts[r + 1]], src=dist.get_global_rank(group, r), group=group, async_op=True)
        for r in range(size)
        if sizes[r]
    ]
    return _WaitAll(works)


# Dtypes NCCL, XCCL and gloo all move and reduce natively; anything else is moved as bytes and never reduced.
_NATIVE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
)


def _group_device(group: Any) -> torch.device:
    """Where tensors this function creates for ``group`` must live: NCCL / XCCL only move accelerator memory."""
    backend = str(dist.get_backend(group))
    device_type = next((kind for kind, name in BACKEND_FOR_DEVICE.items() if name == backend), "cpu")
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def _rows_as_bytes(x: torch.Tensor) -> torch.Tensor:
    """View ``(n, *)`` as ``(n, row_bytes)`` uint8 so any dtype can be moved; rows stay rows."""
    return x.contiguous().reshape(x.shape[0], math.prod(x.shape[1:])).view(torch.uint8)


def _rows_from_bytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_rows_as_bytes` for a result with ``raw.shape[0]`` rows shaped like ``like``'s rows."""
    return raw.view(like.dtype).reshape(raw.shape[0], *like.shape[1:])


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.dim() == 0:
        raise ValueError(f"{what} works along dim 0 and needs a tensor with at least one dim, got a scalar")


def _check_reducible(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _NATIVE_DTYPES:
        raise TypeError(f"{what} cannot reduce {x.dtype}; reducible dtypes: {sorted(str(t) for t in _NATIVE_DTYPES)}")


def _all_gather(x: torch.Tensor, group: Any, level: str | None, phase: str | None, tag: str | None) -> torch.Tensor:
    """``(n, *) -> (d * n, *)``, rank order. Sends ``(d - 1) * n`` rows per rank."""
    _check_rows(x, "all-gather")
    d = dist.get_world_size(group)
    if x.dtype in _NATIVE_DTYPES:
        x = x.contiguous()
        out = x.new_empty((d * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
    else:
        raw = _rows_as_bytes(x)
        raw_out = raw.new_empty((d * raw.shape[0], raw.shape[1]))
        all_gather_single(raw_out, raw, group=group)
        out = _rows_from_bytes(raw_out, x)
    if is_recording():
        sent = ring_bytes_sent("all_gather", d, x.numel() * x.element_size())
        record_collective("all_gather", group, x, out, sent, level, phase, tag)
    return out


def _reduce_scatter(x: torch.Tensor, group: Any, level: str | None, phase: str | None, tag: str | None) -> torch.Tensor:
    """``(d * n, *) -> (n, *)``: SUM over ranks, rank ``i`` keeps rows ``[i * n, (i + 1) * n)``.

    Sends ``(d - 1) / d`` of the input per rank.
    """
    _check_rows(x, "reduce-scatter")
    _check_reducible(x, "reduce-scatter")
    d = dist.get_world_size(group)
    if x.shape[0] % d:
        raise ValueError(f"reduce-scatter input dim 0 ({x.shape[0]}) must be divisible by the group size ({d})")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // d, *x.shape[1:]))
    reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    if is_recording():
        sent = ring_bytes_sent("reduce_scatter", d, x.numel() * x.element_size())
        record_collective("reduce_scatter", group, x, out, sent, level, phase, tag)
    return out


def _all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    level: str | None,
    phase: str | None,
    tag: str | None,
) -> torch.Tensor:
    """Rows ``input_split_sizes[j]`` go to group rank ``j``; rows from rank ``j`` arrive in rank order.

    Sends every input row except the split this rank keeps for itself.
    """
    _check_rows(x, "all-to-all")
    d = dist.get_world_size(group)
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all-to-all needs both output_split_sizes and input_split_sizes, or neither (equal splits)")
    if input_split_sizes is None:
        if x.shape[0] % d:
            raise ValueError(f"equal-split all-to-all needs dim 0 ({x.shape[0]}) divisible by the group size ({d})")
        input_split_sizes = output_split_sizes = [x.shape[0] // d] * d
    if len(input_split_sizes) != d or len(output_split_sizes) != d or sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"all-to-all split sizes must have one entry per rank ({d}) and input splits must sum to dim 0 "
            f"({x.shape[0]}); got input {list(input_split_sizes)}, output {list(output_split_sizes)}"
        )
    native = x.dtype in _NATIVE_DTYPES
    send = x.contiguous() if native else _rows_as_bytes(x)
    recv = send.new_empty((sum(output_split_sizes), *send.shape[1:]))
    dist.all_to_all_single(recv, send, list(output_split_sizes), list(input_split_sizes), group=group)
    out = recv if native else _rows_from_bytes(recv, x)
    if is_recording():
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        own = input_split_sizes[dist.get_rank(group)] * row_bytes
        sent = ring_bytes_sent("all_to_all", d, x.numel() * x.element_size(), self_bytes=own)
        record_collective("all_to_all", group, x, out, sent, level, phase, tag)
    return out


class _AllGatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, level: str | None, tag: str | None) -> torch.Tensor:
        ctx.group, ctx.level, ctx.tag = group, level, tag
        return _all_gather(x, group, level, "forward", tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.level, "backward", ctx.tag), None, None, None


class _ReduceScatterAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, level: str | None, tag: str | None) -> torch.Tensor:
        ctx.group, ctx.level, ctx.tag = group, level, tag
        return _reduce_scatter(x, group, level, "forward", tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_gather(grad, ctx.group, ctx.level, "backward", ctx.tag), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: Any,
        level: str | None,
        tag: str | None,
    ) -> torch.Tensor:
        ctx.splits = (output_split_sizes, input_split_sizes)
        ctx.group, ctx.level, ctx.tag = group, level, tag
        return _all_to_all(x, output_split_sizes, input_split_sizes, group, level, "forward", tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_split_sizes, input_split_sizes = ctx.splits
        # The reverse exchange: what arrived from rank j goes back to rank j.
        grad_in = _all_to_all(grad, input_split_sizes, output_split_sizes, ctx.group, ctx.level, "backward", ctx.tag)
        return grad_in, None, None, None, None, None


def forward_allgather_backward_reducescatter(
    x: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> torch.Tensor:
    """All-gather ``(n, *) -> (d * n, *)`` in rank order; backward reduce-scatters the gradient with SUM.

    Every rank must pass the same ``n``. Sends per rank: forward ``(d - 1) * n`` rows; backward ``(d - 1) * n``
    gradient rows (reduce-scatter of ``d * n`` rows).

    Args:
        x: this rank's rows.
        group: process group (default: the world).
        level: explicit ledger level label (e.g. ``"ep"``); by default derived from the group's ranks.
        tag: ledger label of the call site.
    """
    return _AllGatherReduceScatter.apply(x, group, level, tag)


def forward_reducescatter_backward_allgather(
    x: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> torch.Tensor:
    """Reduce-scatter (SUM) ``(d * n, *) -> (n, *)``, rank ``i`` keeping block ``i``; backward all-gathers.

    Sends per rank: forward ``(d - 1) * n`` rows; backward ``(d - 1) * n`` gradient rows. Arguments as in
    :func:`forward_allgather_backward_reducescatter`.
    """
    return _ReduceScatterAllGather.apply(x, group, level, tag)


def forward_allgather(
    x: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> torch.Tensor:
    """All-gather ``(n, *) -> (d * n, *)`` without autograd (routing indices, masks, counts).

    Any dtype: int64 / int32 go natively; dtypes a backend cannot move are sent as raw bytes (exact).
    Sends ``(d - 1) * n`` rows per rank. The result never requires grad.
    """
    with torch.no_grad():
        return _all_gather(x.detach(), group, level, None, tag)


def all_to_all_single(
    x: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    *,
    level: str | None = None,
    tag: str | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0 with optional variable splits; differentiable (backward is the reverse all-to-all).

    Rank ``i`` sends its rows ``[sum(input_split_sizes[:j]), ... + input_split_sizes[j])`` to group rank ``j`` and
    receives ``output_split_sizes[j]`` rows from rank ``j``; ``output_split_sizes`` must equal what the peers send
    (see :func:`exchange_split_sizes`). With neither given, dim 0 is split equally. Sends every input row except
    the split kept for this rank; the backward sends every gradient row except the split received from itself.
    """
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group, level, tag)


def exchange_split_sizes(
    input_split_sizes: list[int], group: Any = None, *, level: str | None = None, tag: str | None = None
) -> list[int]:
    """The ``output_split_sizes`` matching each peer's ``input_split_sizes`` (the count exchange before an
    all-to-all dispatch). Sends ``d - 1`` int64 values per rank through an all-to-all.
    """
    return exchange_split_counts(torch.tensor(input_split_sizes), group, level=level, tag=tag)[1]


def exchange_split_counts(
    input_split_counts: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> tuple[list[int], list[int]]:
    """:func:`exchange_split_sizes` for counts that are still a tensor on the device: ``(input_split_sizes,
    output_split_sizes)`` as lists, both read back to the host in one read after the exchange (an accelerator's queue
    drains once per all-to-all dispatch, not twice). Sends ``d - 1`` int64 values per rank through an all-to-all."""
    counts = input_split_counts.to(device=_group_device(group), dtype=torch.int64)
    received = _all_to_all(counts, None, None, group, level, None, tag)
    both = torch.cat([counts, received]).tolist()  # the one host read
    return both[: counts.numel()], both[counts.numel() :]


def all_gather_into_tensor(
    x: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> torch.Tensor:
    """Plain all-gather ``(n, *) -> (d * n, *)`` (no autograd; any dtype). Sends ``(d - 1) * n`` rows per rank."""
    with torch.no_grad():
        return _all_gather(x.detach(), group, level, None, tag)


def reduce_scatter_tensor(
    x: torch.Tensor, group: Any = None, *, level: str | None = None, tag: str | None = None
) -> torch.Tensor:
    """Plain reduce-scatter (SUM) ``(d * n, *) -> (n, *)`` (no autograd). Sends ``(d - 1) / d`` of the input."""
    with torch.no_grad():
        return _reduce_scatter(x.detach(), group, level, None, tag)


def all_reduce(
    x: torch.Tensor,
    group: Any = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    level: str | None = None,
    tag: str | None = None,
) -> torch.Tensor:
    """All-reduce into a new tensor (``x`` is left untouched; no autograd). Sends ``2 (d - 1) / d`` of ``x``."""
    _check_reducible(x, "all-reduce")
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    if is_recording():
        d = dist.get_world_size(group)
        sent = ring_bytes_sent("all_reduce", d, out.numel() * out.element_size())
        record_collective("all_reduce", group, x, out, sent, level, None, tag)
    return out
