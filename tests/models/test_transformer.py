"""MulaForCausalLM on one device: causality, loss definition, initialisation, meta-device materialisation."""

import math

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.transformer import RMSNorm, rope_inv_freq


def _tiny(**overrides):
    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=24, max_seq_len=64)
    base.update(overrides)
    return MulaConfig(**base)


@pytest.mark.parametrize("num_experts,top_k", [(0, 0), (4, 2)])
def test_future_tokens_do_not_change_past_logits(num_experts, top_k):
    """Attention is causal: editing token t leaves the logits of positions < t unchanged (dense and MoE)."""
    model = MulaForCausalLM(_tiny(num_experts=num_experts, top_k=top_k)).eval()
    x = torch.randint(0, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_loss_is_mean_next_token_cross_entropy_ignoring_minus_100():
    """loss = mean over labelled positions of CE(logits[t], labels[t+1]); -100 labels are skipped."""
    model = MulaForCausalLM(_tiny())
    x = torch.randint(0, 97, (3, 16))
    labels = x.clone()
    labels[0, 5:9] = -100
    out = model(x, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 97)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    expected = F.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, expected)
    summed = model(x, labels=labels, loss_reduction="sum").loss
    torch.testing.assert_close(summed, expected * keep.sum())


def test_aux_loss_is_zero_for_dense_and_the_weighted_layer_sum_for_moe():
    """Dense models report aux_loss 0; MoE models report sum over layers of coef_lb*lb + coef_z*z."""
    dense = MulaForCausalLM(_tiny())
    x = torch.randint(0, 97, (2, 8))
    assert dense(x).aux_loss.item() == 0.0
    cfg = _tiny(num_experts=4, top_k=2, aux_loss_coef=0.3, z_loss_coef=0.05)
    out = MulaForCausalLM(cfg)(x)
    assert len(out.moe_aux) == cfg.num_layers
    expected = sum(0.3 * a.load_balance_loss + 0.05 * a.z_loss for a in out.moe_aux)
    torch.testing.assert_close(out.aux_loss, expected)
    assert out.aux_loss.requires_grad


def test_meta_materialisation_equals_eager_construction():
    """Meta build -> to_empty -> init_weights(seed) equals eager construction with the same seed, bit for bit."""
    cfg = _tiny(num_experts=4, top_k=2)
    eager = init_weights(MulaForCausalLM(cfg), seed=7)
    with torch.device("meta"):
        lazy = MulaForCausalLM(cfg)
    lazy.to_empty(device="cpu")
    init_weights(lazy, seed=7)
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randint(0, 97, (2, 10))
    assert torch.equal(eager(x).logits, lazy(x).logits)


def test_initialisation_depends_on_seed_and_name_only():
    """Each parameter's initial value is a function of (seed, name): equal across builds, distinct across names."""
    a = init_weights(MulaForCausalLM(_tiny()), seed=3).state_dict()
    b = init_weights(MulaForCausalLM(_tiny()), seed=3).state_dict()
    c = init_weights(MulaForCausalLM(_tiny()), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    q0, q1 = a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    assert torch.equal(a["model.norm.weight"], torch.ones(32))
    assert a["lm_head.weight"].std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("block", [64, 1000, None], ids=["block-64", "block-1000", "default-block"])
def test_any_element_range_of_an_initial_value_equals_the_full_draw(monkeypatch, block):
    """``fill_initial_`` of random element ranges (inside one block, across several, the tensor's tail, empty) equals
    the same elements of ``init_parameter``, bit for bit, in float32 and cast to bf16 / float64; a tensor of at most
    one block is one generator draw (the values before blocks existed); a range outside the tensor is named."""
    from mula_lightning.models import transformer
    from mula_lightning.models.transformer import fill_initial_, init_parameter, stable_seed

    if block is not None:
        monkeypatch.setattr(transformer, "INIT_BLOCK_NUMEL", block)
    config = _tiny(init_std=0.03)
    shape = (97, 43) if block is not None else (2**20 + 777, 3)  # several blocks and a partial last one
    full = init_parameter("model.embed_tokens.weight", shape, config, seed=7).reshape(-1)
    n = full.numel()
    g = torch.Generator().manual_seed(11)
    ranges = [(0, n), (0, 0), (n - 5, n), (n, n)] + [
        tuple(sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())) for _ in range(6)
    ]
    for start, stop in ranges:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            out = torch.full((stop - start,), float("nan"), dtype=dtype)
            fill_initial_(out, "model.embed_tokens.weight", shape, config, seed=7, start=start)
            assert torch.equal(out, full[start:stop].to(dtype)), (start, stop, dtype)
    small = (5, 7)
    one_draw = torch.empty(small).normal_(0.0, 0.03, generator=torch.Generator().manual_seed(stable_seed(7, "w")))
    assert torch.equal(init_parameter("w", small, config, seed=7), one_draw)
    other = init_parameter("model.embed_tokens.weight", shape, config, seed=8).reshape(-1)
    assert not torch.equal(full[-100:], other[-100:])
    norm = torch.empty(4)
    assert torch.equal(fill_initial_(norm, "model.norm.weight", (10,), config, seed=0, start=6), torch.ones(4))
    with pytest.raises(ValueError, match=r"\[8, 12\) are outside 'model.norm.weight', of shape \(10,\)"):
        fill_initial_(norm, "model.norm.weight", (10,), config, seed=0, start=8)


