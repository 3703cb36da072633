"""Stage 4 (grouped SwiGLU experts, grouped GEMM and its fallback) and Stage 5 (weighted combine) in isolation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.dispatch import build_dispatch_plan
from mula_lightning.moe.experts import GroupedExperts, grouped_mm, grouped_mm_available


def experts_with_weights(E, H, I, dtype=torch.float32, seed=0) -> GroupedExperts:  # noqa: E741
    experts = GroupedExperts(E, H, I, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return experts


def per_expert_loop(x_RH, gate_up, down, counts):
    """Each expert's SwiGLU on its own rows, one after the other."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = F.linear(x_RH[start : start + n], gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
        start += n
    return torch.cat(outs)


def plan_for_counts(counts):
    """A plan where token t goes to one expert, tokens already sorted by expert with the given group sizes."""
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).unsqueeze(1)
    return build_dispatch_plan(idx, len(counts))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "fallback"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7, 0], [2, 2, 2, 2]])
def test_grouped_experts_match_per_expert_loop(counts, grouped):
    """Output and gradients of the input and both weights equal a per-expert loop (fp32, rtol 1e-5); experts with
    no rows get exactly zero weight gradients; a non-contiguous incoming gradient (from ``expand``) is accepted."""
    E, H, I = len(counts), 16, 8  # noqa: E741
    experts = experts_with_weights(E, H, I)
    experts.use_grouped_mm = grouped
    x = torch.randn(sum(counts), H, requires_grad=True)
    plan = plan_for_counts(counts)
    assert plan.input_indices.tolist() == list(range(sum(counts)))
    y = experts(x, plan)
    y.sum().backward()  # the gradient of sum() is an expanded, non-contiguous tensor
    got = [y, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    w1 = experts.gate_up_proj.detach().clone().requires_grad_()
    w2 = experts.down_proj.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y_ref = per_expert_loop(xr, w1, w2, counts)
    y_ref.sum().backward()
    for a, b in zip(got, [y_ref, xr.grad, w1.grad, w2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(experts.gate_up_proj.grad[e], torch.zeros_like(experts.gate_up_proj.grad[e]))
            assert torch.equal(experts.down_proj.grad[e], torch.zeros_like(experts.down_proj.grad[e]))


def test_fallback_for_unaligned_and_fp64_operands():
    """Operands the grouped kernel cannot take (fp64; a row stride that is not a multiple of 16 bytes) are detected
    and the per-expert fallback gives the right product."""
    counts = [2, 3]
    offs = torch.tensor([2, 5], dtype=torch.int32)
    w = torch.randn(2, 6, 4)
    x64 = torch.randn(5, 6, dtype=torch.float64)
    assert not grouped_mm_available(x64, w.double())
    x_odd = torch.randn(5, 7)[:, :6]  # row stride 7 floats = 28 bytes
    assert not grouped_mm_available(x_odd, w)
    for x in (x64, x_odd):
        out = grouped_mm(x, w.to(x.dtype), offs, counts)
        torch.testing.assert_close(out, torch.cat([x[:2] @ w[0].to(x.dtype), x[2:] @ w[1].to(x.dtype)]))


@pytest.mark.parametrize("counts", [[3, 5, 4, 2], [0, 6, 1, 5], [7, 0, 0, 1], [4], [3, 3, 3]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_bmm_matches_the_per_group_loop(counts, dtype):
    """The padded batched-matmul fallback equals the per-group loop in both forms (row groups x expert weights, and
    the weight-gradient form with zero for empty groups) on fresh random operands, equal groups (no copy) included."""
    from mula_lightning.moe.experts import padded_bmm, per_group_mm

    rows = sum(counts)
    a = torch.randn(rows, 6, dtype=dtype)
    b = torch.randn(len(counts), 6, 5, dtype=dtype)
    torch.testing.assert_close(padded_bmm(a, b, counts), per_group_mm(a, b, counts))
    g = torch.randn(rows, 5, dtype=dtype)
    grad_b = padded_bmm(a.t(), g, counts)
    torch.testing.assert_close(grad_b, per_group_mm(a.t(), g, counts))
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(grad_b[e], torch.zeros_like(grad_b[e]))


def test_padded_bmm_rule_weighs_padding_against_the_calls_saved():
    """The rule pads equal groups always, many small groups of small experts despite uneven counts, and never a
    single group, empty input, or few large uneven groups (whose padding costs more than the calls saved); float64
    padding costs twice float32's."""
    from mula_lightning.moe.experts import PADDED_BMM_CALL_WORK, PADDED_BMM_COPY_WORK, padded_bmm_pays

    assert padded_bmm_pays([256] * 8, 512 * 512)  # equal: no padding at any size
    assert padded_bmm_pays([16] * 31 + [32], 128 * 128)  # 32 small groups: 496 padding rows x 16k < 31 calls
    assert not padded_bmm_pays([384] + [238] * 7, 512 * 512)  # 8 large uneven groups
    assert not padded_bmm_pays([80] + [64] * 7, 128 * 128)  # few groups: the copy alone costs more than 7 calls
    assert not padded_bmm_pays([4], 10) and not padded_bmm_pays([0, 0], 10)
    uneven_small = [16] * 31 + [48]  # 992 padding rows x 16k: pays in float32, not at float64's double cost
    assert padded_bmm_pays(uneven_small, 128 * 128) and not padded_bmm_pays(uneven_small, 128 * 128, torch.float64)
    groups, row_work = 40, 1000
    budget_rows = ((groups - 1) * PADDED_BMM_CALL_WORK - PADDED_BMM_COPY_WORK) // row_work
    at_budget = [10] * (groups - 1) + [10 + (budget_rows - 1) // (groups - 1)]
    assert padded_bmm_pays(at_budget, row_work)
    assert not padded_bmm_pays([10] * (groups - 1) + [10 + budget_rows // (groups - 1) + 1], row_work)


@pytest.mark.parametrize("use_padded", [True, False], ids=["padded-bmm", "loop"])
def test_grouped_swiglu_fp64_with_either_fallback_matches_autograd(use_padded, monkeypatch):
    """Stage 4 in fp64 (no grouped kernel: the fallbacks) forward and every gradient equal plain autograd over a
    per-expert SwiGLU, with the padded batched matmul forced on and off."""
    import mula_lightning.moe.experts as experts_mod

    monkeypatch.setattr(experts_mod, "padded_bmm_pays", lambda counts, row_work, dtype: use_padded)
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    plan = build_dispatch_plan(idx, 4, 0, 3)
    counts = plan.token_counts.tolist()
    experts = experts_with_weights(4, 4, 3, dtype=torch.float64)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w1 = experts.gate_up_proj.detach().requires_grad_()
    w2 = experts.down_proj.detach().requires_grad_()
    y = experts_mod.GroupedSwiGLU.apply(x, w1, w2, plan, counts, True, False)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w1, w2), grad)
    x_ref, w1_ref, w2_ref = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    rows = x_ref[plan.input_indices]
    pieces, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (rows[start : start + n] @ w1_ref[e].t()).chunk(2, dim=-1)
        pieces.append((F.silu(gate) * up) @ w2_ref[e].t())
        start += n
    y_ref = torch.cat(pieces)
    want = torch.autograd.grad(y_ref, (x_ref, w1_ref, w2_ref), grad)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n_start,n_end,drop", [(0, 3, 0.0), (1, 2, 0.3)])
def test_grouped_experts_fp64_gradcheck(n_start, n_end, drop):
    """The hand-written backward of Stage 4 (token gather, grouped SwiGLU, reduction of the input gradient back to
    tokens) passes gradcheck in fp64 (fallback GEMMs), also for a local expert range with dropped pairs."""
    from mula_lightning.moe.experts import GroupedSwiGLU

    gen = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    idx[torch.rand(6, 2, generator=gen) < drop] = -1
    plan = build_dispatch_plan(idx, 4, n_start, n_end)
    counts = plan.token_counts.tolist()
    experts = experts_with_weights(n_end - n_start + 1, 4, 3, dtype=torch.float64)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w1 = experts.gate_up_proj.detach().requires_grad_()
    w2 = experts.down_proj.detach().requires_grad_()
    torch.autograd.gradcheck(lambda *a: GroupedSwiGLU.apply(*a, plan, counts, True, False), (x, w1, w2))


def algorithm1_combine(mlp_out, weights, plan, out_grad):
    """Algorithm 1 lines 82-113 as written: the forward per (t, h), the backward per routed row."""
    T, H = plan.num_tokens, mlp_out.shape[1]
    output = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        base = int(plan.cum_expert_counts[t])
        for i in range(int(plan.cum_expert_counts[t + 1]) - base):
            k = int(plan.selected_expert_indices[base + i])
            index = int(plan.output_indices[base + i])
            output[t] += weights[t, k] * mlp_out[index]
    mlp_out_grad = torch.zeros_like(mlp_out)
    weights_grad = torch.zeros_like(weights)
    for rt in range(plan.num_rows):
        o_ind = int(plan.output_indices[rt])
        t = int(plan.input_indices[o_ind])
        k = int(plan.selected_expert_indices[rt])
        mlp_out_grad[o_ind] = weights[t, k] * out_grad[t]
        weights_grad[t, k] = (mlp_out[o_ind] * out_grad[t]).sum()
    return output, mlp_out_grad, weights_grad


@pytest.mark.parametrize("n_start,n_end,drop", [(0, 7, 0.0), (0, 7, 0.3), (3, 5, 0.0)])
def test_combine_matches_algorithm1(n_start, n_end, drop):
    """The combine forward and backward equal Algorithm 1's loops (lines 82-113) in fp64, for all experts, with
    dropped pairs and for a local expert range (pairs elsewhere get zero weight gradient)."""
    T, K, E, H = 11, 3, 8, 5
    gen = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=gen) < drop] = -1
    plan = build_dispatch_plan(idx, E, n_start, n_end)
    mlp_out = torch.randn(plan.num_rows, H, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    out_grad = torch.randn(T, H, dtype=torch.float64)
    out = combine_expert_outputs(mlp_out, weights, plan)
    out.backward(out_grad)
    ref_out, ref_mlp_grad, ref_w_grad = algorithm1_combine(mlp_out.detach(), weights.detach(), plan, out_grad)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(mlp_out.grad, ref_mlp_grad)
    torch.testing.assert_close(weights.grad, ref_w_grad)
    torch.autograd.gradcheck(lambda m, w: combine_expert_outputs(m, w, plan), (mlp_out, weights))


def test_combine_masks_rows_of_other_slots():
    """A non-finite value in a routed row only reaches the tokens routed to it (masked slots add exact zeros)."""
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    plan = build_dispatch_plan(idx, 2)
    mlp_out = torch.ones(plan.num_rows, 3)
    mlp_out[0] = float("inf")  # row of (token 0, expert 0)
    out = combine_expert_outputs(mlp_out, torch.ones(3, 2), plan)
    assert torch.isinf(out[0]).all() and torch.isfinite(out[1:]).all() and out[2].eq(0).all()


@pytest.mark.parametrize("method", ["gather", "index_add"])
@pytest.mark.parametrize("n_start,n_end,drop", [(0, 7, 0.0), (0, 7, 0.3), (3, 5, 0.0)])
def test_both_reduction_methods_match_a_loop(method, n_start, n_end, drop):
    """The two reduction strategies (per-token gather, the accelerator default; ``index_add_`` in routed order, the
    CPU default) both compute ``out[t] = sum w[t, k] * rows[r(t, k)]`` over the routed pairs, in fp32 from bf16."""
    from mula_lightning.moe.dispatch import reduce_rows_to_tokens

    T, K, E, H = 13, 3, 8, 6
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=gen) < drop] = -1
    plan = build_dispatch_plan(idx, E, n_start, n_end)
    rows = torch.randn(plan.num_rows, H, generator=gen).to(torch.bfloat16)
    weights = torch.rand(T, K, generator=gen)
    expected = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            r = int(plan.slot_row_SK[t, k])
            if r >= 0:
                expected[t] += weights[t, k] * rows[r].float()
    out = reduce_rows_to_tokens(rows, plan, weights, method=method)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    unweighted = reduce_rows_to_tokens(rows, plan, None, method=method)
    torch.testing.assert_close(unweighted, reduce_rows_to_tokens(rows, plan, torch.ones(T, K), method=method))


@pytest.mark.parametrize("counts", [[3, 0, 4, 0], [0, 6, 1, 5], [2, 2, 2, 2]])
def test_device_group_sizes_give_the_host_sizes_results_without_reading_them(counts, monkeypatch):
    """``grouped_mm`` given the plan's sizes as a device tensor (``GroupSizes``, what an accelerator step passes)
    equals the same call with host sizes in both forms, with the weight gradients of empty groups zero (kernel
    garbage first poisoned with NaN); the sizes are never read to the host while the grouped kernel runs, and are
    read once when a fallback needs them."""
    from mula_lightning.moe.experts import GroupSizes

    rows = sum(counts)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a, b = torch.randn(rows, 16), torch.randn(len(counts), 16, 8)
    g = torch.randn(rows, 8)
    assert grouped_mm_available(a, b) and grouped_mm_available(a.t(), g)
    sizes = GroupSizes(torch.tensor(counts))
    torch.testing.assert_close(grouped_mm(a, b, offs, sizes), grouped_mm(a, b, offs, counts), rtol=0, atol=0)
    host_grad = grouped_mm(a.t(), g, offs, counts)
    from mula_lightning.moe import experts as experts_module

    real = experts_module._GROUPED_MM

    def poisoned(x, y, offs):  # what an uninitialised output may hold in the empty groups
        out = real(x, y, offs=offs)
        for e, n in enumerate(counts):
            if n == 0:
                out[e] = float("nan")
        return out

    monkeypatch.setattr(experts_module, "_GROUPED_MM", poisoned)
    device_grad = grouped_mm(a.t(), g, offs, sizes)
    monkeypatch.undo()
    torch.testing.assert_close(device_grad, host_grad, rtol=0, atol=0)
    assert not sizes.read_to_host  # never synchronised
    fallback = grouped_mm(a, b, offs, sizes, use_grouped=False)
    torch.testing.assert_close(fallback, grouped_mm(a, b, offs, counts), rtol=1e-6, atol=1e-6)
    assert sizes.read_to_host and sizes.host() == counts
