"""Stage 4 of FastSparseMoE: all local experts' SwiGLU MLPs as three grouped GEMMs.

Legend: RT = routed rows (grouped by expert), H = hidden size, I = expert intermediate size, NR = local experts.

The weights of the local experts are merged (Algorithm 1 line 76): ``gate_up_proj`` (NR, 2I, H) holds every
expert's gate rows above its up rows, ``down_proj`` (NR, H, I) every down projection (the layout of
:class:`~mula_lightning.moe.reference.ExpertWeights` and of transformers 5.x). Rows of expert e are
``[cum_token_counts[e], cum_token_counts[e+1])``, so one grouped GEMM computes all experts.

:class:`GroupedSwiGLU` is one autograd function for ``down(silu(gate x) * up x)``. Writing the backward by hand
(rather than letting autograd chain three GEMMs, a chunk and two element-wise ops) lets it

* save only the tokens and ``gate_up`` (the gathered rows and the SwiGLU output are recomputed in backward),
  less than autograd keeps;
* write the gate and up gradients straight into the storage of the dead ``gate_up`` activation (no ``cat``,
  no new (RT, 2I) buffer);
* hand ``torch._grouped_mm`` a contiguous incoming gradient (a non-contiguous one, e.g. the expanded gradient
  of a ``sum``, makes the kernel fail);
* zero the weight gradients of experts without tokens (some grouped kernels leave them uninitialised).

``torch._grouped_mm`` (``torch.nn.functional.grouped_mm`` where present) takes int32 ``offs`` = cumulative group
ends without a leading 0, has no fp64 kernel, needs 16-byte aligned strides and pointers, and leaves rows past
``offs[-1]`` uninitialised (here RT is exactly ``offs[-1]``, so there are none). When it is missing or an operand
does not qualify, :func:`grouped_mm` falls back to :func:`padded_bmm` (one batched GEMM over groups padded to the
largest) when that saves more than the padding costs (:func:`padded_bmm_pays`), else to one ``torch.mm`` per expert.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mula_lightning.moe.config import EXPERTS_BACKENDS
from mula_lightning.moe.dispatch import DispatchPlan, reduce_rows_to_tokens
from mula_lightning.moe.reference import ExpertWeights

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: what one GEMM call of the per-group loop costs beyond its arithmetic, in multiply-adds, and what copying the rows
#: into the padded layout costs: the padded batched matmul is chosen while its padding's multiply-adds plus the copy
#: cost less than the calls it saves (fitted on CPU by ``benchmarks/grouped_gemm_fallback.py``; on a GPU a call costs
#: more, so the rule errs towards the loop there)
PADDED_BMM_CALL_WORK = 1_000_000
PADDED_BMM_COPY_WORK = 6_000_000


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned data pointer and non-unit strides, as the grouped GEMM kernels require."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    return all((stride * size) % 16 == 0 for stride in t.stride() if stride != 1)


@functools.cache
def _kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` has a kernel for this device type and dtype (tried once on tiny operands: XPU
    and MPS gain kernels release by release)."""
    try:
        a = torch.zeros(8, 8, device=device_type, dtype=dtype)
        b = torch.zeros(2, 8, 8, device=device_type, dtype=dtype)
        _GROUPED_MM(a, b, offs=torch.tensor([4, 8], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_available(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can take these operands (dtype, device, alignment, non-empty)."""
    if _GROUPED_MM is None:
        return False
    first = tensors[0]
    if first.dtype not in _GROUPED_MM_DTYPES or any(t.dtype != first.dtype for t in tensors):
        return False
    if first.device.type == "cuda":
        if torch.cuda.get_device_capability(first.device) < (8, 0):
            return False
    elif first.device.type != "cpu" and not _kernel_runs(first.device.type, first.dtype):  # XPU, MPS: asked once
        return False
    return all(t.numel() > 0 and _aligned(t) for t in tensors)


class GroupSizes:
    """The rows per group (a dispatch plan's ``token_counts``), on the device, read to the host only when a path
    needs them there: the per-group fallback loop and the padded batched fallback. The grouped kernel itself takes
    the device offsets, so a step on an accelerator whose experts all run through it has no host synchronisation
    in its expert computation (``tolist()`` waits for every queued kernel)."""

    def __init__(self, sizes: torch.Tensor) -> None:
        self.tensor = sizes
        self._host: list[int] | None = None

    @property
    def read_to_host(self) -> bool:
        """Whether :meth:`host` has run (a synchronisation on an accelerator)."""
        return self._host is not None

    def host(self) -> list[int]:
        """The sizes as a host list (read once)."""
        if self._host is None:
            self._host = self.tensor.tolist()
        return self._host


def _host_sizes(counts: Sequence[int] | GroupSizes) -> list[int]:
    return counts.host() if isinstance(counts, GroupSizes) else list(counts)


def _zero_empty_groups(out: torch.Tensor, counts: Sequence[int] | GroupSizes) -> None:
    """``out[e] = 0`` for every group without rows (the grouped kernel leaves them unwritten in the weight-gradient
    form): from host sizes, touching those groups only; from :class:`GroupSizes`, by a mask of the device sizes
    (one pass over ``out`` at memory speed, no host synchronisation)."""
    if isinstance(counts, GroupSizes):
        out.masked_fill_(counts.tensor.eq(0).view(-1, *([1] * (out.dim() - 1))), 0.0)
        return
    if 0 in counts:
        out.index_fill_(0, torch.tensor([e for e, n in enumerate(counts) if n == 0], device=out.device), 0.0)


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    counts: Sequence[int] | GroupSizes,
    use_grouped: bool = True,
) -> torch.Tensor:
    """Grouped matrix product over the jagged row groups given by ``offs``.

    Two forms, as ``torch._grouped_mm``:

    * ``a`` (RT, Kd) and ``b`` (NR, Kd, N): rows of group e times ``b[e]`` -> (RT, N);
    * ``a`` (M, RT) and ``b`` (RT, N) (weight gradients): columns / rows of group e -> ``out[e]`` (NR, M, N),
      zero for groups without rows.

    Args:
        a: left operand.
        b: right operand.
        offs: (NR,) int32 cumulative group ends (no leading 0).
        counts: the NR group sizes: a host list, or :class:`GroupSizes` (read to the host only if a fallback runs).
        use_grouped: allow the grouped kernel and the padded batched fallback (``False`` forces the per-group
            loop, the reference path).
    """
    weight_grad = b.dim() == 2
    if use_grouped and grouped_mm_available(a, b):
        out = _GROUPED_MM(a, b, offs=offs)
        if weight_grad:
            _zero_empty_groups(out, counts)
        return out
    sizes = _host_sizes(counts)
    if use_grouped and padded_bmm_pays(sizes, a.shape[0 if weight_grad else 1] * b.shape[-1], a.dtype):
        return padded_bmm(a, b, sizes)
    return per_group_mm(a, b, sizes)


def padded_bmm_pays(counts: list[int], row_work: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether one padded batched matmul beats the per-group loop (the rule ``benchmarks/grouped_gemm_fallback.py``
    measures): groups of one size always (no copy, no padding); otherwise when the padding rows' multiply-adds
    (``row_work`` per row: K x N of the product) plus the copy into the padded layout cost less than the NR - 1
    calls saved. Small groups of small experts (many calls, little arithmetic each) pad; large uneven ones loop.
    Costs are in float32 multiply-adds: a float64 multiply-add and copy cost twice as much (measured), so the same
    per-call saving buys half the padding."""
    groups, rows = len(counts), sum(counts)
    if groups < 2 or rows == 0:
        return False
    padding_rows = groups * max(counts) - rows
    if padding_rows == 0:
        return True
    scale = 2 if dtype == torch.float64 else 1
    return scale * (padding_rows * row_work + PADDED_BMM_COPY_WORK) < (groups - 1) * PADDED_BMM_CALL_WORK


def _padded_slots(counts: list[int], device: torch.device) -> torch.Tensor:
    """Slot of every row in the ``(NR * C)`` padded layout: row s of group e goes to ``e * C + s``, C the largest
    group."""
    sizes = torch.tensor(counts, device=device)
    group_start = torch.cumsum(sizes, 0) - sizes
    shift = torch.arange(len(counts), device=device) * max(counts) - group_start
    return torch.arange(sum(counts), device=device) + torch.repeat_interleave(shift, sizes, output_size=sum(counts))


def _pad_rows(rows_RK: torch.Tensor, slots: torch.Tensor | None, groups: int, capacity: int) -> torch.Tensor:
    """``(NR, C, K)`` view of the rows with each group starting at its own block (zero rows after its end)."""
    if slots is None:  # every group is full: the rows already are the padded layout
        return rows_RK.reshape(groups, capacity, rows_RK.shape[1])
    padded = rows_RK.new_zeros(groups * capacity, rows_RK.shape[1])
    return padded.index_copy_(0, slots, rows_RK).view(groups, capacity, rows_RK.shape[1])


def padded_bmm(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """:func:`grouped_mm` as one ``torch.bmm`` over groups padded with zero rows to the largest group.

    The fallback where no grouped kernel exists (XPU, MPS, float64): one batched GEMM instead of NR small ones, at
    the price of one copy of the rows into the padded layout (none when every group has the same size) and the
    padding's multiply-adds. The padded rows are zeros, so every real output equals the per-group product's and the
    weight gradients of empty groups are zero.
    """
    groups, capacity = len(counts), max(counts)
    slots = None if min(counts) == capacity else _padded_slots(counts, a.device)
    if b.dim() == 2:  # weight gradients: a (M, RT) (a transposed view in practice), b (RT, N) -> (NR, M, N)
        a_pad = _pad_rows(a.t(), slots, groups, capacity)  # (NR, C, M)
        return torch.bmm(a_pad.transpose(1, 2), _pad_rows(b, slots, groups, capacity))
    out = torch.bmm(_pad_rows(a, slots, groups, capacity), b).view(groups * capacity, b.shape[-1])  # a (RT, K)
    return out if slots is None else out.index_select(0, slots)


def per_group_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """:func:`grouped_mm` as one ``torch.mm`` per group (the obviously-right loop; also the fallback when padding
    would waste too much)."""
    if b.dim() == 2:
        out = a.new_zeros(len(counts), a.shape[0], b.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(a[:, start : start + n], b[start : start + n], out=out[e])
            start += n
        return out
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start : start + n], b[e], out=out[start : start + n])
        start += n
    return out


class GroupedSwiGLU(torch.autograd.Function):
    """Stage 4: ``y[r] = down_e(silu(gate_e x[t]) * up_e x[t])`` for every routed row r = (t, k) of local expert e.

    Takes the tokens (S, H) rather than the gathered rows: the gather ``x[input_indices]`` (Algorithm 1 line 75)
    happens inside, and is redone in backward instead of keeping an (RT, H) copy of the input alive between
    forward and backward. The input gradient is reduced back to tokens here too (fp32, deterministic).
    """

    @staticmethod
    def forward(ctx, x_SH, gate_up_proj, down_proj, plan, counts, use_grouped, reuse_dead_activations):
        intermediate = down_proj.shape[-1]
        offs = plan.offs
        x_RH = x_SH.index_select(0, plan.input_indices)  # line 75
        gate_up_RO = grouped_mm(x_RH, gate_up_proj.transpose(1, 2), offs, counts, use_grouped)  # (RT, 2I), l. 76-77
        del x_RH
        gate_RI, up_RI = gate_up_RO[:, :intermediate], gate_up_RO[:, intermediate:]
        h_RI = F.silu(gate_RI).mul_(up_RI)  # line 78
        y_RH = grouped_mm(h_RI, down_proj.transpose(1, 2), offs, counts, use_grouped)  # line 79
        ctx.save_for_backward(x_SH, gate_up_RO, gate_up_proj, down_proj, offs)
        ctx.plan, ctx.counts, ctx.use_grouped, ctx.reuse = plan, counts, use_grouped, reuse_dead_activations
        return y_RH

    @staticmethod
    def backward(ctx, grad_y_RH):
        x_SH, gate_up_RO, gate_up_proj, down_proj, offs = ctx.saved_tensors
        plan, counts, use_grouped = ctx.plan, ctx.counts, ctx.use_grouped
        intermediate = down_proj.shape[-1]
        grad_y_RH = grad_y_RH.contiguous()  # the grouped kernel rejects e.g. the expanded gradient of a sum
        gate_RI, up_RI = gate_up_RO[:, :intermediate], gate_up_RO[:, intermediate:]

        # Recompute h = silu(gate) * up in one buffer (silu itself is recomputed again below: one more pass, one
        # (RT, I) buffer less alive at the backward's peak).
        h_RI = torch.ops.aten.silu.out(gate_RI, out=torch.empty_like(up_RI)).mul_(up_RI)
        grad_down = grouped_mm(grad_y_RH.t(), h_RI, offs, counts, use_grouped)  # (NR, H, I)
        grad_h_RI = grouped_mm(grad_y_RH, down_proj, offs, counts, use_grouped)  # (RT, I)

        # gate_up is dead after this point: with reuse its storage receives the gradient (saves an (RT, 2I)
        # allocation; a second backward through the same graph then fails loudly on autograd's version check).
        reuse = ctx.reuse and not torch.is_grad_enabled()
        grad_gate_up_RO = gate_up_RO if reuse else torch.empty_like(gate_up_RO)
        grad_gate_RI, grad_up_RI = grad_gate_up_RO[:, :intermediate], grad_gate_up_RO[:, intermediate:]
        grad_h_up_RI = torch.mul(grad_h_RI, up_RI, out=h_RI)  # h is no longer needed: d(silu(gate))
        torch.ops.aten.silu.out(gate_RI, out=grad_up_RI).mul_(grad_h_RI)  # d(up) = dh * silu(gate)
        del grad_h_RI
        torch.ops.aten.silu_backward.grad_input(grad_h_up_RI, gate_RI, grad_input=grad_gate_RI)
        del grad_h_up_RI, h_RI

        grad_x_SH = None
        if ctx.needs_input_grad[0]:  # before the weight gradient, so that the two (RT, H) buffers never coexist
            grad_x_RH = grouped_mm(grad_gate_up_RO, gate_up_proj, offs, counts, use_grouped)  # (RT, H)
            grad_x_SH = reduce_rows_to_tokens(grad_x_RH, plan).to(x_SH.dtype)
            del grad_x_RH
        # The gathered rows are recomputed (cheaper than keeping them); with reuse they go into the incoming
        # gradient's storage, dead by now and of the same shape.
        x_RH = grad_y_RH if reuse and grad_y_RH.dtype == x_SH.dtype else None
        x_RH = torch.index_select(x_SH, 0, plan.input_indices, out=x_RH)
        grad_gate_up = grouped_mm(grad_gate_up_RO.t(), x_RH, offs, counts, use_grouped)  # (NR, 2I, H)
        return grad_x_SH, grad_gate_up, grad_down, None, None, None, None


def resolve_experts_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that computes the experts for tensors on ``device`` of ``dtype``: ``"grouped_mm"`` or
    ``"triton"``.

    ``"auto"`` resolves to ``"grouped_mm"`` everywhere for now: the Triton kernels are checked on the CPU (Triton's
    interpreter) and compiled for an H100 without one, but no GPU has measured them against ``torch._grouped_mm`` yet,
    and the default follows a measurement (BENCHMARKS.md), not a hope. ``"triton"`` asks for them explicitly.

    Raises:
        ValueError: ``"triton"`` where the kernels cannot run (no Triton, a device without a Triton backend, float64,
            bf16 under the CPU interpreter), in one line naming why.
    """
    if backend == "triton":
        from mula_lightning.moe.triton_experts import triton_unavailable_reason

        reason = triton_unavailable_reason(device, dtype)
        if reason is not None:
            raise ValueError(f"experts_backend='triton' cannot compute these experts: {reason}")
        return "triton"
    if backend not in EXPERTS_BACKENDS:
        raise ValueError(f"experts_backend ({backend!r}) must be one of {EXPERTS_BACKENDS}")
    return "grouped_mm"


class GroupedExperts(ExpertWeights):
    """The merged expert weights with a grouped-GEMM forward over the routed rows of a dispatch plan.

    Same parameters and names as :class:`~mula_lightning.moe.reference.ExpertWeights` (``gate_up_proj``,
    ``down_proj``), so state dicts are interchangeable with the reference block and with transformers.

    Args:
        use_grouped_mm: use ``torch._grouped_mm`` when the operands allow it (``False`` always takes the
            per-expert fallback; tests compare the two).
        reuse_dead_activations: let the backward write into the storage of tensors it no longer needs: the saved
            ``gate_up`` activation and the incoming gradient (less memory, fewer page faults on CPU). Only for a
            caller that owns that gradient, as :class:`~mula_lightning.moe.block.FastSparseMoEBlock` does (it comes
            from its combine); the graph can then be backpropagated once only (a second backward raises
            autograd's in-place error).
        experts_backend: ``"auto"``, ``"grouped_mm"`` or ``"triton"`` (:func:`resolve_experts_backend`); with
            ``"triton"`` the fused kernels of :mod:`~mula_lightning.moe.triton_experts` compute the rows.
    """

    def __init__(
        self,
        *args,
        use_grouped_mm: bool = True,
        reuse_dead_activations: bool = False,
        experts_backend: str = "auto",
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.use_grouped_mm = use_grouped_mm
        self.reuse_dead_activations = reuse_dead_activations
        if experts_backend not in EXPERTS_BACKENDS:
            raise ValueError(f"experts_backend ({experts_backend!r}) must be one of {EXPERTS_BACKENDS}")
        self.experts_backend = experts_backend

    def forward(self, x_SH: torch.Tensor, plan: DispatchPlan, weights_SK: torch.Tensor | None = None) -> torch.Tensor:
        """Every routed row of the plan through its local expert.

        Args:
            x_SH: (S, H) tokens.
            plan: the dispatch plan (rows of local expert e are ``[cum_token_counts[e], cum_token_counts[e+1])``).
            weights_SK: router weights indexed by the plan's slots, applied to each row before the down projection
                (the Triton backend only); the combine then only sums the rows.

        Returns:
            (RT, H) expert outputs in routed order, in the weights' dtype.
        """
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        if x_SH.dtype != gate_up_proj.dtype:  # autocast or mixed inputs: compute in the weights' dtype
            x_SH = x_SH.to(gate_up_proj.dtype)
        triton = resolve_experts_backend(self.experts_backend, x_SH.device, x_SH.dtype) == "triton"
        if weights_SK is not None and not triton:
            raise ValueError("only the Triton experts backend applies the router weights inside the experts")
        if plan.num_rows == 0:  # no rows: keep the weights (and router weights) in the graph with zero gradients
            anchor = gate_up_proj.sum() + down_proj.sum() + x_SH.sum()
            if weights_SK is not None:
                anchor = anchor + weights_SK.sum()
            return x_SH.new_zeros(0, self.hidden_size) + 0.0 * anchor
        if triton:
            from mula_lightning.moe.triton_experts import TritonSwiGLU

            return TritonSwiGLU.apply(x_SH, gate_up_proj, down_proj, plan, weights_SK)
        # host sizes on CPU (reading them costs nothing there, and they let the weight gradients' fix-up touch only
        # the empty experts); on an accelerator they stay on the device unless a fallback needs them
        counts = plan.token_counts.tolist() if x_SH.device.type == "cpu" else GroupSizes(plan.token_counts)
        return GroupedSwiGLU.apply(
            x_SH, gate_up_proj, down_proj, plan, counts, self.use_grouped_mm, self.reuse_dead_activations
        )
