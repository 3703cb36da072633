"""The Triton kernels of the ``"triton"`` experts backend (:mod:`~mula_lightning.moe.triton_experts` calls them).

Imports Triton; kept apart so that the rest of the package imports without it. The kernels are plain functions here
and wrapped on demand: ``triton.jit`` for GPU tensors, Triton's interpreter for CPU tensors (the tests' path), so one
process can run both and no environment variable has to be set before Triton is imported. For that the kernels use
Triton's built-in operations only, not its library functions written in Triton (``tl.sigmoid``, ``tl.cdiv``,
``tl.zeros``), which the interpreter can run only when ``TRITON_INTERPRET=1`` was set before Triton was imported.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

# the combine function ``tl.sum`` reduces with, named so that ``tl.reduce`` runs it under the interpreter too
_SUM = tl.standard._sum_combine


def rows_times_weights(
    a_ptr, a_index_ptr, w_ptr, out_ptr, extra_ptr, extra2_ptr, offs_ptr, block_expert_ptr, block_row_ptr,
    row_weight_ptr, row_weight_grad_ptr, n_out, n_red, stride_a, stride_we, stride_wn, stride_wk, stride_out,
    stride_extra, stride_rwg,
    GATHER: tl.constexpr, EPILOGUE: tl.constexpr, ROW_WEIGHTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """out[r, n] = sum_k a[src(r), k] * w[e, n, k] for the rows of one row block of expert e; epilogues: see the
    module docstring (SwiGLU: w holds the gate rows, then the up rows, at n_out; dSwiGLU: extra = gate/up
    pre-activations, out = their gradients). With ROW_WEIGHTS each row's router weight rw[r] (float32) scales the
    SwiGLU output h = rw * silu(gate) * up; in dSwiGLU acc is the gradient of that scaled h, so the pre-activations'
    gradients take rw * acc and this program's columns' share of rw's gradient, sum_n acc * silu(gate) * up, goes
    to row_weight_grad[r, pid_n] (summed over the column tiles afterwards, in a fixed order: no atomics)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    row0 = tl.load(block_row_ptr + pid_m)
    end = tl.load(offs_ptr + expert)
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < end
    if GATHER:
        src = tl.load(a_index_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < n_out
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    acc_up = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for k0 in range(0, n_red, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < n_red
        a = tl.load(a_ptr + src.to(tl.int64)[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :] * stride_wk,
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, tl.trans(w), acc)
        if EPILOGUE == 1:  # the up rows sit n_out rows below the gate rows
            w_up = tl.load(w_base + (cols + n_out)[:, None] * stride_wn + ks[None, :] * stride_wk,
                           mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    mask = row_ok[:, None] & col_ok[None, :]
    out_rows = rows.to(tl.int64)[:, None]
    if EPILOGUE == 0:
        tl.store(out_ptr + out_rows * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:  # extra = pre-activations [gate | up] (RT, 2I), out = silu(gate) * up (RT, I)
        tl.store(extra_ptr + out_rows * stride_extra + cols[None, :], acc.to(extra_ptr.dtype.element_ty), mask=mask)
        tl.store(extra_ptr + out_rows * stride_extra + (cols + n_out)[None, :],
                 acc_up.to(extra_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        gate = acc.to(extra_ptr.dtype.element_ty).to(tl.float32)  # what the backward will read back
        up = acc_up.to(extra_ptr.dtype.element_ty).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        if ROW_WEIGHTS:
            h = h * tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_rows * stride_out + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # acc = dh; extra = [gate | up]; out (RT, 2I) = [dh * up * dsilu(gate) | dh * silu(gate)]
        gate = tl.load(extra_ptr + out_rows * stride_extra + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(extra_ptr + out_rows * stride_extra + (cols + n_out)[None, :], mask=mask,
                     other=0.0).to(tl.float32)  # fmt: skip
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        if ROW_WEIGHTS:  # acc = d(rw * h): rw's share from these columns, then dh = rw * acc
            # shares live per 32 columns (triton_experts.SHARE_COLUMNS), whatever BN the autotuner runs: this
            # program writes its share into the first slot of its columns and zeros into the others, so the slots
            # hold the last launch's shares only (an autotuner's benchmark runs of narrower tiles leave nothing)
            share = tl.reduce(tl.where(mask, acc * silu * up, 0.0), 1, _SUM)
            n_slots = (n_out + 31) // 32
            for j in tl.static_range(BN // 32):
                slot = pid_n * (BN // 32) + j
                value = share if j == 0 else share * 0.0
                tl.store(row_weight_grad_ptr + rows.to(tl.int64) * stride_rwg + slot, value,
                         mask=row_ok & (slot < n_slots))  # fmt: skip
            acc = acc * tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        grad_gate = acc * up * (sig + silu * (1.0 - sig))
        tl.store(out_ptr + out_rows * stride_out + cols[None, :], grad_gate.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + out_rows * stride_out + (cols + n_out)[None, :], (acc * silu).to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


def expert_weight_grads(
    a_ptr, b_ptr, b_index_ptr, out_ptr, offs_ptr, m_size, n_size, stride_a, stride_b, stride_oe, stride_om,
    GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """out[e, m, n] = sum over the rows r of expert e of a[r, m] * b[src(r), n] (zero without rows)."""
    expert = tl.program_id(0)
    tiles_n = (n_size + BN - 1) // BN
    pid = tl.program_id(1)
    ms = (pid // tiles_n) * BM + tl.arange(0, BM)
    ns = (pid % tiles_n) * BN + tl.arange(0, BN)
    m_ok, n_ok = ms < m_size, ns < n_size
    end = tl.load(offs_ptr + expert)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + tl.arange(0, BK)
        r_ok = rows < end
        if GATHER:
            src = tl.load(b_index_ptr + rows, mask=r_ok, other=0)
        else:
            src = rows
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + ms[None, :], mask=r_ok[:, None] & m_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(b_ptr + src.to(tl.int64)[:, None] * stride_b + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(tl.trans(a), b, acc)
    out = out_ptr + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def combine_rows(
    y_ptr, w_ptr, slot_row_ptr, out_ptr, top_k, hidden, stride_y, stride_out, WEIGHTED: tl.constexpr,
    BH: tl.constexpr,
):  # fmt: skip
    """out[t, h] = sum over k of w[t, k] * y[slot_row[t, k], h] (float32, in k order; a slot routed elsewhere, -1,
    adds an exact 0); without WEIGHTED the rows were weighted by the experts and are only summed."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_ok = cols < hidden
    acc = tl.full((BH,), 0.0, dtype=tl.float32)
    for k in range(0, top_k):
        slot = token.to(tl.int64) * top_k + k
        row = tl.load(slot_row_ptr + slot)
        routed = row >= 0
        y = tl.load(y_ptr + tl.where(routed, row, 0).to(tl.int64) * stride_y + cols, mask=col_ok & routed, other=0.0)
        if WEIGHTED:
            acc += tl.where(routed, tl.load(w_ptr + slot).to(tl.float32), 0.0) * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def combine_rows_backward(
    y_ptr, w_ptr, row_slot_ptr, token_ptr, grad_out_ptr, grad_y_ptr, grad_w_ptr, hidden, stride_y, stride_g,
    stride_gy, WEIGHTED: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """For routed row r of (t, k): grad_y[r] = w[t, k] * grad_out[t] and grad_w[t, k] = <y[r], grad_out[t]> (float32);
    grad_y may be y itself (each block of the row is read before it is written). Without WEIGHTED (rows weighted by
    the experts) grad_y[r] = grad_out[t] and no weight gradient is formed here."""
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row)
    token = tl.load(token_ptr + row)
    dot = tl.full((), 0.0, dtype=tl.float32)
    for h0 in range(0, hidden, BH):
        cols = h0 + tl.arange(0, BH)
        col_ok = cols < hidden
        g = tl.load(grad_out_ptr + token.to(tl.int64) * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = tl.load(y_ptr + row.to(tl.int64) * stride_y + cols, mask=col_ok, other=0.0).to(tl.float32)
            dot += tl.reduce(y * g, 0, _SUM)
            g = tl.load(w_ptr + slot).to(tl.float32) * g
        tl.store(grad_y_ptr + row.to(tl.int64) * stride_gy + cols, g.to(grad_y_ptr.dtype.element_ty), mask=col_ok)
    if WEIGHTED:
        tl.store(grad_w_ptr + slot, dot)


#: tile configurations autotuned on a GPU (per output width and reduction length): columns x reduction per program of
#: the row kernel (its rows are fixed by the schedule: :data:`~mula_lightning.moe.triton_experts.GPU_BLOCK_M`), and of
#: the weight-gradient kernel, with the warps and pipeline stages Hopper-class GPUs run such tiles with
ROW_TILES = [(64, 32, 4, 4), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)]
WEIGHT_GRAD_TILES = [(64, 64, 32, 4, 4), (128, 64, 32, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3)]


@functools.cache
def kernels(interpreted: bool) -> dict[str, Any]:
    """The kernels by name: interpreted (CPU tensors: every tile size is the caller's), or compiled with
    ``triton.jit``, the two GEMM kernels autotuned over the tiles above (GPU: the caller passes the row block only)."""
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        return {
            "rows_times_weights": InterpretedFunction(rows_times_weights),
            "expert_weight_grads": InterpretedFunction(expert_weight_grads),
            "combine_rows": InterpretedFunction(combine_rows),
            "combine_rows_backward": InterpretedFunction(combine_rows_backward),
        }
    row_configs = [triton.Config({"BN": n, "BK": k}, num_warps=w, num_stages=s) for n, k, w, s in ROW_TILES]
    grad_configs = [
        triton.Config({"BM": m, "BN": n, "BK": k}, num_warps=w, num_stages=s) for m, n, k, w, s in WEIGHT_GRAD_TILES
    ]
    return {
        "rows_times_weights": triton.autotune(row_configs, key=["n_out", "n_red", "EPILOGUE", "ROW_WEIGHTS"])(
            triton.jit(rows_times_weights)
        ),
        "expert_weight_grads": triton.autotune(grad_configs, key=["m_size", "n_size"])(triton.jit(expert_weight_grads)),
        "combine_rows": triton.jit(combine_rows),
        "combine_rows_backward": triton.jit(combine_rows_backward),
    }
