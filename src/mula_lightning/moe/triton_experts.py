"""Stage 4 of FastSparseMoE as fused Triton kernels: the ``"triton"`` experts backend.

Legend: S = tokens, RT = routed rows (grouped by expert), H = hidden, I = expert intermediate, NR = local experts,
BM / BN / BK = tile sizes (rows, output columns, reduction).

The same computation as :class:`~mula_lightning.moe.experts.GroupedSwiGLU`, ``y[r] = down_e(silu(gate_e x[t]) *
up_e x[t])`` for every routed row r = (t, k) of local expert e, in three kernels instead of a gather, three grouped
GEMMs and four element-wise passes:

* :func:`rows_times_weights` (forward, twice; backward, twice): a grouped GEMM over the row blocks of each expert,
  ``out[r] = a[rows(r)] @ w[e]^T`` with the row gather (``x[input_indices]``) done inside its loads, never
  materialised. Its epilogue is chosen at compile time: plain; SwiGLU (forward of the gate / up projection: both
  halves are accumulated by one program and ``silu(gate) * up`` is written next to the pre-activations the backward
  needs); dSwiGLU (backward of the down projection: the input gradient ``dh`` never leaves the registers, the gate and
  up gradients are written instead).
* :func:`expert_weight_grads`: per expert, ``sum_r a[r]^T b[rows(r)]`` over its rows, gathered rows included; an
  expert without rows gets zeros.

Stage 5 too (:class:`TritonCombine`, used by the block's combine when its experts run here): each token gathers and
sums its K weighted rows in one program; backward, each routed row writes its gradient and its router weight's.

Routing metadata stays on the device: the row blocks of every expert are laid out by :func:`row_block_schedule` with
torch ops on the device (no count is read by the host), into a grid sized from the number of rows, which the host
knows; programs past the last block return at once.

Every kernel runs on NVIDIA and Intel GPUs (Triton's XPU backend) and, on CPU tensors, under Triton's interpreter
(how the tests check them; the interpreter's bf16 ``tl.dot`` is wrong, so CPU runs take float32 and float16 only).
Accumulation is float32 in every kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from mula_lightning.moe.dispatch import DispatchPlan, reduce_rows_to_tokens

#: tile sizes under the CPU interpreter (rows, output columns, reduction); every ``tl.dot`` operand is >= 16 x 16
BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32
#: rows per program on a GPU (the schedule's row block; the other tile sizes are autotuned,
#: :data:`~mula_lightning.moe.triton_kernels.ROW_TILES`)
GPU_BLOCK_M = 64
EPILOGUE_PLAIN, EPILOGUE_SWIGLU, EPILOGUE_DSWIGLU = 0, 1, 2
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton backend cannot run on ``device`` with ``dtype`` (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu":
        if dtype not in INTERPRETER_DTYPES:
            return f"on the CPU the Triton interpreter computes float32 and float16 only, not {dtype}"
        return None
    if device.type not in ("cuda", "xpu"):
        return f"Triton has no backend for {device.type} devices"
    if dtype not in TRITON_DTYPES:
        return f"the Triton kernels take float32, float16 and bfloat16, not {dtype}"
    return None


def _kernels(interpreted: bool) -> dict[str, Any]:
    """The kernels (:mod:`~mula_lightning.moe.triton_kernels`), imported on first use so that importing this module
    needs no Triton."""
    from mula_lightning.moe.triton_kernels import kernels

    return kernels(interpreted)


def row_block(device: torch.device) -> int:
    """Rows per program of the row kernel (the schedule's block) on ``device``."""
    return BLOCK_M if device.type == "cpu" else GPU_BLOCK_M


def _launch(name: str, device: torch.device, grid: Any, tiles: dict[str, int], *args: Any, **constexprs: Any):
    """Run kernel ``name``: under the interpreter with the CPU tiles (``grid(tiles)``), on a GPU autotuned (``grid``
    of the chosen configuration; only the row block, if any, is fixed)."""
    if device.type == "cpu":
        _kernels(True)[name][grid(tiles)](*args, **constexprs, **tiles)
    else:
        fixed = {"BM": tiles["BM"]} if name == "rows_times_weights" else {}
        _kernels(False)[name][grid](*args, **constexprs, **fixed)


def row_block_schedule(offs: torch.Tensor, num_rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of every row block of every expert, on the device, in a grid of ``num_rows / block_m +
    experts`` blocks (an upper bound the host knows without reading the counts); blocks past the last real one get
    the last expert and its end row (their programs return at once).

    Args:
        offs: (NR,) int32 cumulative row ends per expert (no leading 0).
        num_rows: RT, the routed rows.
    """
    experts = offs.numel()
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    blocks = (ends - starts + block_m - 1) // block_m
    cum = torch.cumsum(blocks, 0)
    grid = -(-num_rows // block_m) + experts
    b = torch.arange(grid, device=offs.device)
    expert = torch.searchsorted(cum, b, right=True).clamp_(max=experts - 1)
    row = starts[expert] + (b - (cum[expert] - blocks[expert])) * block_m
    row = torch.where(b < cum[-1], row, ends[-1])
    return expert.to(torch.int32), row.to(torch.int32)


def rows_times_weights(
    a: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    schedule: tuple[torch.Tensor, torch.Tensor],
    n_out: int,
    transpose_w: bool = False,
    a_index: torch.Tensor | None = None,
    epilogue: int = EPILOGUE_PLAIN,
    extra: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out[r] = a[a_index[r]] @ w[e]^T`` per row r of expert e (``w[e]`` itself with ``transpose_w``).

    Epilogues: :data:`EPILOGUE_SWIGLU` returns ``(h, pre)``, ``pre`` = the gate and up pre-activations (RT, 2 n_out)
    and ``h = silu(gate) * up`` (RT, n_out), ``w`` holding the gate rows then the up rows; :data:`EPILOGUE_DSWIGLU`
    returns the gradient of the pre-activations ``extra`` (RT, 2 n_out) given ``dh = a @ w^T``.
    """
    rows = a.shape[0] if a_index is None else a_index.numel()
    dtype = out_dtype or a.dtype
    if epilogue == EPILOGUE_DSWIGLU:
        out = torch.empty(rows, 2 * n_out, dtype=dtype, device=a.device)
    else:
        out = torch.empty(rows, n_out, dtype=dtype, device=a.device)
    if epilogue == EPILOGUE_SWIGLU:
        extra = torch.empty(rows, 2 * n_out, dtype=dtype, device=a.device)
    stride_wn, stride_wk = (w.stride(2), w.stride(1)) if transpose_w else (w.stride(1), w.stride(2))
    n_red = w.shape[1] if transpose_w else w.shape[2]
    expert, row = schedule
    if rows:
        tiles = {"BM": row_block(a.device), "BN": BLOCK_N, "BK": BLOCK_K}
        _launch(
            "rows_times_weights", a.device, lambda meta: (expert.numel(), -(-n_out // meta["BN"])), tiles,
            a, a_index if a_index is not None else expert, w, out, extra if extra is not None else out,
            extra if extra is not None else out, offs, expert, row,
            n_out, n_red, a.stride(0), w.stride(0), stride_wn, stride_wk, out.stride(0),
            extra.stride(0) if extra is not None else out.stride(0),
            GATHER=a_index is not None, EPILOGUE=epilogue,
        )  # fmt: skip
    if epilogue == EPILOGUE_SWIGLU:
        return out, extra
    return out


def expert_weight_grads(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    b_index: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[e] = a[rows_e]^T @ b[b_index[rows_e]]`` (NR, M, N): the weight gradient of every expert, zero for an
    expert without rows."""
    experts, m_size, n_size = offs.numel(), a.shape[1], b.shape[1]
    out = torch.empty(experts, m_size, n_size, dtype=out_dtype or a.dtype, device=a.device)
    tiles = {"BM": BLOCK_M, "BN": BLOCK_N, "BK": BLOCK_K}
    _launch(
        "expert_weight_grads", a.device, lambda meta: (experts, -(-m_size // meta["BM"]) * -(-n_size // meta["BN"])),
        tiles,
        a, b, b_index if b_index is not None else offs, out, offs, m_size, n_size, a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), GATHER=b_index is not None,
    )  # fmt: skip
    return out


class TritonSwiGLU(torch.autograd.Function):
    """Stage 4 in the Triton kernels; the same arguments and results as
    :class:`~mula_lightning.moe.experts.GroupedSwiGLU` (tokens in, routed rows out, the input gradient reduced back to
    tokens in float32 in a fixed order)."""

    @staticmethod
    def forward(ctx, x_SH: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, plan: DispatchPlan):
        intermediate, hidden = down_proj.shape[-1], down_proj.shape[1]
        offs = plan.offs
        schedule = row_block_schedule(offs, plan.num_rows, row_block(x_SH.device))
        x_SH = x_SH.contiguous()
        gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
        h_RI, pre_RO = rows_times_weights(x_SH, gate_up_proj, offs, schedule, intermediate,
                                          a_index=plan.input_indices, epilogue=EPILOGUE_SWIGLU)  # fmt: skip
        y_RH = rows_times_weights(h_RI, down_proj, offs, schedule, hidden)
        ctx.save_for_backward(x_SH, pre_RO, gate_up_proj, down_proj, offs, *schedule)
        ctx.plan = plan
        return y_RH

    @staticmethod
    def backward(ctx, grad_y_RH: torch.Tensor):
        x_SH, pre_RO, gate_up_proj, down_proj, offs, expert, row = ctx.saved_tensors
        plan, schedule = ctx.plan, (expert, row)
        intermediate = down_proj.shape[-1]
        grad_y_RH = grad_y_RH.contiguous()
        gate_RI, up_RI = pre_RO[:, :intermediate], pre_RO[:, intermediate:]
        h_RI = torch.nn.functional.silu(gate_RI.float()).mul_(up_RI.float()).to(pre_RO.dtype)
        grad_down = expert_weight_grads(grad_y_RH, h_RI, offs)  # (NR, H, I)
        del h_RI
        # dh = grad_y @ down_e, never stored: its epilogue writes the gate and up gradients
        grad_pre_RO = rows_times_weights(grad_y_RH, down_proj, offs, schedule, intermediate, transpose_w=True,
                                         epilogue=EPILOGUE_DSWIGLU, extra=pre_RO)  # fmt: skip
        grad_x_SH = None
        if ctx.needs_input_grad[0]:
            grad_x_RH = rows_times_weights(grad_pre_RO, gate_up_proj, offs, schedule, x_SH.shape[1],
                                           transpose_w=True, out_dtype=torch.float32)  # fmt: skip
            grad_x_SH = reduce_rows_to_tokens(grad_x_RH, plan).to(x_SH.dtype)
            del grad_x_RH
        grad_gate_up = expert_weight_grads(grad_pre_RO, x_SH, offs, b_index=plan.input_indices)  # (NR, 2I, H)
        return grad_x_SH, grad_gate_up, grad_down, None


#: hidden columns per program of the combine kernels
COMBINE_BLOCK_H = 256


class TritonCombine(torch.autograd.Function):
    """Stage 5 in two Triton kernels, the same results as
    :class:`~mula_lightning.moe.combine.CombineExpertOutputs`: forward, each token gathers its K rows and sums them
    weighted, in float32 and k order, straight from the routed rows (no (S, K, H) buffer); backward, one program per
    routed row writes its gradient (its router weight times the token's gradient) and its router weight's gradient
    (the dot of the row and the token's gradient), each slot written once."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, weights_SK: torch.Tensor, plan: DispatchPlan, reuse_dead_activations: bool):
        y_RH, weights_SK = y_RH.contiguous(), weights_SK.contiguous()
        tokens, top_k = plan.slot_row_SK.shape
        hidden = y_RH.shape[1]
        out_SH = torch.empty(tokens, hidden, dtype=y_RH.dtype, device=y_RH.device)
        if tokens:
            block = min(COMBINE_BLOCK_H, _next_power_of_2(hidden))
            _kernels(y_RH.device.type == "cpu")["combine_rows"][(tokens, -(-hidden // block))](
                y_RH, weights_SK, plan.slot_row_SK, out_SH, top_k, hidden, y_RH.stride(0), out_SH.stride(0), BH=block
            )
        ctx.save_for_backward(y_RH, weights_SK)
        ctx.plan, ctx.reuse = plan, reuse_dead_activations
        return out_SH

    @staticmethod
    def backward(ctx, grad_out_SH: torch.Tensor):
        y_RH, weights_SK = ctx.saved_tensors
        plan = ctx.plan
        grad_out_SH = grad_out_SH.contiguous()
        rows, hidden = y_RH.shape
        # y is dead once its rows gave their dots: with reuse its storage receives the rows' gradients
        reuse = ctx.reuse and not torch.is_grad_enabled()
        grad_y_RH = y_RH if reuse else torch.empty_like(y_RH)
        grad_w = torch.zeros(weights_SK.numel(), dtype=torch.float32, device=y_RH.device)  # slots not routed: 0
        if rows:
            block = min(COMBINE_BLOCK_H, _next_power_of_2(hidden))
            _kernels(y_RH.device.type == "cpu")["combine_rows_backward"][(rows,)](
                y_RH, weights_SK, plan.row_slot, plan.input_indices, grad_out_SH, grad_y_RH, grad_w, hidden,
                y_RH.stride(0), grad_out_SH.stride(0), grad_y_RH.stride(0), BH=block,
            )  # fmt: skip
        grad_weights = grad_w.view_as(weights_SK).to(weights_SK.dtype) if ctx.needs_input_grad[1] else None
        return grad_y_RH, grad_weights, None, None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
