"""The ``"triton"`` experts backend against slow, obviously-right references, on the CPU under Triton's interpreter.

The kernels (:mod:`mula_lightning.moe.triton_experts`) replace the gather, three grouped GEMMs and the SwiGLU passes
of stage 4. Checked here, on fresh random inputs, forward and every gradient:

* the whole block (``FastSparseMoEBlock(experts_backend="triton")``) against :class:`ReferenceMoEBlock`, the
  per-expert loop, in float64 (the reference) vs float32 and float16 (the kernels; the interpreter's bf16 ``tl.dot``
  is wrong, Triton issue 11584): input, router, gate/up and down weights, shared experts;
* the expert stage alone against the per-expert loop on routings built to be awkward: sizes that are multiples of no
  tile size, experts without tokens, every token on one expert, K = 1 and K = E, a local expert range with pairs
  dropped by capacity;
* that the checks see a kernel that loses a row block or reads the wrong rows for a weight gradient;
* that the kernels compile for an H100 (sm_90, bf16) without a GPU, and that an impossible request is refused.

Tiny shapes: the interpreter runs every program of the grid in Python.
"""

import pytest
import torch

from mula_lightning.moe import MoEConfig
from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.dispatch import build_dispatch_plan
from mula_lightning.moe.experts import GroupedSwiGLU
from mula_lightning.moe.reference import ReferenceMoEBlock

pytest.importorskip("triton")

#: (rtol, atol as a fraction of the reference's largest magnitude): float16 rounds the kernels' inputs, the stored
#: pre-activations and the pre-activation gradients (relative 2^-11 each) and sums over up to a few hundred products;
#: a lost or doubled row changes elements by the tensor's own scale
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 2e-3)}


def _close(got, want, dtype, msg):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * max(want.abs().max().item(), 1e-6), msg=msg)


def _loop_reference(x, gate_up, down, plan):
    """Stage 4 as the per-expert loop in float64 (``GroupedSwiGLU`` with its per-group fallback)."""
    x64, gu64, dn64 = (t.detach().double().requires_grad_() for t in (x, gate_up, down))
    y = GroupedSwiGLU.apply(x64, gu64, dn64, plan, plan.token_counts.tolist(), False, False)
    return y, (x64, gu64, dn64)


def _triton(x, gate_up, down, plan, weights=None):
    from mula_lightning.moe.triton_experts import TritonSwiGLU

    return TritonSwiGLU.apply(x, gate_up, down, plan, weights)


