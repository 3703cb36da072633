"""Upcycling dense checkpoints into MoEs: function preservation, granularity, noise, online per-rank slices,
lazy reads from sharded directories, bad input, and the ``mula upcycle`` command end to end."""

import json

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.models.checkpoint_io import load_model_only, save_model_only
from mula_lightning.models.hf_convert import save_hf
from mula_lightning.models.safetensors_file import SafetensorsFile
from mula_lightning.models.upcycle import UpcycleSpec, expert_scale, upcycle, upcycle_state_dict

VOCAB = 211


def _hf_llama(seed: int = 0, **kw):
    """A tiny random Llama with grouped-query attention (8 query heads, 2 key/value heads)."""
    import transformers  # imported where used: the ranks of the gloo test import this module and skip it

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)
    cfg.update(num_key_value_heads=2, eos_token_id=0, bos_token_id=None, pad_token_id=None, **kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def _tiny_dense(**kw) -> MulaForCausalLM:
    """``mula-tiny-dense`` (q/k-norm, H 128, I 512) with 2 layers and random weights, larger than init."""
    model = MulaForCausalLM(MulaConfig.from_name("mula-tiny-dense", num_layers=2, init_std=0.1, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _gap(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny HF Llama saved as a sharded directory (7 files + index), and the dense model itself."""
    hf = _hf_llama(0)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(str(path), max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path, hf


@pytest.fixture(scope="module")
def tiny_dense():
    return _tiny_dense()


X = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------- function preservation
@pytest.mark.parametrize("kind", ["llama-gqa", "mula-tiny-dense"])
def test_topk_softmax_upcycle_computes_the_dense_function(kind, tiny_dense):
    """E8T2, granularity 1, Mixtral router, dropless: upcycled logits equal the dense model's within 1e-5 (fp32),
    every expert is a bit-exact copy of the dense FFN and the router is the (seed, name) draw."""
    dense = MulaForCausalLM.from_hf(_hf_llama(1)).eval() if kind == "llama-gqa" else tiny_dense
    moe = upcycle(dense, num_experts=8, top_k=2).eval()
    assert (moe.config.num_experts, moe.config.top_k, moe.config.router_kind) == (8, 2, "topk_softmax")
    assert moe.config.capacity_factor is None and moe.config.moe_layers is None
    mlp, dense_mlp = moe.model.layers[1].mlp, dense.model.layers[1].mlp
    gate_up = torch.cat([dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight])
    assert all(torch.equal(mlp.experts.gate_up_proj[e], gate_up) for e in range(8))
    assert all(torch.equal(mlp.experts.down_proj[e], dense_mlp.down_proj.weight) for e in range(8))
    assert mlp.gate.weight.std() > 0 and not torch.equal(mlp.gate.weight[0], mlp.gate.weight[1])
    gap = _gap(_logits(moe, X % dense.config.vocab_size), _logits(dense, X % dense.config.vocab_size))
    print(f"\n[{kind}] E8T2 topk_softmax max |logit gap| = {gap:.2e}")
    assert gap < 1e-5


def test_softmax_topk_without_renormalisation_does_not_compute_the_dense_function(tiny_dense):
    """The ST router (softmax over all E, then top-K, no renormalisation) gives the K experts weights summing to
    P(x) < 1, which varies per token: even with Megatron's expected-value scale s = E/K the MoE layer computes
    s * P(x) * FFN(x), not FFN(x), so logits move. Renormalising (norm_topk_prob=True) restores equality."""
    st = upcycle(tiny_dense, num_experts=8, top_k=2, router="softmax_topk").eval()
    gap = _gap(_logits(st, X), _logits(tiny_dense, X))
    fixed = upcycle(tiny_dense, num_experts=8, top_k=2, router="softmax_topk", norm_topk_prob=True).eval()
    fixed_gap = _gap(_logits(fixed, X), _logits(tiny_dense, X))
    print(f"\nsoftmax_topk: max |logit gap| {gap:.3e} unnormalised vs {fixed_gap:.1e} with norm_topk_prob")
    assert gap > 1e-2 and fixed_gap < 1e-5
    # Why: one layer, exactly. MoE(h) == s * P(h) * FFN(h) with P = sum of the top-2 softmax probabilities.
    h = torch.randn(50, 128)
    block, ffn = st.model.layers[0].mlp, tiny_dense.model.layers[0].mlp
    probs = torch.softmax(h @ block.gate.weight.T, dim=-1)
    p_top = probs.topk(2, dim=-1).values.sum(-1, keepdim=True)
    s = expert_scale(st.config, 1)
    assert s == 8 / 2
    with torch.no_grad():
        torch.testing.assert_close(block(h), s * p_top * ffn(h), rtol=1e-4, atol=2e-5)
    assert p_top.std() > 1e-3  # token-dependent: no constant scale can fix it


@pytest.mark.parametrize("granularity,experts,top_k", [(2, 8, 4), (4, 8, 4), (4, 16, 8)])
def test_granularity_with_megatron_scaling_computes_the_dense_function(granularity, experts, top_k, llama_dir):
    """G > 1: expert j is slice j % G of copy j // G (width I / G), the router repeats one row per copy over its G
    experts, up and down are scaled by sqrt(G): logits equal the dense model's within 1e-4."""
    _, hf = llama_dir
    dense = MulaForCausalLM.from_hf(hf).eval()
    moe = upcycle(dense, num_experts=experts, top_k=top_k, granularity=granularity).eval()
    width = 96 // granularity
    assert moe.config.intermediate_size == width
    mlp, d = moe.model.layers[0].mlp, dense.model.layers[0].mlp
    router = mlp.gate.weight
    assert torch.equal(router, router[::granularity].repeat_interleave(granularity, 0))
    root = granularity**0.5
    for j in (0, experts - 1):
        g = j % granularity
        rows = slice(g * width, (g + 1) * width)
        assert torch.equal(mlp.experts.gate_up_proj[j, :width], d.gate_proj.weight[rows])
        torch.testing.assert_close(mlp.experts.gate_up_proj[j, width:], d.up_proj.weight[rows] * root)
        torch.testing.assert_close(mlp.experts.down_proj[j], d.down_proj.weight[:, rows] * root)
    gap = _gap(_logits(moe, X), _logits(hf, X))
    print(f"\nG={granularity} E={experts} K={top_k}: max |logit gap| vs dense = {gap:.2e}")
    assert gap < 1e-4


def test_top_k_that_splits_virtual_groups_warns(tiny_dense):
    """K not a multiple of G cannot pick whole copies: the user is warned that the function is not preserved."""
    with pytest.warns(UserWarning, match=r"top_k \(2\) is not a multiple of granularity \(4\)"):
        upcycle(tiny_dense, num_experts=8, top_k=2, granularity=4)


def test_partial_upcycling_keeps_the_other_layers_dense(tiny_dense):
    """layers=[1]: layer 0 keeps its dense FFN bit for bit, layer 1 becomes MoE, and the function is preserved."""
    moe = upcycle(tiny_dense, num_experts=4, top_k=2, layers=[1]).eval()
    assert moe.config.moe_layers == [1]
    assert torch.equal(moe.model.layers[0].mlp.up_proj.weight, tiny_dense.model.layers[0].mlp.up_proj.weight)
    assert moe.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 1024, 128)
    assert moe.config.num_params() == sum(p.numel() for p in moe.parameters())
    assert _gap(_logits(moe, X), _logits(tiny_dense, X)) < 1e-5


SHARED = {
    "DeepSeek-V3: sigmoid, groups, bias, scaling, one shared expert": dict(
        granularity=1, router="softmax_topk", norm_topk_prob=True, shared_experts=1, score_function="sigmoid",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, bias_update_rate=1e-3, aux_loss_coef=0.0,
    ),
    "fine-grained G=2, two shared experts of I/2": dict(granularity=2, router="topk_softmax", shared_experts=2),
    "Qwen2-MoE: a gated shared expert of width I": dict(
        granularity=1, router="softmax_topk", norm_topk_prob=True, shared_expert_intermediate_size=512,
        shared_expert_gate=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SHARED))
def test_shared_experts_start_as_the_dense_ffn_and_the_function_is_kept(case, tiny_dense):
    """Upcycling into today's shapes: the shared experts start as the whole dense FFN (halved by sqrt(1/2) on up and
    down, or by a zero gate, sigmoid(0) = 1/2), the routed experts carry the other half (and 1 / routed_scaling_factor),
    a selection bias starts at zero: the upcycled logits equal the dense model's within 1e-5 (fp32)."""
    options = dict(SHARED[case])
    granularity = options.pop("granularity")
    moe = upcycle(tiny_dense, num_experts=8, top_k=4, granularity=granularity, **options).eval()
    config, mlp, dense_mlp = moe.config, moe.model.layers[1].mlp, tiny_dense.model.layers[1].mlp
    assert config.moe.shared_width == 512 and config.intermediate_size == 512 // granularity
    assert torch.equal(mlp.shared_experts.gate_proj.weight, dense_mlp.gate_proj.weight)
    if config.shared_expert_gate:
        assert torch.equal(mlp.shared_expert_gate.weight, torch.zeros(1, 128))
        assert torch.equal(mlp.shared_experts.up_proj.weight, dense_mlp.up_proj.weight)
    else:
        torch.testing.assert_close(mlp.shared_experts.up_proj.weight, dense_mlp.up_proj.weight * 0.5**0.5)
    if config.moe.uses_expert_bias:
        assert torch.equal(mlp.gate.e_score_correction_bias, torch.zeros(8))
    assert expert_scale(config, granularity) == granularity / 2 / config.routed_scaling_factor
    assert config.num_params() == sum(p.numel() for p in moe.parameters())
    gap = _gap(_logits(moe, X), _logits(tiny_dense, X))
    print(f"\n[{case}] max |logit gap| vs dense = {gap:.2e}")
    assert gap < 1e-5


def test_fine_grained_partial_upcycling_keeps_dense_layers_of_their_own_width(tiny_dense):
    """G=2 with layers=[1]: layer 0 stays the dense FFN of width 512 (``dense_intermediate_size``) beside experts of
    width 256, and the function is preserved."""
    moe = upcycle(tiny_dense, num_experts=8, top_k=4, granularity=2, layers=[1]).eval()
    assert (moe.config.intermediate_size, moe.config.dense_width) == (256, 512)
    assert torch.equal(moe.model.layers[0].mlp.down_proj.weight, tiny_dense.model.layers[0].mlp.down_proj.weight)
    assert moe.model.layers[1].mlp.experts.down_proj.shape == (8, 128, 256)
    assert _gap(_logits(moe, X), _logits(tiny_dense, X)) < 1e-5


def test_noise_reinitialises_a_seeded_fraction_of_each_experts_neurons(tiny_dense):
    """noise=0.25: each expert re-draws exactly round(0.25 * I) neurons (gate row, up row, down column together),
    different neurons per expert, the same for the same seed, others for another seed; the rest stay copies."""
    a = upcycle(tiny_dense, num_experts=4, top_k=2, noise=0.25, seed=3)
    b = upcycle(tiny_dense, num_experts=4, top_k=2, noise=0.25, seed=3)
    c = upcycle(tiny_dense, num_experts=4, top_k=2, noise=0.25, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    d = tiny_dense.model.layers[1].mlp
    sets = []
    for model in (a, c):
        ex = model.model.layers[1].mlp.experts
        for e in range(4):
            gate_changed = (ex.gate_up_proj[e, :512] != d.gate_proj.weight).any(-1)
            up_changed = (ex.gate_up_proj[e, 512:] != d.up_proj.weight).any(-1)
            down_changed = (ex.down_proj[e] != d.down_proj.weight).any(0)
            assert torch.equal(gate_changed, up_changed) and torch.equal(gate_changed, down_changed)
            assert gate_changed.sum() == 128
            sets.append(frozenset(gate_changed.nonzero().flatten().tolist()))
    assert len(set(sets)) == 8  # 4 experts x 2 seeds, all different
    fresh = a.model.layers[1].mlp.experts.gate_up_proj[0, :512][torch.tensor(sorted(sets[0]))]
    assert 0.5 < fresh.std() / d.gate_proj.weight.std() < 2  # drawn with the dense matrix's statistics


# ------------------------------------------------------------------------------------------------- online
@pytest.mark.parametrize("ep_size", [2, 4])
def test_online_ranks_equal_offline_upcycling_then_slicing(ep_size, llama_dir):
    """Each rank, reading the sharded HF directory, builds exactly experts [r*E/EP, (r+1)*E/EP) of the offline
    MoE built in memory (with granularity 2 and noise, so slices, scaling and seeding are all checked)."""
    path, hf = llama_dir
    kw = dict(num_experts=8, top_k=4, granularity=2, noise=0.3, seed=11)
    full = upcycle(MulaForCausalLM.from_hf(hf), **kw).state_dict()
    for rank in range(ep_size):
        local = upcycle(str(path), ep_rank=rank, ep_size=ep_size, **kw)
        start, stop = rank * 8 // ep_size, (rank + 1) * 8 // ep_size
        sd = local.state_dict()
        assert set(sd) == set(full)
        for key, value in sd.items():
            expected = full[key][start:stop] if ".experts." in key else full[key]
            assert torch.equal(value, expected), key
        experts = local.model.layers[0].mlp.experts
        assert (experts.num_experts, experts.expert_range) == (stop - start, (start, stop))
        up = local.config.extra["upcycle"]
        assert (up["ep_rank"], up["ep_size"], up["local_experts"]) == (rank, ep_size, [start, stop])
        assert local.config.num_experts == 8  # the config describes the global MoE


def _count_file_reads(monkeypatch) -> list:
    """Record every tensor box read from a safetensors file, at the file: (key, shape read, bytes read)."""
    reads, read_into = [], SafetensorsFile.read_into

    def counting(self, key, bounds, out):
        reads.append((key, tuple(out.shape), out.numel() * out.element_size()))
        return read_into(self, key, bounds, out)

    monkeypatch.setattr(SafetensorsFile, "read_into", counting)
    return reads


def test_sharded_directory_reads_only_the_ffn_slices_a_rank_needs(llama_dir, monkeypatch):
    """E8, G4, EP4: rank 1 holds experts 2-3 = slices 2 and 3 of copy 0, so it reads half of each FFN matrix,
    every other tensor once, and nothing else; with G1 every FFN tensor is read once, not once per expert."""
    path, hf = llama_dir
    reads = _count_file_reads(monkeypatch)
    upcycle(str(path), num_experts=8, top_k=4, granularity=4, ep_rank=1, ep_size=4)
    ffn = [(k, s) for k, s, _ in reads if ".mlp." in k]
    assert sorted(ffn) == sorted(
        (f"model.layers.{i}.mlp.{n}", shape)
        for i in range(2)
        for n, shape in (("gate_proj.weight", (24, 64)), ("up_proj.weight", (24, 64)), ("down_proj.weight", (64, 24)))
        for _ in range(2)  # slices 2 and 3
    )
    others = [k for k, _, _ in reads if ".mlp." not in k]
    assert sorted(others) == sorted(k for k in hf.state_dict() if ".mlp." not in k)
    ffn_bytes = sum(b for k, _, b in reads if ".mlp." in k)
    dense_ffn_bytes = sum(v.numel() * 4 for k, v in hf.state_dict().items() if ".mlp." in k)
    assert ffn_bytes * 2 == dense_ffn_bytes
    reads.clear()
    upcycle(str(path), num_experts=8, top_k=2, ep_rank=0, ep_size=2)
    keys = [k for k, _, _ in reads]
    assert sorted(keys) == sorted(hf.state_dict()) and len(keys) == len(set(keys))


def test_expert_memory_per_rank_is_the_rank_share_of_the_full_moe(llama_dir, capsys):
    """Per rank, the expert tensors materialised are 1/EP of the full MoE's, and everything read from disk plus
    those experts stays below the full MoE's expert bytes from EP 2 on (printed for EP 1, 2, 4, 8)."""
    path, _ = llama_dir
    rows = []
    for ep in (1, 2, 4, 8):
        st = upcycle_state_dict(str(path), UpcycleSpec(num_experts=8, top_k=2), ep_rank=ep - 1, ep_size=ep)
        rows.append((ep, st.expert_bytes, st.bytes_read, st.full_expert_bytes))
        assert st.expert_bytes * ep == st.full_expert_bytes
        if ep > 1:
            assert st.expert_bytes + st.bytes_read < st.full_expert_bytes
    with capsys.disabled():
        print("\nonline upcycling E8T2 of a tiny Llama (2 layers, H 64, I 96), per rank:")
        for ep, local, read, full in rows:
            print(f"  EP={ep}: expert tensors {local:>8,} B (+ {read:>7,} B read) vs full MoE experts {full:>8,} B")


def _upcycle_on_rank(rank: int, world_size: int, path: str, ep_size: int) -> dict:
    """Per-rank body: build the DP x EP topology, upcycle this rank's experts from ``path`` with its EP group, then
    make the model expert parallel and run it on the same tokens as the dense model."""
    from mula_lightning.parallel.expert_parallel import apply_expert_parallel
    from mula_lightning.parallel.topology import build_topology

    topology = build_topology(ep_size=ep_size)
    model = upcycle(path, num_experts=4, top_k=2, noise=0.1, ep_group=topology.ep_group)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    exact = upcycle(path, num_experts=4, top_k=2, ep_group=topology.ep_group, moe_impl="fast")
    apply_expert_parallel(exact, topology.ep_group)
    dense = load_model_only(path).eval()
    gap = _gap(_logits(exact.eval(), X), _logits(dense, X))
    return {"ep_rank": topology.ep_rank, "state": state, "gap": gap}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,ep_size", [(2, 2), (4, 4)])
def test_online_ranks_over_gloo_equal_offline(world_size, ep_size, tmp_path):
    """Real gloo processes: upcycle(..., ep_group=topology.ep_group) from a Mula model-only checkpoint gives each
    rank its EP slice of the offline MoE, tensor for tensor (noise included), and the local model plugs straight
    into apply_expert_parallel, whose expert-parallel forward reproduces the dense logits within 1e-5."""
    from mula_lightning.testing import run_pooled_test

    dense = _tiny_dense()
    path = str(save_model_only(dense, tmp_path / "dense"))
    results = run_pooled_test(_upcycle_on_rank, world_size, path=path, ep_size=ep_size)
    full = upcycle(dense, num_experts=4, top_k=2, noise=0.1).state_dict()
    per = 4 // ep_size
    for rank, result in enumerate(results):
        assert result["ep_rank"] == rank % ep_size
        start = result["ep_rank"] * per
        for key, value in full.items():
            expected = value[start : start + per] if ".experts." in key else value
            assert torch.equal(result["state"][key], expected), (rank, key)
        assert result["gap"] < 1e-5, (rank, result["gap"])


# ----------------------------------------------------------------------------------------------- sources
@pytest.mark.parametrize("layout", ["model-only", "hf-olmoe-1-expert", "state-dict"])
def test_every_source_kind_upcycles_to_the_same_model(layout, tiny_dense, tmp_path):
    """A dense q/k-norm model gives the same MoE whether it comes as a model, a state dict, a Mula model-only
    checkpoint or its transformers export (a one-expert OLMoE, fused experts)."""
    expected = upcycle(tiny_dense, num_experts=4, top_k=2).state_dict()
    if layout == "model-only":
        source, config = save_model_only(tiny_dense, tmp_path / "ckpt"), None
    elif layout == "hf-olmoe-1-expert":
        source, config = save_hf(tiny_dense, tmp_path / "hf"), None
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "olmoe"
    else:
        source, config = tiny_dense.state_dict(), tiny_dense.config
    got = upcycle(source, num_experts=4, top_k=2, config=config).state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def test_tied_llama_directory_and_dtype_cast(tmp_path):
    """A tied-embedding Llama (no lm_head in its file) upcycles with the head re-tied and the logits kept;
    dtype=bfloat16 casts every tensor, the router included."""
    hf = _hf_llama(2, tie_word_embeddings=True)
    hf.save_pretrained(str(tmp_path / "tied"))
    moe = upcycle(str(tmp_path / "tied"), num_experts=4, top_k=2).eval()
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    assert _gap(_logits(moe, X), _logits(hf, X)) < 1e-5
    half = upcycle(str(tmp_path / "tied"), num_experts=4, top_k=2, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_model_only_checkpoint_round_trip_and_refuses_a_local_slice(tmp_path):
    """save/load_model_only restore config and tensors exactly (tied embeddings re-tied); an expert-parallel
    local model cannot be saved as a full checkpoint."""
    tied = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", vocab_size=97, tie_word_embeddings=True))
    back = load_model_only(save_model_only(tied, tmp_path / "a"))
    assert back.config == tied.config and back.lm_head.weight is back.model.embed_tokens.weight
    assert all(torch.equal(p, q) for p, q in zip(tied.state_dict().values(), back.state_dict().values()))
    local = upcycle(_tiny_dense(), num_experts=4, top_k=2, ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match=r"experts.gate_up_proj': \(\(2, 1024, 128\), \(4, 1024, 128\)\)"):
        save_model_only(local, tmp_path / "b")


# --------------------------------------------------------------------------------------------- bad input
def test_bad_arguments_name_the_values(tiny_dense):
    """Sizes that do not divide and out-of-range values raise ValueErrors naming them."""
    cases = [
        (dict(num_experts=6, ep_size=4), r"num_experts \(6\) must be divisible by ep_size \(4\)"),
        (dict(granularity=3), r"granularity \(3\) must divide the dense FFN size intermediate_size \(512\)"),
        (dict(num_experts=6, granularity=4), r"num_experts \(6\) must be a positive multiple of granularity \(4\)"),
        (dict(shared_experts=2), r"shared experts of width 1024 .*must be its intermediate_size \(512\)"),
        (dict(shared_expert_intermediate_size=256, shared_expert_gate=True), r"shared experts of width 256"),
        (dict(noise=1.5), r"noise \(1.5\) must be a fraction"),
        (dict(ep_rank=2, ep_size=2), r"ep_rank \(2\) must be in \[0, ep_size \(2\)\)"),
        (dict(router="st"), r"router \('st'\) must be one of"),
    ]
    for kw, pattern in cases:
        args = dict(num_experts=8, top_k=2)
        args.update(kw)
        with pytest.raises(ValueError, match=pattern):
            upcycle(tiny_dense, **args)


def test_spec_for_a_model_takes_its_moe_shape_and_refuses_unknown_options():
    """UpcycleSpec.for_model copies the MoE shape a training job's model config fixes (experts, top-k, router,
    renormalisation, capacity) and accepts only the training options; a dense target config is named."""
    moe = MulaConfig.from_name("mula-tiny-moe", router_kind="softmax_topk", norm_topk_prob=True, capacity_factor=2.0)
    spec = UpcycleSpec.for_model(moe, granularity=2, noise=0.1)
    assert (spec.num_experts, spec.top_k, spec.router) == (moe.num_experts, moe.top_k, "softmax_topk")
    assert (spec.norm_topk_prob, spec.capacity_factor, spec.granularity, spec.noise) == (True, 2.0, 2, 0.1)
    with pytest.raises(ValueError, match=r"unknown upcycle options \['top_k'\]; known: granularity, noise"):
        UpcycleSpec.for_model(moe, top_k=4)
    with pytest.raises(ValueError, match=r"the model config \(mula-tiny-dense\) has no experts"):
        UpcycleSpec.for_model(MulaConfig.from_name("mula-tiny-dense"))


def test_moe_checkpoints_given_as_dense_are_refused(tmp_path):
    """A MoE model, a transformers Mixtral directory, or MoE tensors under a dense config are named as MoE."""
    with pytest.raises(ValueError, match=r"is a MoE checkpoint \(num_experts=8, top_k=2\)"):
        upcycle(MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", vocab_size=97)), num_experts=8, top_k=2)
    import transformers

    mixtral = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    transformers.MixtralForCausalLM(mixtral).save_pretrained(str(tmp_path / "mixtral"))
    with pytest.raises(ValueError, match=r"mixtral directory .* is a MoE checkpoint \(num_experts=4, top_k=2\)"):
        upcycle(str(tmp_path / "mixtral"), num_experts=8, top_k=2)
    moe_sd = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", vocab_size=97)).state_dict()
    dense_cfg = MulaConfig.from_name("mula-tiny-dense", vocab_size=97, intermediate_size=128)
    with pytest.raises(ValueError, match=r"dense config but MoE tensors \['model.layers.0.mlp.experts.down_proj'"):
        upcycle(moe_sd, num_experts=8, top_k=2, config=dense_cfg)


def test_missing_ffn_tensors_are_named(llama_dir, tmp_path):
    """A sharded directory without layer 1's up_proj names the layer and the key; a shard the index lists but
    that is gone is named too."""
    path, _ = llama_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index_file = broken / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    up_file = index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    index_file.write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"missing FFN tensors of layers \[1\]: .*model.layers.1.mlp.up_proj.weight"):
        upcycle(str(broken), num_experts=4, top_k=2)
    (broken / up_file).unlink()  # the index lists the key again, but its shard is gone
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = up_file
    index_file.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="listed in the index but missing"):
        upcycle(str(broken), num_experts=4, top_k=2)


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_upcycles_a_llama_directory_into_mula_and_transformers_checkpoints(llama_dir, tmp_path, capsys):
    """``mula upcycle`` on a sharded tiny Llama writes a model-only checkpoint and a Mixtral directory; both (the
    latter loaded by transformers itself) compute the dense model's logits within 1e-5."""
    import transformers

    from mula_lightning.cli import main

    path, hf = llama_dir
    out, hf_out = tmp_path / "moe", tmp_path / "moe-hf"
    argv = ["upcycle", "--from", str(path), "--experts", "4", "--top-k", "2", "--out", str(out)]
    assert main([*argv, "--hf-out", str(hf_out), "--seed", "5"]) == 0
    assert "E=4 K=2" in capsys.readouterr().out
    mula = load_model_only(out).eval()
    assert mula.config.num_experts == 4 and mula.config.extra["upcycle"]["seed"] == 5
    back = transformers.AutoModelForCausalLM.from_pretrained(str(hf_out), local_files_only=True).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    ref = _logits(hf, X)
    assert _gap(_logits(mula, X), ref) < 1e-5 and _gap(_logits(back, X), ref) < 1e-5
    mixed = tmp_path / "mixed"
    assert main([*argv[:-1], str(mixed), "--layers", "1", "--hf-out", str(tmp_path / "mixed-hf")]) == 1
    err = capsys.readouterr().err  # (transformers' loading progress bar comes first)
    assert "no transformers equivalent" in err.splitlines()[-1] and "Traceback" not in err  # one line, no traceback
    assert not mixed.exists()  # checked before anything was written
