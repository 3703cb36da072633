"""Stages 2 and 3 of FastSparseMoE (Algorithm 1): token counting and index generation, plus the token gather.

Legend: S = tokens seen by this rank (after any all-gather), K = experts per token, E = experts of the layer,
NR = experts local to this rank (``n_end - n_start + 1``), RT = routed rows (local (token, k) pairs),
H = hidden size.

Algorithm 1 of the Aurora paper runs two GPU kernels over the router's ``indices`` (S, K):

* Stage 2 counts, for the local experts ``n_start <= n <= n_end`` only, how many (token, k) pairs each local
  expert receives (``token_counts``, prefix-summed into ``cum_token_counts``) and how many local experts each
  token picked (``expert_counts`` / ``cum_expert_counts``).
* Stage 3 lays the routed rows out expert by expert, tokens in order within an expert:
  ``input_indices[r]`` is the token of routed row r; ``output_indices[o]`` is the routed row of the o-th local
  (token, k) pair in token-major order (token t owns ``o`` in ``[cum_expert_counts[t], cum_expert_counts[t+1])``)
  and ``selected_expert_indices[o]`` is its k.

Here both stages are a handful of vectorised torch ops (a stable sort stands in for the per-thread counters of
the kernel and yields exactly the same layout), so they run on any device. The expert range is an argument
so that expert parallelism can gather every rank's tokens and indices and build the plan of its own experts
only; pairs outside the range (and pairs dropped by capacity, index -1) are simply not routed here.

:func:`reduce_rows_to_tokens` is the deterministic fp32 sum of routed rows back into their tokens, shared by the
combine (Stage 5) and by the backward of the token gather (Stage 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from mula_lightning.moe.router import count_per_expert


@dataclass
class DispatchPlan:
    """Everything stages 4 and 5 need to move rows between token order and expert order.

    The fields are what the forward and backward read; the rest of Algorithm 1's outputs (the per-token counts and
    the token-major pair order) are derived from ``slot_row_SK`` on first access, since no stage needs them (each
    costs a pass, and on an accelerator a launch, per MoE layer and step).

    Attributes:
        num_tokens: S.
        top_k: K.
        n_start: first local expert (global id).
        n_end: last local expert (global id, inclusive).
        token_counts: (NR,) int64, routed rows per local expert.
        cum_token_counts: (NR + 1,) int64, prefix sum of ``token_counts`` with a leading 0.
        input_indices: (RT,) int64, token of each routed row (rows grouped by expert, token order inside).
        row_slot: (RT,) int64, flat ``t * K + k`` of each routed row (to read its router weight).
        slot_row_SK: (S, K) int64, routed row of each (token, k) pair, -1 where not routed here.
        all_routed: every (token, k) pair is routed here (no drops, all experts local): reductions can skip
            the masking of non-local slots.
    """

    num_tokens: int
    top_k: int
    n_start: int
    n_end: int
    token_counts: torch.Tensor
    cum_token_counts: torch.Tensor
    input_indices: torch.Tensor
    row_slot: torch.Tensor
    slot_row_SK: torch.Tensor
    all_routed: bool

    @property
    def num_local_experts(self) -> int:
        return self.n_end - self.n_start + 1

    @property
    def num_rows(self) -> int:
        """RT, the rows the local experts compute."""
        return self.input_indices.numel()

    @property
    def offs(self) -> torch.Tensor:
        """``cum_token_counts[1:]`` as int32: the group ends ``torch._grouped_mm`` takes."""
        return self.cum_token_counts[1:].to(torch.int32)

    @cached_property
    def expert_counts(self) -> torch.Tensor:
        """(S,) int64, local experts picked by each token."""
        return (self.slot_row_SK >= 0).sum(dim=1)

    @cached_property
    def cum_expert_counts(self) -> torch.Tensor:
        """(S + 1,) int64, prefix sum of ``expert_counts`` with a leading 0."""
        return _prefix_sum(self.expert_counts)

    @cached_property
    def _local_slots(self) -> torch.Tensor:
        """Flat ``t * K + k`` of the local (token, k) pairs in token-major order, without a boolean mask (its result
        is sized by the data: a host read); a stable sort puts them first, and there are ``num_rows`` of them."""
        flat = self.slot_row_SK.reshape(-1)
        if self.all_routed:
            return torch.arange(flat.numel(), device=flat.device)
        return torch.argsort((flat < 0).to(torch.int8), stable=True)[: self.num_rows]

    @cached_property
    def output_indices(self) -> torch.Tensor:
        """(RT,) int64, routed row of each local (token, k) pair, token-major."""
        flat = self.slot_row_SK.reshape(-1)
        return flat if self.all_routed else flat.index_select(0, self._local_slots)

    @cached_property
    def selected_expert_indices(self) -> torch.Tensor:
        """(RT,) int64, k of each local (token, k) pair, token-major."""
        return torch.remainder(self._local_slots, self.top_k)


def _prefix_sum(counts: torch.Tensor) -> torch.Tensor:
    """``[0, c0, c0 + c1, ...]`` (int64), one allocation and one scan."""
    out = counts.new_zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, dim=0, out=out[1:])
    return out


def _check_range(num_experts: int, n_start: int, n_end: int) -> None:
    if not 0 <= n_start <= n_end < num_experts:
        raise ValueError(
            f"local expert range [n_start={n_start}, n_end={n_end}] must lie inside "
            f"[0, num_experts - 1 = {num_experts - 1}]"
        )


def _local_expert_ids(indices_SK: torch.Tensor, n_start: int, n_end: int) -> torch.Tensor:
    """The local id ``n - n_start`` of each pair's expert, NR (one past the last local expert) where not local."""
    local_SK = (indices_SK >= n_start) & (indices_SK <= n_end)
    return torch.where(local_SK, indices_SK - n_start, torch.full_like(indices_SK, n_end - n_start + 1))


