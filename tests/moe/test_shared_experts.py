"""Shared experts (DeepSeek-V3's always-on experts, Qwen2-MoE's gated one) against their plain formula: the block's
output is the routed experts' weighted sum plus ``down(silu(gate x) * up x)``, scaled by ``sigmoid(w . x)`` when
gated; forward and every gradient in float64. Their parameters are not expert parameters (expert parallelism keeps
them whole), they are counted by ``num_params``, and shared experts that cannot be built are named."""

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.moe import MoEConfig
from mula_lightning.moe.reference import ReferenceMoEBlock
from mula_lightning.parallel.params import is_expert_param
from mula_lightning.testing import assert_parity

H, FF, E = 16, 12, 8

CASES = {
    "deepseek: 2 shared experts": dict(shared_experts=2),
    "qwen2: one gated of width 20": dict(shared_expert_intermediate_size=20, shared_expert_gate=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_output_is_routed_plus_shared(case):
    """The block with shared experts equals the same block without them plus the SwiGLU formula (times the sigmoid
    gate), output and every gradient, on fresh random inputs."""
    options = CASES[case]
    torch.manual_seed(7)
    config = MoEConfig(hidden_size=H, intermediate_size=FF, num_experts=E, top_k=2, **options)
    block = ReferenceMoEBlock(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.4)
    plain = ReferenceMoEBlock(MoEConfig(hidden_size=H, intermediate_size=FF, num_experts=E, top_k=2)).double()
    plain.load_state_dict(block.state_dict(), strict=False)
    x = torch.randn(2, 9, H, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = block(xa)
    shared = block.shared_experts
    w_gate, w_up, w_down = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    weights = [w_gate, w_up, w_down]
    formula = F.linear(F.silu(F.linear(xb, w_gate)) * F.linear(xb, w_up), w_down)
    if "shared_expert_gate" in options:
        formula = torch.sigmoid(F.linear(xb, block.shared_expert_gate.weight)) * formula
        weights.append(block.shared_expert_gate.weight)
    expected = plain(xb) + formula
    assert_parity(out.detach(), expected.detach(), reduction_len=H + 2 * FF + E, msg=f"{case} output")
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), [xa, *weights])
    ref_grads = torch.autograd.grad((expected * probe).sum(), [xb, *weights])
    for name, got, ref in zip(["x", "gate", "up", "down", "shared gate"], grads, ref_grads):
        assert_parity(got, ref, reduction_len=18 * (H + 2 * FF + E), msg=f"{case} {name} grad")


def test_shared_parameters_are_not_expert_parameters_and_are_counted():
    """``shared_experts.*`` and ``shared_expert_gate`` are non-expert tensors (replicated over EP, sharded with
    attention); ``num_params`` counts them, the dense first layer's own width and the attention options, total and
    active."""
    config = MulaConfig.from_name(
        "mula-tiny-moe", num_layers=3, moe_layers=[1, 2], dense_intermediate_size=96, shared_experts=1,
        shared_expert_gate=True, qk_norm_per_head=True, qkv_bias=True,
    )  # fmt: skip
    model = MulaForCausalLM(config)
    names = [n for n, _ in model.named_parameters()]
    shared = [n for n in names if "shared_expert" in n]
    assert len(shared) == 2 * 4 and not any(is_expert_param(n) for n in shared)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    routed = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    unused = routed * (config.num_experts - config.top_k) // config.num_experts
    assert config.num_params(active=True) == config.num_params() - unused
    assert model.model.layers[0].mlp.up_proj.weight.shape == (96, config.hidden_size)


@pytest.mark.parametrize(
    "options,fragment",
    [
        (dict(shared_experts=-1), r"shared_experts \(-1\) must be an integer >= 0"),
        (dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size \(0\) must be a positive"),
        (dict(shared_expert_gate=True), r"shared_expert_gate=True gates the shared experts, but there are none"),
    ],
)
def test_shared_experts_that_cannot_be_built_are_named(options, fragment):
    """A negative count, a zero width, a gate with nothing to gate: one line naming the values (MoEConfig and
    MulaConfig); shared experts in a dense model, a per-head q/k norm without q/k norm and a bad dense width too."""
    with pytest.raises(ValueError, match=fragment):
        MoEConfig(hidden_size=H, intermediate_size=FF, num_experts=E, top_k=2, **options)
    with pytest.raises(ValueError, match=fragment):
        MulaConfig.from_name("mula-tiny-moe", **options)
    with pytest.raises(ValueError, match=r"the config is dense \(num_experts 0\)"):
        MulaConfig.from_name("mula-tiny-dense", shared_experts=1)
    with pytest.raises(ValueError, match=r"qk_norm_per_head=True .* needs qk_norm=True"):
        MulaConfig.from_name("mula-tiny-moe", qk_norm=False, qk_norm_per_head=True)
    with pytest.raises(ValueError, match=r"dense_intermediate_size \(0\) must be a positive integer"):
        MulaConfig.from_name("mula-tiny-moe", dense_intermediate_size=0)