def test_staged_and_direct_blocks_partition_a_range(monkeypatch):
    """``blocks="staged"`` writes exactly the blocks a range holds only part of (and nothing of a constant fill),
    ``"direct"`` exactly the whole float32 blocks and constant fills; together, in either order, they equal
    ``"all"``, bit for bit; a target that is not float32 is all staged; an unknown choice is refused."""
    from mula_lightning.models import transformer
    from mula_lightning.models.transformer import fill_initial_

    monkeypatch.setattr(transformer, "INIT_BLOCK_NUMEL", 10)
    config = _tiny(init_std=0.03)
    shape, name = (9, 7), "model.layers.0.self_attn.q_proj.weight"  # 63 elements: blocks of 10, a partial last one
    for start, stop in [(3, 58), (10, 40), (0, 63), (12, 17), (25, 25)]:
        every = fill_initial_(torch.full((stop - start,), float("nan")), name, shape, config, 1, start)
        staged = fill_initial_(torch.full((stop - start,), float("nan")), name, shape, config, 1, start, "staged")
        direct = fill_initial_(torch.full((stop - start,), float("nan")), name, shape, config, 1, start, "direct")
        index = torch.arange(start, stop)
        whole = ((index // 10) * 10 >= start) & (torch.clamp((index // 10) * 10 + 10, max=63) <= stop)
        assert torch.equal(staged[~whole], every[~whole]) and staged[whole].isnan().all(), (start, stop)
        assert torch.equal(direct[whole], every[whole]) and direct[~whole].isnan().all(), (start, stop)
        both = fill_initial_(direct.clone(), name, shape, config, 1, start, "staged")
        assert torch.equal(both, every)
        half = torch.full((stop - start,), float("nan"), dtype=torch.bfloat16)
        assert fill_initial_(half.clone(), name, shape, config, 1, start, "direct").isnan().all()
        assert torch.equal(fill_initial_(half, name, shape, config, 1, start, "staged"), every.bfloat16())
    ones = torch.full((4,), float("nan"))
    assert fill_initial_(ones, "model.norm.weight", (10,), config, 0, 6, "staged").isnan().all()
    assert torch.equal(fill_initial_(ones, "model.norm.weight", (10,), config, 0, 6, "direct"), torch.ones(4))
    with pytest.raises(ValueError, match="blocks must be 'all', 'staged' or 'direct', got 'some'"):
        fill_initial_(ones, "model.norm.weight", (10,), config, 0, 6, "some")


def test_rmsnorm_matches_its_formula():
    """RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back."""
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16)
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    """Llama-3 RoPE scaling leaves short wavelengths alone and divides long ones by `factor`."""
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    plain = rope_inv_freq(_tiny(rope_theta=500000.0))
    scaled = rope_inv_freq(_tiny(rope_theta=500000.0, rope_scaling=scaling))
    wavelen = 2 * math.pi / plain
    high = wavelen < 64 / 4.0
    low = wavelen > 64 / 1.0
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with 2 kv heads equals full multi-head attention whose k/v projections repeat each kv head."""
    gqa = MulaForCausalLM(_tiny(num_heads=4, num_kv_heads=2, qk_norm=False)).eval()
    mha = MulaForCausalLM(_tiny(num_heads=4, num_kv_heads=4, qk_norm=False)).eval()
    sd = gqa.state_dict()
    for i in range(2):
        for n in ("k_proj", "v_proj"):
            w = sd[f"model.layers.{i}.self_attn.{n}.weight"].view(2, 8, 32)
            sd[f"model.layers.{i}.self_attn.{n}.weight"] = w.repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(sd)
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x).logits, mha(x).logits, rtol=1e-5, atol=1e-5)


def test_input_must_be_two_dimensional():
    """A 1-D input is rejected with its shape in the message."""
    with pytest.raises(ValueError, match=r"\(7,\)"):
        MulaForCausalLM(_tiny())(torch.zeros(7, dtype=torch.long))