def count_tokens(
    indices_SK: torch.Tensor, n_start: int, n_end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2 (Algorithm 1 lines 15-43): per-local-expert and per-token counts of routed pairs.

    Args:
        indices_SK: (S, K) global expert ids chosen per token; -1 (dropped) counts as not local.
        n_start: first local expert, inclusive.
        n_end: last local expert, inclusive.

    Returns:
        ``(local_expert_SK, token_counts, cum_token_counts, expert_counts, cum_expert_counts)``, where
        ``local_expert_SK`` is the local expert id of each pair and NR (one past the last) for pairs not
        routed here; the counts are as in :class:`DispatchPlan`.
    """
    num_local = n_end - n_start + 1
    local_expert_SK = _local_expert_ids(indices_SK, n_start, n_end)
    token_counts = count_per_expert(local_expert_SK, num_local)  # the non-local pairs (NR) are not counted
    expert_counts = (local_expert_SK < num_local).sum(dim=1)
    return local_expert_SK, token_counts, _prefix_sum(token_counts), expert_counts, _prefix_sum(expert_counts)


#: device types with a ``torch._assert_async`` kernel (CPU: checked at once; CUDA: failing the stream, no sync)
_ASYNC_ASSERT_DEVICES = ("cpu", "cuda")


def build_dispatch_plan(
    indices_SK: torch.Tensor,
    num_experts: int,
    n_start: int = 0,
    n_end: int | None = None,
    all_routed: bool | None = None,
    num_rows: int | None = None,
    token_counts: torch.Tensor | None = None,
) -> DispatchPlan:
    """Stages 2 and 3: the plan that routes (token, k) pairs to the local experts ``[n_start, n_end]``.

    Args:
        indices_SK: (S, K) int64 expert ids from the router (-1 for pairs dropped by capacity).
        num_experts: E, experts of the whole layer (to check the range).
        n_start: first local expert.
        n_end: last local expert, inclusive (default: the last expert).
        all_routed: pass ``True`` when the caller knows every pair is routed here (dropless routing over all
            experts); this skips a host synchronisation and, over the whole expert range, the masking of pairs
            routed elsewhere. ``None`` works it out from the counts.
        num_rows: the number of pairs routed here (RT), when the caller knows it already (the all-gather
            dispatcher learns it from its count exchange); this skips the host read of the counts. Checked on the
            device where torch has the kernel (``torch._assert_async`` on CPU and CUDA: no synchronisation; a wrong
            value fails the step).
        token_counts: the (NR,) pairs per local expert when the caller counted them already (the router counts
            every expert: a rank holding them all need not count again). Trusted as given, like ``all_routed``.

    Returns:
        The :class:`DispatchPlan`.
    """
    n_end = num_experts - 1 if n_end is None else n_end
    _check_range(num_experts, n_start, n_end)
    num_tokens, top_k = indices_SK.shape
    num_slots = num_tokens * top_k
    num_local = n_end - n_start + 1
    if all_routed and num_local == num_experts:  # every pair names a local expert: its id is its local id
        local_expert_SK = indices_SK
        if token_counts is None:
            token_counts = count_per_expert(indices_SK, num_local)
    else:
        local_expert_SK = _local_expert_ids(indices_SK, n_start, n_end)
        if token_counts is None:  # the non-local pairs (NR) are not counted
            token_counts = count_per_expert(local_expert_SK, num_local)
    cum_token_counts = _prefix_sum(token_counts)

    # Stage 3 (lines 45-72). A stable sort by local expert id keeps token order inside each expert, which is
    # the order the kernel's per-thread counters produce; non-local pairs (key NR) sort to the tail.
    order = torch.argsort(local_expert_SK.reshape(-1), stable=True)  # (S*K,) slots in routed-row order
    if all_routed:
        num_rows = num_slots
    elif num_rows is None:
        num_rows = int(cum_token_counts[-1])  # host sync, as the kernel's RT allocation
    elif cum_token_counts.device.type in _ASYNC_ASSERT_DEVICES:
        torch._assert_async(cum_token_counts[-1] == num_rows, "num_rows is not the number of pairs routed here")
    all_routed = num_rows == num_slots
    row_slot = order[:num_rows]
    input_indices = torch.div(row_slot, top_k, rounding_mode="floor")
    slot_row = torch.empty_like(order)
    slot_row[order] = torch.arange(num_slots, device=order.device)  # routed row of each slot, >= RT if not local
    if not all_routed:
        slot_row = torch.where(slot_row < num_rows, slot_row, torch.full_like(slot_row, -1))

    return DispatchPlan(
        num_tokens=num_tokens,
        top_k=top_k,
        n_start=n_start,
        n_end=n_end,
        token_counts=token_counts,
        cum_token_counts=cum_token_counts,
        input_indices=input_indices,
        row_slot=row_slot,
        slot_row_SK=slot_row.view(num_tokens, top_k),
        all_routed=all_routed,
    )


def row_chunks(num_rows: int, row_bytes: int, device: torch.device) -> list[slice]:
    """Slices of rows that keep CPU temporaries near 1 MiB.

    On CPU (glibc) an allocation of 32 MiB or more always goes to ``mmap`` and pays a page fault per 4 KiB page,
    every time, and mid-sized ones linger in the heap; chunks of about 1 MiB stay in cache, are recycled at once
    and keep the peak resident memory low (measured: larger chunks made the block's peak RSS vary by tens of MiB
    from run to run). Accelerators take one chunk: their caching allocators make temporaries cheap and every extra
    launch costs.
    """
    if device.type != "cpu" or num_rows == 0:
        return [slice(0, num_rows)]
    step = max(1, (1 << 20) // max(row_bytes, 1))
    return [slice(i, min(i + step, num_rows)) for i in range(0, num_rows, step)]


def reduce_rows_to_tokens(
    rows_RH: torch.Tensor, plan: DispatchPlan, weights_SK: torch.Tensor | None = None, method: str | None = None
) -> torch.Tensor:
    """``out[t] = sum w[t, k] * rows[r]`` over the routed rows r = (t, k) of each token (weight 1 if no weights).

    The shared reduction of the combine forward (weighted) and of the dispatch backward (unweighted). It
    accumulates in fp32 (fp64 for fp64 rows) and every token's sum has a fixed order, so results are
    bit-reproducible:

    * ``"gather"`` (accelerators): each token reads its own K rows through ``slot_row_SK`` and sums them in k order
      (no atomics). Slots not routed here are masked to exact zeros, so a non-finite row cannot leak into another
      token through ``0 * inf``.
    * ``"index_add"`` (CPU): rows are added into their token in routed-row order with ``index_add_``, which is
      sequential, hence deterministic, on CPU, and avoids the (S, K, H) gather.

    Args:
        rows_RH: (RT, H) rows in routed (expert) order.
        plan: the dispatch plan the rows follow.
        weights_SK: optional (S, K) router weights.
        method: ``"gather"`` or ``"index_add"``; default by device as above.

    Returns:
        (S, H) in the accumulation dtype.
    """
    num_tokens, top_k = plan.slot_row_SK.shape
    num_rows, hidden = rows_RH.shape
    device = rows_RH.device
    acc_dtype = torch.promote_types(rows_RH.dtype, torch.float32)
    out_SH = torch.zeros(num_tokens, hidden, dtype=acc_dtype, device=device)
    if num_rows == 0:
        return out_SH
    method = method or ("index_add" if device.type == "cpu" else "gather")
    if method == "index_add":
        weights_R = None if weights_SK is None else weights_SK.reshape(-1).index_select(0, plan.row_slot)
        for c in row_chunks(num_rows, hidden * 4, device):
            rows_CH = rows_RH[c]
            if weights_R is not None:
                rows_CH = torch.mul(rows_CH, weights_R[c].to(acc_dtype).unsqueeze(-1))  # fp32 product
            out_SH.index_add_(0, plan.input_indices[c], rows_CH.to(acc_dtype))
        return out_SH
    if method != "gather":
        raise ValueError(f"method must be 'gather' or 'index_add', got {method!r}")
    for c in row_chunks(num_tokens, top_k * hidden * 4, device):
        slots_CK = plan.slot_row_SK[c]
        rows_CKH = rows_RH.index_select(0, slots_CK.reshape(-1).clamp(min=0)).view(-1, top_k, hidden).to(acc_dtype)
        if not plan.all_routed:
            rows_CKH.masked_fill_((slots_CK < 0).unsqueeze(-1), 0.0)
        if weights_SK is None:
            torch.sum(rows_CKH, dim=1, out=out_SH[c])
        else:
            w_C1K = weights_SK[c].to(acc_dtype).unsqueeze(1)
            torch.bmm(w_C1K, rows_CKH, out=out_SH[c].unsqueeze(1))
    return out_SH
