"""FastSparseMoEBlock against a plain per-token loop, against transformers' OLMoE block, and against itself.

Legend: S = tokens, H = hidden, I = expert width, E = experts, K = experts per token.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.models.config import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock, ReferenceMoEBlock

H, I = 24, 16  # noqa: E741 - I is the expert width of the legend


def make_config(num_experts: int, top_k: int, **overrides) -> MulaConfig:
    return MulaConfig.from_name(
        "mula-tiny-moe", hidden_size=H, intermediate_size=I, num_experts=num_experts, top_k=top_k, **overrides
    )


def make_block(config: MulaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> FastSparseMoEBlock:
    block = FastSparseMoEBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.to(dtype)


def per_token_reference(x_SH, router_w, gate_up, down, config: MulaConfig, indices_SK=None):
    """The MoE block written as the plainest loop: for each token, for each of its K experts, add w * expert(x).

    Routing follows the documented semantics (fp32 router, softmax_topk / topk_softmax, norm_topk_prob, forced
    uniform pattern, capacity drops in token order). ``indices_SK`` overrides the choice (bf16 comparisons).
    Computes in fp32 from whatever dtype the weights have; differentiable in every input.
    """
    num_tokens = x_SH.shape[0]
    E, K = config.num_experts, config.top_k
    logits_SE = F.linear(x_SH.float(), router_w.float())
    cap = math.ceil(config.capacity_factor * num_tokens * K / E) if config.capacity_factor is not None else None
    taken = [0] * E
    outputs = []
    for s in range(num_tokens):
        if indices_SK is not None:
            chosen = indices_SK[s]
        elif config.forced_uniform_routing:
            chosen = torch.tensor([(s * K + j) % E for j in range(K)])
        elif config.router_kind == "softmax_topk":
            chosen = torch.topk(torch.softmax(logits_SE[s], -1), K).indices
        else:
            chosen = torch.topk(logits_SE[s], K).indices
        if config.router_kind == "softmax_topk":
            w = torch.softmax(logits_SE[s], -1)[chosen]
            if config.norm_topk_prob:
                w = w / w.sum()
        else:
            w = torch.softmax(logits_SE[s][chosen], -1)
        acc = torch.zeros(x_SH.shape[1])
        for k in range(K):
            e = int(chosen[k])
            taken[e] += 1
            if cap is not None and taken[e] > cap:
                continue  # dropped: contributes nothing
            gate_up_2I = gate_up[e].float() @ x_SH[s].float()
            h_I = F.silu(gate_up_2I[: config.intermediate_size]) * gate_up_2I[config.intermediate_size :]
            acc = acc + w[k] * (down[e].float() @ h_I)
        outputs.append(acc)
    return torch.stack(outputs)


def run_both(block: FastSparseMoEBlock, x_SH: torch.Tensor, seed: int = 1, indices_from_block: bool = False):
    """Output and gradients (input, router, experts) of the block and of the loop, under one random cotangent."""
    cfg = block.config
    g_SH = torch.randn(x_SH.shape, generator=torch.Generator().manual_seed(seed))
    xf = x_SH.detach().clone().requires_grad_()
    y = block(xf)
    (y.float() * g_SH).sum().backward()
    fast = [y.detach().float(), xf.grad.float()] + [p.grad.float() for p in block.parameters()]

    indices = block.route(x_SH.detach().reshape(-1, cfg.hidden_size)).indices_SK if indices_from_block else None
    params = [p.detach().float().clone().requires_grad_() for p in block.parameters()]  # gate, gate_up, down
    xr = x_SH.detach().float().clone().requires_grad_()
    y_ref = per_token_reference(xr.reshape(-1, cfg.hidden_size), *params, cfg, indices_SK=indices).view(x_SH.shape)
    (y_ref * g_SH).sum().backward()
    ref = [y_ref.detach(), xr.grad] + [p.grad for p in params]
    return fast, ref


def assert_fp32_close(fast, ref):
    for name, a, b in zip(["out", "x.grad", "gate.weight.grad", "gate_up_proj.grad", "down_proj.grad"], fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(b.abs().max().item(), 1e-30), msg=name)


CASES = [
    # (E, K, S, kind, extra config)
    (1, 1, 13, "softmax_topk", {}),
    (8, 2, 37, "softmax_topk", {}),
    (8, 2, 37, "topk_softmax", {}),
    (8, 4, 23, "softmax_topk", {"norm_topk_prob": True}),
    (8, 1, 23, "softmax_topk", {}),
    (64, 8, 29, "softmax_topk", {}),
    (64, 8, 29, "topk_softmax", {}),
    (64, 1, 31, "softmax_topk", {}),
    (8, 8, 11, "softmax_topk", {"norm_topk_prob": True}),
    (8, 2, 41, "softmax_topk", {"capacity_factor": 1.0}),
    (8, 2, 41, "topk_softmax", {"capacity_factor": 1.0}),
    (8, 3, 19, "softmax_topk", {"forced_uniform_routing": True}),
]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "fallback"])
@pytest.mark.parametrize("E,K,S,kind,extra", CASES)
def test_matches_per_token_loop_fp32(E, K, S, kind, extra, grouped):
    """Forward and the gradients of input, router and both expert weights equal the per-token loop in fp32
    (rtol 1e-5), for (E, K) in {(1,1), (8,2), (64,8)} and more, odd token counts (so with E=64 some experts get
    no token), both router kinds, capacity 1.0 with drops, forced uniform routing; grouped GEMM and fallback."""
    block = make_block(make_config(E, K, router_kind=kind, **extra))
    block.use_grouped_mm = grouped
    x = torch.randn(1, S, H, generator=torch.Generator().manual_seed(E * 100 + K))
    if extra.get("capacity_factor"):
        assert int(block.forward_with_aux(x)[1].num_dropped) > 0  # the case really drops pairs
    if E == 64:
        assert int((block.forward_with_aux(x)[1].tokens_per_expert == 0).sum()) > 0  # experts with no token
    assert_fp32_close(*run_both(block, x))


@pytest.mark.parametrize("E,K", [(1, 1), (8, 2), (64, 8)])
def test_matches_per_token_loop_bf16(E, K):
    """In bf16, with the loop fed the block's own expert choice, outputs and all gradients agree to a relative
    Frobenius error <= 1e-2."""
    block = make_block(make_config(E, K), dtype=torch.bfloat16)
    x = torch.randn(2, 19, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    fast, ref = run_both(block, x, indices_from_block=True)
    for a, b in zip(fast, ref):
        assert (a - b).norm() <= 1e-2 * b.norm()


def test_same_as_reference_block_and_aux():
    """Output, gradients and the auxiliary outputs equal ``ReferenceMoEBlock`` loaded with the same state dict."""
    cfg = make_config(8, 2, capacity_factor=1.25, z_loss_coef=0.01)
    fast = make_block(cfg)
    ref = ReferenceMoEBlock(cfg)
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 21, H)
    outs = []
    for block in (fast, ref):
        xi = x.clone().requires_grad_()
        y, aux = block.forward_with_aux(xi)
        (y.square().sum() + aux.aux_loss).backward()
        outs.append((y, xi.grad, [p.grad for p in block.parameters()], aux))
    (y0, gx0, gp0, a0), (y1, gx1, gp1, a1) = outs
    torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx0, gx1, rtol=1e-5, atol=1e-6)
    for p0, p1 in zip(gp0, gp1):
        torch.testing.assert_close(p0, p1, rtol=1e-5, atol=1e-6 * p1.abs().max().item())
    for field in ("aux_loss", "load_balance_loss", "z_loss", "tokens_per_expert", "num_dropped"):
        torch.testing.assert_close(getattr(a0, field), getattr(a1, field))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"capacity_factor": 1.0}], ids=["dropless", "capacity"])
def test_deterministic(dtype, extra):
    """Two runs on the same inputs give bit-identical outputs and gradients."""
    runs = []
    for _ in range(2):
        block = make_block(make_config(64, 8, **extra), dtype=dtype)
        x = torch.randn(3, 27, H, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_()
        y = block(x)
        y.float().pow(2).sum().backward()
        runs.append([y, x.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_grouped_and_fallback_agree_bf16():
    """The grouped-GEMM path and the per-expert fallback agree in bf16 (same routing, relative error <= 1e-2)."""
    results = []
    for grouped in (True, False):
        block = make_block(make_config(8, 2), dtype=torch.bfloat16)
        block.use_grouped_mm = grouped
        x = torch.randn(1, 33, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).requires_grad_()
        y = block(x)
        y.float().sum().backward()
        results.append([y.float(), x.grad.float()] + [p.grad.float() for p in block.parameters()])
    for a, b in zip(*results):
        assert (a - b).norm() <= 1e-2 * b.norm()


def test_keeps_layout_of_reference_block():
    """State dict keys and shapes are those of ``ReferenceMoEBlock`` (checkpoints are interchangeable)."""
    cfg = make_config(8, 2)
    fast, ref = FastSparseMoEBlock(cfg), ReferenceMoEBlock(cfg)
    assert {k: v.shape for k, v in fast.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


def test_reused_activations_fail_loudly_on_a_second_backward():
    """With ``reuse_dead_activations`` (the default) a second backward through the same graph raises instead of
    returning wrong gradients; with it off, ``retain_graph=True`` backward twice gives twice the gradients."""
    cfg = make_config(8, 2)
    x = torch.randn(1, 15, H)
    block = make_block(cfg)
    y = block(x.requires_grad_())
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()

    block = make_block(cfg)
    block.reuse_dead_activations = False
    y = block(x)
    y.sum().backward(retain_graph=True)
    once = [p.grad.clone() for p in block.parameters()]
    y.sum().backward()
    for g1, p in zip(once, block.parameters()):
        torch.testing.assert_close(p.grad, 2 * g1)


@pytest.mark.parametrize("extra", [{}, {"capacity_factor": 0.5}], ids=["dropless", "capacity"])
def test_router_counts_kept_and_dropped_pairs_and_the_balancing_loss(extra):
    """One count of the chosen pairs serves the loss, the statistics and the dispatch: ``tokens_per_expert_E`` is
    the kept pairs per expert (a loop over the final indices, -1 = dropped), ``num_dropped`` the dropped ones, and
    the balancing loss is ``E * sum_e f_e P_e`` with ``f_e`` from the pairs chosen before capacity (as transformers
    computes it)."""
    block = make_block(make_config(8, 2, **extra), seed=3)
    x = torch.randn(3 * 19, H, generator=torch.Generator().manual_seed(11))
    routed = block.route(x)
    chosen = torch.topk(torch.softmax(routed.logits_SE, -1), 2, dim=-1)[1]
    kept = routed.indices_SK.tolist()
    expected = [sum(row.count(e) for row in kept) for e in range(8)]
    assert routed.tokens_per_expert_E.tolist() == expected
    assert int(routed.num_dropped) == sum(row.count(-1) for row in kept)
    if extra:
        assert int(routed.num_dropped) > 0  # the case really drops pairs
    f = torch.tensor([sum(row.count(e) for row in chosen.tolist()) for e in range(8)]) / x.shape[0]
    probs = torch.softmax(routed.logits_SE.detach().double(), -1).mean(0)
    expected = 8 * (f.double() * probs).sum()
    torch.testing.assert_close(
        routed.load_balance_loss, expected.float()
    )  # float32 math against float64: float32's tolerance
