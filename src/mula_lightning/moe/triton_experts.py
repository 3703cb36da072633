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

Where the router weights follow the plan's rows (the local and the all-gather dispatchers), they are applied before
the down projection: the SwiGLU epilogue writes ``w_r * silu(gate) * up``, and in the backward the dSwiGLU epilogue
forms each row's weight gradient from the columns it holds (a dot over the expert width, summed over the column tiles
in a fixed order) beside the gate and up gradients; the combine then only sums each token's rows. The all-to-all
dispatcher keeps the weights with the source tokens, so its rows are weighted by the combine as before.

Stage 5 too (:class:`TritonCombine`, used by the block's combine when its experts run here): each token gathers and
sums its K rows (weighted, unless the experts weighted them) in one program; backward, each routed row writes its
gradient and, when the combine weighted it, its router weight's.

Routing metadata stays on the device: the row blocks of every expert are laid out by :func:`row_block_schedule` with
torch ops on the device (no count is read by the host), into a grid sized from the number of rows, which the host
knows; programs past the last block return at once.

Every kernel runs on NVIDIA and Intel GPUs (Triton's XPU backend) and, on CPU tensors, under Triton's interpreter
(how the tests check them; the interpreter's bf16 ``tl.dot`` is wrong, so CPU runs take float32 and float16 only).
Accumulation is float32 in every kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mula_lightning.moe.dispatch import DispatchPlan, reduce_rows_to_tokens

#: tile sizes under the CPU interpreter (rows, output columns, reduction); every ``tl.dot`` operand is >= 16 x 16
BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32
#: rows per program on a GPU (the schedule's row block; the other tile sizes are autotuned,
#: :data:`~mula_lightning.moe.triton_kernels.ROW_TILES`)
GPU_BLOCK_M = 64
#: columns per slot of the router weights' gradient shares (the narrowest column tile, interpreter or GPU)
SHARE_COLUMNS = 32
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
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out[r] = a[a_index[r]] @ w[e]^T`` per row r of expert e (``w[e]`` itself with ``transpose_w``).

    Epilogues: :data:`EPILOGUE_SWIGLU` returns ``(h, pre)``, ``pre`` = the gate and up pre-activations (RT, 2 n_out)
    and ``h = silu(gate) * up`` (RT, n_out), ``w`` holding the gate rows then the up rows; :data:`EPILOGUE_DSWIGLU`
    returns the gradient of the pre-activations ``extra`` (RT, 2 n_out) given ``dh = a @ w^T``. With ``row_weights``
    (RT,) float32, each row's router weight: SwiGLU returns ``h = row_weights * silu(gate) * up``; dSwiGLU takes
    ``a @ w^T`` as the gradient of that ``h`` and returns ``(grad_pre, grad_row_weights)``.
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
    weighted = row_weights is not None
    # rw's gradient, one share per SHARE_COLUMNS columns (a program of BN columns writes its share into its first
    # slot and zeros into the others: every slot is written by each launch, whichever tile the autotuner chose)
    shares = torch.zeros(rows if weighted and epilogue == EPILOGUE_DSWIGLU else 0, -(-n_out // SHARE_COLUMNS),
                         dtype=torch.float32, device=a.device)  # fmt: skip
    if rows:
        tiles = {"BM": row_block(a.device), "BN": BLOCK_N, "BK": BLOCK_K}
        _launch(
            "rows_times_weights", a.device, lambda meta: (expert.numel(), -(-n_out // meta["BN"])), tiles,
            a, a_index if a_index is not None else expert, w, out, extra if extra is not None else out,
            extra if extra is not None else out, offs, expert, row,
            row_weights if weighted else out, shares if shares.numel() else out,
            n_out, n_red, a.stride(0), w.stride(0), stride_wn, stride_wk, out.stride(0),
            extra.stride(0) if extra is not None else out.stride(0), shares.stride(0),
            GATHER=a_index is not None, EPILOGUE=epilogue, ROW_WEIGHTS=weighted,
        )  # fmt: skip
    if epilogue == EPILOGUE_SWIGLU:
        return out, extra
    if weighted and epilogue == EPILOGUE_DSWIGLU:
        return out, shares.sum(1)  # the column tiles' shares in a fixed order
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
    tokens in float32 in a fixed order).

    With ``weights_SK`` (router weights indexed by the plan's slots) each row's weight is applied before the down
    projection, in the SwiGLU epilogue, and its gradient formed in the dSwiGLU epilogue of the backward (a dot over
    the expert's width, not over the hidden size as the combine's would be); the rows come out weighted, for a combine
    that only sums them.
    """

    @staticmethod
    def forward(ctx, x_SH: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, plan: DispatchPlan,
                weights_SK: torch.Tensor | None = None):  # fmt: skip
        intermediate, hidden = down_proj.shape[-1], down_proj.shape[1]
        offs = plan.offs
        schedule = row_block_schedule(offs, plan.num_rows, row_block(x_SH.device))
        x_SH = x_SH.contiguous()
        gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
        w_R = None if weights_SK is None else weights_SK.reshape(-1).index_select(0, plan.row_slot).float()
        h_RI, pre_RO = rows_times_weights(x_SH, gate_up_proj, offs, schedule, intermediate,
                                          a_index=plan.input_indices, epilogue=EPILOGUE_SWIGLU,
                                          row_weights=w_R)  # fmt: skip
        y_RH = rows_times_weights(h_RI, down_proj, offs, schedule, hidden)
        ctx.save_for_backward(x_SH, pre_RO, gate_up_proj, down_proj, offs, *schedule, w_R)
        ctx.plan, ctx.weights = plan, None if weights_SK is None else (weights_SK.shape, weights_SK.dtype)
        return y_RH

    @staticmethod
    def backward(ctx, grad_y_RH: torch.Tensor):
        x_SH, pre_RO, gate_up_proj, down_proj, offs, expert, row, w_R = ctx.saved_tensors
        plan, schedule = ctx.plan, (expert, row)
        intermediate = down_proj.shape[-1]
        grad_y_RH = grad_y_RH.contiguous()
        gate_RI, up_RI = pre_RO[:, :intermediate], pre_RO[:, intermediate:]
        h_RI = torch.nn.functional.silu(gate_RI.float()).mul_(up_RI.float())
        if w_R is not None:
            h_RI.mul_(w_R[:, None])
        grad_down = expert_weight_grads(grad_y_RH, h_RI.to(pre_RO.dtype), offs)  # (NR, H, I)
        del h_RI
        # dh = grad_y @ down_e, never stored: its epilogue writes the gate and up gradients (and the router weights')
        grad_pre_RO = rows_times_weights(grad_y_RH, down_proj, offs, schedule, intermediate, transpose_w=True,
                                         epilogue=EPILOGUE_DSWIGLU, extra=pre_RO, row_weights=w_R)  # fmt: skip
        grad_weights_SK = None
        if w_R is not None:
            grad_pre_RO, grad_w_R = grad_pre_RO
            shape, dtype = ctx.weights
            if ctx.needs_input_grad[4]:  # each routed slot written once; slots routed elsewhere or dropped: 0
                grad_weights_SK = torch.zeros(math.prod(shape), dtype=torch.float32, device=grad_w_R.device)
                grad_weights_SK.index_copy_(0, plan.row_slot, grad_w_R)
                grad_weights_SK = grad_weights_SK.view(shape).to(dtype)
        grad_x_SH = None
        if ctx.needs_input_grad[0]:
            grad_x_RH = rows_times_weights(grad_pre_RO, gate_up_proj, offs, schedule, x_SH.shape[1],
                                           transpose_w=True, out_dtype=torch.float32)  # fmt: skip
            grad_x_SH = reduce_rows_to_tokens(grad_x_RH, plan).to(x_SH.dtype)
            del grad_x_RH
        grad_gate_up = expert_weight_grads(grad_pre_RO, x_SH, offs, b_index=plan.input_indices)  # (NR, 2I, H)
        return grad_x_SH, grad_gate_up, grad_down, None, grad_weights_SK


#: hidden columns per program of the combine kernels
COMBINE_BLOCK_H = 256


class TritonCombine(torch.autograd.Function):
    """Stage 5 in two Triton kernels, the same results as
    :class:`~mula_lightning.moe.combine.CombineExpertOutputs`: forward, each token gathers its K rows and sums them
    weighted, in float32 and k order, straight from the routed rows (no (S, K, H) buffer); backward, one program per
    routed row writes its gradient (its router weight times the token's gradient) and its router weight's gradient
    (the dot of the row and the token's gradient), each slot written once. Without weights (``weights_SK`` None: the
    experts weighted the rows, :class:`TritonSwiGLU`) the rows are summed and each row's gradient is its token's."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, weights_SK: torch.Tensor | None, plan: DispatchPlan,
                reuse_dead_activations: bool):  # fmt: skip
        y_RH = y_RH.contiguous()
        weighted = weights_SK is not None
        weights_SK = weights_SK.contiguous() if weighted else y_RH.new_zeros(0)
        tokens, top_k = plan.slot_row_SK.shape
        hidden = y_RH.shape[1]
        out_SH = torch.empty(tokens, hidden, dtype=y_RH.dtype, device=y_RH.device)
        if tokens:
            block = min(COMBINE_BLOCK_H, _next_power_of_2(hidden))
            _kernels(y_RH.device.type == "cpu")["combine_rows"][(tokens, -(-hidden // block))](
                y_RH, weights_SK if weighted else y_RH, plan.slot_row_SK, out_SH, top_k, hidden, y_RH.stride(0),
                out_SH.stride(0), WEIGHTED=weighted, BH=block,
            )  # fmt: skip
        ctx.save_for_backward(y_RH if weighted else None, weights_SK)
        ctx.weighted = weighted
        ctx.plan, ctx.reuse = plan, reuse_dead_activations
        return out_SH

    @staticmethod
    def backward(ctx, grad_out_SH: torch.Tensor):
        y_RH, weights_SK = ctx.saved_tensors
        plan, weighted = ctx.plan, ctx.weighted
        grad_out_SH = grad_out_SH.contiguous()
        rows, hidden = plan.num_rows, grad_out_SH.shape[1]
        # y is dead once its rows gave their dots: with reuse its storage receives the rows' gradients
        reuse = weighted and ctx.reuse and not torch.is_grad_enabled()
        if reuse:
            grad_y_RH = y_RH
        else:
            grad_y_RH = grad_out_SH.new_empty(rows, hidden)
        grad_w = torch.zeros(weights_SK.numel(), dtype=torch.float32, device=grad_out_SH.device)  # not routed: 0
        if rows:
            block = min(COMBINE_BLOCK_H, _next_power_of_2(hidden))
            _kernels(grad_out_SH.device.type == "cpu")["combine_rows_backward"][(rows,)](
                y_RH if weighted else grad_out_SH, weights_SK if weighted else grad_out_SH, plan.row_slot,
                plan.input_indices, grad_out_SH, grad_y_RH, grad_w if weighted else grad_out_SH, hidden,
                y_RH.stride(0) if weighted else 0, grad_out_SH.stride(0), grad_y_RH.stride(0), WEIGHTED=weighted,
                BH=block,
            )  # fmt: skip
        grad_weights = None
        if weighted and ctx.needs_input_grad[1]:
            grad_weights = grad_w.view_as(weights_SK).to(weights_SK.dtype)
        return grad_y_RH, grad_weights, None, None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