def _check_stage(indices, experts, hidden, inter, dtype, seed=0, n_start=0, n_end=None, weighted=False):
    """The kernels against the per-expert loop; ``weighted``: router weights applied to the rows before the down
    projection, against the loop's rows times each row's weight (their gradient checked too)."""
    g = torch.Generator().manual_seed(seed)
    tokens = indices.shape[0]
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    local = (experts - 1 if n_end is None else n_end) - n_start + 1
    gate_up = (torch.randn(local, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    down = (torch.randn(local, hidden, inter, generator=g) / inter**0.5).to(dtype).requires_grad_()
    weights = torch.rand(indices.shape, generator=g).add(0.5).to(dtype).requires_grad_() if weighted else None
    plan = build_dispatch_plan(indices, experts, n_start, n_end)
    y = _triton(x, gate_up, down, plan, weights)
    grad = torch.randn(y.shape, generator=g).to(dtype)
    inputs = (x, gate_up, down) + ((weights,) if weighted else ())
    got = torch.autograd.grad(y, inputs, grad)
    y_ref, leaves = _loop_reference(x, gate_up, down, plan)
    if weighted:
        w64 = weights.detach().double().requires_grad_()
        y_ref = y_ref * w64.reshape(-1).index_select(0, plan.row_slot)[:, None]
        leaves = (*leaves, w64)
    want = torch.autograd.grad(y_ref, leaves, grad.double())
    _close(y, y_ref, dtype, "forward")
    for name, a, b in zip(("input", "gate_up", "down", "router weights"), got, want):
        assert a.dtype == dtype
        _close(a, b, dtype, f"{name} gradient")
    return plan


def _routing(tokens, experts, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("weighted", [False, True], ids=["rows", "rows weighted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "case",
    ["uneven sizes, an expert without tokens", "every token on one expert", "top-1", "top-k = every expert"],
)
def test_stage_matches_the_per_expert_loop(case, dtype, weighted):
    """The kernels' rows and the input, gate/up and down gradients equal the per-expert loop in float64 (within the
    dtype's rounding) on awkward routings; an expert without rows gets zero weight gradients. With the router weights
    applied before the down projection, the rows equal the loop's rows times their weights and the weights' gradient
    (formed in the dSwiGLU epilogue, a dot over the expert width) equals the loop's."""
    experts, hidden, inter = 5, 40, 24  # multiples of no tile size (32)
    if case.startswith("uneven"):
        indices = _routing(37, experts, 2)
        indices[indices == 3] = 1  # expert 3 gets nothing
    elif case == "every token on one expert":
        indices = torch.full((45, 1), 2)
    elif case == "top-1":
        indices = _routing(70, experts, 1, seed=1)  # 70 rows: several row blocks per expert
    else:
        indices = _routing(9, experts, experts, seed=2)
    plan = _check_stage(indices, experts, hidden, inter, dtype, weighted=weighted)
    assert plan.num_rows == indices.numel()


def test_a_local_expert_range_with_dropped_pairs():
    """Under expert parallelism a rank computes its local experts [2, 4] of 7 only, and capacity drops (-1) remove
    pairs: the kernels see exactly the plan's rows (float32); with router weights, the slots of pairs dropped or
    routed to other ranks get a zero weight gradient here."""
    indices = _routing(50, 7, 3, seed=3)
    indices[::4, 0] = -1
    for weighted in (False, True):
        plan = _check_stage(indices, 7, 24, 20, torch.float32, n_start=2, n_end=4, weighted=weighted)
        assert 0 < plan.num_rows < indices.numel()


def _autotuned_launch(monkeypatch, timings):
    """Route the row kernel through Triton's own ``Autotuner`` around the interpreted kernel, over column tiles of 32
    and 64, each benchmark run executing the kernel once and taking its time from ``timings`` (as on a GPU, where
    every candidate runs on the real buffers before the winner's launch)."""
    import triton
    from triton.runtime.autotuner import Autotuner

    import mula_lightning.moe.triton_experts as triton_experts
    from mula_lightning.moe.triton_kernels import kernels

    fn = kernels(True)["rows_times_weights"]
    configs = [triton.Config({"BN": 32, "BK": 32}), triton.Config({"BN": 64, "BK": 32})]
    key = ["n_out", "n_red", "EPILOGUE", "ROW_WEIGHTS"]
    tuner = Autotuner(fn, fn.arg_names, configs, key, None, None,
                      do_bench=lambda call, quantiles: (call(), [next(timings)] * len(quantiles))[1])  # fmt: skip
    plain = triton_experts._launch

    def launch(name, device, grid, tiles, *args, **constexprs):
        if name != "rows_times_weights":
            return plain(name, device, grid, tiles, *args, **constexprs)
        tuner[grid](*args, **constexprs, BM=tiles["BM"])

    monkeypatch.setattr(triton_experts, "_launch", launch)
    return tuner


def test_router_weight_gradient_holds_when_the_autotuner_picks_a_wider_tile(monkeypatch):
    """Review item (issue 71): the dSwiGLU epilogue's per-column-tile shares of the router weights' gradient survive
    an autotuner whose benchmark runs write narrower tiles than the winner (BN 32 benched, BN 64 fastest, an expert
    width of 40: two share slots, the winner's one program per row covering both). Before the fix the slot the
    winner does not write kept the benchmark's partial dot and was summed in (off by the width's second half)."""
    import itertools

    tuner = _autotuned_launch(monkeypatch, itertools.cycle([2.0, 1.0]))
    _check_stage(_routing(37, 5, 2), 5, 24, 40, torch.float32, weighted=True)
    assert {config.kwargs["BN"] for config in tuner.cache.values()} == {64}  # the wider tile won every key


def _blocks(config, dtype, backend, seed):
    torch.manual_seed(seed)
    ref = ReferenceMoEBlock(config).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    fast = FastSparseMoEBlock(config, experts_backend=backend).to(dtype)
    fast.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    return ref, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
def test_block_matches_the_reference_block(dtype, shared):
    """``FastSparseMoEBlock(experts_backend="triton")`` against ``ReferenceMoEBlock`` in float64: output, auxiliary
    loss and the gradients of the input, the router, both expert tensors and (with them) the shared experts."""
    config = MoEConfig(hidden_size=24, intermediate_size=20, num_experts=6, top_k=2, shared_experts=int(shared),
                       z_loss_coef=1e-3)  # fmt: skip
    ref, fast = _blocks(config, dtype, "triton", seed=4)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    x_fast = x.to(dtype).requires_grad_()
    x_ref = x.clone().requires_grad_()
    out, aux = fast.forward_with_aux(x_fast)
    out_ref, aux_ref = ref.forward_with_aux(x_ref)
    grad = torch.randn_like(out_ref)
    (out.double() * grad).sum().add(aux.aux_loss.double()).backward()
    (out_ref * grad).sum().add(aux_ref.aux_loss).backward()
    _close(out, out_ref, dtype, "output")
    _close(x_fast.grad, x_ref.grad, dtype, "input gradient")
    params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        _close(p.grad, params[name].grad, dtype, name)
    assert any("shared" in n for n in params) == shared


def test_the_checks_see_a_lost_row_block_and_misplaced_weight_rows(monkeypatch):
    """A schedule that loses an expert's last row block leaves rows unwritten, and a weight gradient that starts one
    row early reads another expert's row: the comparisons of the tests above fail on both."""
    import mula_lightning.moe.triton_experts as te

    indices = _routing(40, 4, 2, seed=5)
    right = te.row_block_schedule

    def lose_a_block(offs, rows, block_m=te.BLOCK_M):
        expert, row = right(offs, rows, block_m)
        return expert, torch.where(torch.arange(row.numel()) == 1, offs[expert].to(row.dtype), row)

    monkeypatch.setattr(te, "row_block_schedule", lose_a_block)
    with pytest.raises(AssertionError):
        _check_stage(indices, 4, 24, 20, torch.float32)
    monkeypatch.setattr(te, "row_block_schedule", right)
    weight_grads = te.expert_weight_grads

    def early_start(a, b, offs, b_index=None, out_dtype=None):
        shifted = torch.cat([a[:1], a[:-1]])  # row r's gradient paired with row r - 1's input
        return weight_grads(shifted, b, offs, b_index, out_dtype)

    monkeypatch.setattr(te, "expert_weight_grads", early_start)
    with pytest.raises(AssertionError):
        _check_stage(indices, 4, 24, 20, torch.float32)


def test_kernels_compile_for_an_h100_without_a_gpu():
    """Every kernel variant (plain, SwiGLU and dSwiGLU epilogues, gathered or not, with and without the router
    weights in the epilogues; the weight-gradient kernel; the combine's forward and backward, weighted or only
    summing) builds for sm_90 in bf16 with the largest autotuned tile and its warps and stages
    (the SwiGLU variant, two accumulators, with every row tile): Triton's front end, its MLIR passes and ptxas accept
    them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mula_lightning.moe.triton_experts import GPU_BLOCK_M
    from mula_lightning.moe.triton_kernels import ROW_TILES, WEIGHT_GRAD_TILES, kernels

    compiled, target = kernels(False), GPUTarget("cuda", 90, 32)
    rows = {"a_ptr": "*bf16", "a_index_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "extra_ptr": "*bf16",
            "extra2_ptr": "*bf16", "offs_ptr": "*i32", "block_expert_ptr": "*i32", "block_row_ptr": "*i32",
            "row_weight_ptr": "*fp32", "row_weight_grad_ptr": "*fp32"}  # fmt: skip
    ints = ("n_out", "n_red", "stride_a", "stride_we", "stride_wn", "stride_wk", "stride_out", "stride_extra",
            "stride_rwg")  # fmt: skip
    constexprs = ("GATHER", "EPILOGUE", "ROW_WEIGHTS", "BM", "BN", "BK")
    signature = {**rows, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    largest = ROW_TILES[-1]
    variants = [(True, 1, weighted, tile) for tile in ROW_TILES for weighted in (False, True)]
    variants += [(False, 0, False, largest), (False, 2, False, largest), (False, 2, True, largest)]
    for gather, epilogue, weighted, (bn, bk, warps, stages) in variants:
        values = {"GATHER": gather, "EPILOGUE": epilogue, "ROW_WEIGHTS": weighted, "BM": GPU_BLOCK_M, "BN": bn,
                  "BK": bk}  # fmt: skip
        source = ASTSource(compiled["rows_times_weights"].fn, signature, constexprs=values)
        options = {"num_warps": warps, "num_stages": stages}
        assert triton.compile(source, target=target, options=options).asm["cubin"]
    grads = {"a_ptr": "*bf16", "b_ptr": "*bf16", "b_index_ptr": "*i64", "out_ptr": "*fp32", "offs_ptr": "*i32"}
    ints = ("m_size", "n_size", "stride_a", "stride_b", "stride_oe", "stride_om")
    signature = {**grads, **dict.fromkeys(ints, "i32"), **dict.fromkeys(("GATHER", "BM", "BN", "BK"), "constexpr")}
    bm, bn, bk, warps, stages = WEIGHT_GRAD_TILES[2]
    values = {"GATHER": True, "BM": bm, "BN": bn, "BK": bk}
    source = ASTSource(compiled["expert_weight_grads"].fn, signature, constexprs=values)
    assert triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages}).asm["cubin"]
    combine = {"y_ptr": "*bf16", "w_ptr": "*bf16", "slot_row_ptr": "*i64", "out_ptr": "*bf16", "top_k": "i32",
               "hidden": "i32", "stride_y": "i32", "stride_out": "i32", "WEIGHTED": "constexpr",
               "BH": "constexpr"}  # fmt: skip
    backward = {"y_ptr": "*bf16", "w_ptr": "*bf16", "row_slot_ptr": "*i64", "token_ptr": "*i64",
                "grad_out_ptr": "*bf16", "grad_y_ptr": "*bf16", "grad_w_ptr": "*fp32", "hidden": "i32",
                "stride_y": "i32", "stride_g": "i32", "stride_gy": "i32", "WEIGHTED": "constexpr",
                "BH": "constexpr"}  # fmt: skip
    for weighted in (True, False):
        values = {"WEIGHTED": weighted, "BH": 256}
        assert triton.compile(ASTSource(compiled["combine_rows"], combine, constexprs=values), target=target)
        source = ASTSource(compiled["combine_rows_backward"], backward, constexprs=values)
        assert triton.compile(source, target=target).asm["cubin"]


def test_what_the_backend_cannot_serve_is_refused_in_one_line():
    """``experts_backend="triton"`` on float64, or bf16 under the CPU interpreter: one ``ValueError`` naming why; an
    unknown backend name is refused at construction; ``"auto"`` keeps grouped_mm (no GPU measurement yet)."""
    from mula_lightning.moe.experts import resolve_experts_backend

    config = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    block = FastSparseMoEBlock(config, experts_backend="triton").double()
    with pytest.raises(ValueError, match=r"experts_backend='triton' cannot .*float32 and float16 only, not torch\.f"):
        block(torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_experts_backend("triton", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"experts_backend \('cuda'\) must be one of"):
        FastSparseMoEBlock(config, experts_backend="cuda")
    with pytest.raises(ValueError, match=r"experts_backend \('fast'\) must be one of"):
        MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2, experts_backend="fast")
    assert resolve_experts_backend("auto", torch.device("cpu"), torch.float32) == "grouped_mm"


def test_from_hf_and_patch_hf_moe_take_the_backend():
    """A transformers OLMoE block wrapped by ``from_hf(..., experts_backend="triton")`` gives the block's output and
    every gradient (float32, within the kernels' rounding); ``patch_hf_moe`` hands the backend to every block."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    from mula_lightning.moe import patch_hf_moe

    hf_config = OlmoeConfig(hidden_size=24, intermediate_size=20, num_experts=6, num_experts_per_tok=2,
                            experts_implementation="eager")  # fmt: skip
    hf = OlmoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(6))
    results = []
    for block in (hf, FastSparseMoEBlock.from_hf(hf, experts_backend="triton")):
        hf.zero_grad()
        xi = x.clone().requires_grad_()
        block(xi).square().sum().backward()
        results.append([block(x).detach(), xi.grad] + [p.grad.clone() for p in hf.parameters()])
    for want, got in zip(*results):
        _close(got, want.double(), torch.float32, "from_hf")
    holder = torch.nn.ModuleDict({"mlp": OlmoeSparseMoeBlock(hf_config)})
    patch_hf_moe(holder, experts_backend="triton")
    assert holder["mlp"].experts_backend == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reuse", [False, True])
def test_combine_matches_the_weighted_sum(dtype, reuse):
    """Stage 5 in the Triton kernels against ``CombineExpertOutputs`` in float64: the tokens' weighted sums and the
    gradients of the rows and of the router weights, on a local expert range [1, 3] of 6 with dropped pairs (slots
    routed elsewhere add nothing and get a zero weight gradient); with ``reuse_dead_activations`` the rows'
    gradients land in the rows' own storage."""
    from mula_lightning.moe.combine import CombineExpertOutputs
    from mula_lightning.moe.triton_experts import TritonCombine

    g = torch.Generator().manual_seed(7)
    indices = _routing(23, 6, 3, seed=8)
    indices[::5, 1] = -1
    plan = build_dispatch_plan(indices, 6, 1, 3)
    y = torch.randn(plan.num_rows, 300, generator=g).to(dtype).requires_grad_()  # 300: two column blocks
    w = torch.rand(23, 3, generator=g).to(dtype).requires_grad_()
    out = TritonCombine.apply(y * 1, w, plan, reuse)  # y * 1: a dead intermediate, as the experts' output is
    grad = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (y, w), grad)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want_out = CombineExpertOutputs.apply(y64, w64, plan, False)
    want = torch.autograd.grad(want_out, (y64, w64), grad.double())
    _close(out, want_out, dtype, "combined")
    _close(got[0], want[0], dtype, "rows' gradient")
    _close(got[1], want[1], dtype, "router weights' gradient")
    local = (indices >= 1) & (indices <= 3)
    assert not got[1][~local].any() and got[1][local].abs().min() > 0
