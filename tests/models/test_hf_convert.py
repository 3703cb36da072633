"""Conversion with transformers (OLMoE, Mixtral, Llama, Qwen3-MoE, Qwen2-MoE): logits parity with HF's own models,
exact round trips, checkpoint directories."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.hf_convert import hf_family, save_hf

HF_CLASSES = {
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
}

LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _hf_model(family: str, seed: int, **kw) -> torch.nn.Module:
    """A tiny random transformers model of `family` (built locally; no hub)."""
    torch.manual_seed(seed)
    cfg_cls, model_cls = HF_CLASSES[family]
    base = dict(vocab_size=211, num_hidden_layers=2, eos_token_id=0, pad_token_id=None, bos_token_id=None)
    if family == "olmoe":
        base.update(hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4)
        base.update(num_experts=8, num_experts_per_tok=2)
    elif family == "mixtral":
        base.update(hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2)
        base.update(num_local_experts=4, num_experts_per_tok=2)
    elif family in ("qwen3_moe", "qwen2_moe"):  # experts of 24, dense layers of 72, head_dim 16 of 64 / 4 heads
        base.update(hidden_size=64, intermediate_size=72, moe_intermediate_size=24, num_attention_heads=4)
        base.update(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, head_dim=16)
        if family == "qwen2_moe":
            base.update(shared_expert_intermediate_size=40)
    else:
        base.update(hidden_size=64, intermediate_size=72, num_attention_heads=8, num_key_value_heads=2)
    base.update(kw)
    return model_cls(cfg_cls(**base)).eval()


CASES = [
    ("olmoe", {}),
    ("olmoe", dict(norm_topk_prob=True, num_experts=16, num_experts_per_tok=4)),
    ("olmoe", dict(num_key_value_heads=2, num_experts_per_tok=1)),
    ("mixtral", {}),
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3, head_dim=16)),
    ("llama", {}),
    ("llama", dict(rope_parameters=LLAMA3_ROPE, max_position_embeddings=128)),
    ("llama", dict(tie_word_embeddings=True, num_key_value_heads=8)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(mlp_only_layers=[0], norm_topk_prob=True)),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(decoder_sparse_step=2, qkv_bias=False, norm_topk_prob=True)),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family,kw", CASES)
def test_logits_and_loss_match_transformers(family, kw, seed):
    """Mula loaded from a random HF model gives the same logits (max abs diff < 1e-4, fp32) and loss."""
    hf = _hf_model(family, seed, **kw)
    mula = MulaForCausalLM.from_hf(hf).eval()
    x = torch.randint(0, 211, (2, 37), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref, got = hf(x, labels=x), mula(x, labels=x)
    assert (ref.logits - got.logits).abs().max().item() < 1e-4
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,kw", CASES)
def test_to_hf_round_trip_is_exact(family, kw):
    """HF -> Mula -> HF reproduces every tensor bit for bit and the same logits."""
    hf = _hf_model(family, 3, **kw)
    back = MulaForCausalLM.from_hf(hf).to_hf()
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 211, (1, 19))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, back(x).logits)


@pytest.mark.parametrize(
    "overrides, family",
    [
        (dict(), "olmoe"),  # mula-tiny-moe: qk-norm MoE
        (dict(router_kind="topk_softmax"), "olmoe"),
        (dict(num_experts=0, top_k=0, intermediate_size=96), "olmoe"),  # qk-norm dense -> one-expert OLMoE
        (dict(num_experts=0, top_k=0, qk_norm=False), "llama"),
        (dict(qk_norm=False, router_kind="topk_softmax", num_kv_heads=2), "mixtral"),
        (dict(qk_norm_per_head=True, moe_layers=[1], dense_intermediate_size=80), "qwen3_moe"),
        (dict(qk_norm=False, qkv_bias=True, shared_experts=2, shared_expert_gate=True), "qwen2_moe"),
    ],
)
def test_mula_models_export_to_the_equivalent_hf_family(overrides, family, capfd):
    """Every Mula flavour exports to the HF family that computes the same logits, and converts back exactly; the
    family's default special-token ids that lie outside the vocabulary are left out (transformers warns about them
    otherwise: OLMoE's EOS 50279 in a 101-token model), those inside it kept."""
    cfg = MulaConfig.from_name("mula-tiny-moe", vocab_size=101, hidden_size=64, num_layers=2, **overrides)
    mula = init_weights(MulaForCausalLM(cfg), seed=5).eval()
    assert hf_family(cfg) == family
    hf = mula.to_hf()
    ids = [getattr(hf.config, f"{name}_token_id", None) for name in ("bos", "eos", "pad")]
    assert all(i is None or 0 <= i < 101 for i in ids), ids
    assert family not in ("llama", "mixtral") or ids[:2] == [1, 2]
    assert "within the vocabulary" not in capfd.readouterr().err
    x = torch.randint(0, 101, (2, 23))
    with torch.no_grad():
        assert (hf(x).logits - mula(x).logits).abs().max().item() < 1e-4
    again = MulaForCausalLM.from_hf(hf)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in mula.state_dict().items())


def test_topk_softmax_equals_softmax_topk_with_renormalisation():
    """The Mixtral router (top-k then softmax) computes the same model as OLMoE's with norm_topk_prob=True."""
    a = MulaConfig.from_name("mula-tiny-moe", router_kind="topk_softmax")
    b = MulaConfig.from_name("mula-tiny-moe", router_kind="softmax_topk", norm_topk_prob=True)
    ma, mb = init_weights(MulaForCausalLM(a), 1), init_weights(MulaForCausalLM(b), 1)
    x = torch.randint(0, a.vocab_size, (2, 32))
    la, lb = ma(x, labels=x), mb(x, labels=x)
    torch.testing.assert_close(la.logits, lb.logits, rtol=1e-5, atol=1e-6)
    (la.loss + la.aux_loss).backward()
    (lb.loss + lb.aux_loss).backward()
    for (n, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7, msg=n)


def _expand_per_expert(sd: dict, family: str) -> dict:
    """Rewrite fused 5.x expert tensors into the per-expert keys that Hub checkpoints use."""
    out = {}
    for key, value in sd.items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len(".experts.gate_up_proj")]
            for e, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                if family == "mixtral":
                    p = prefix.replace(".mlp", ".block_sparse_moe")
                    out[f"{p}.experts.{e}.w1.weight"], out[f"{p}.experts.{e}.w3.weight"] = gate, up
                else:
                    out[f"{prefix}.experts.{e}.gate_proj.weight"], out[f"{prefix}.experts.{e}.up_proj.weight"] = (
                        gate,
                        up,
                    )
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len(".experts.down_proj")]
            for e, w in enumerate(value):
                if family == "mixtral":
                    out[f"{prefix.replace('.mlp', '.block_sparse_moe')}.experts.{e}.w2.weight"] = w
                else:
                    out[f"{prefix}.experts.{e}.down_proj.weight"] = w
        elif family == "mixtral" and ".mlp.gate." in key:
            out[key.replace(".mlp.", ".block_sparse_moe.")] = value
        else:
            out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.parametrize(
    "family,layout",
    [(f, lay) for f in ("olmoe", "mixtral", "llama") for lay in ("single", "sharded")]
    + [("olmoe", "per_expert"), ("mixtral", "per_expert"), ("qwen3_moe", "per_expert"), ("qwen2_moe", "single")],
)
def test_load_from_saved_directory(tmp_path, family, layout):
    """from_hf(dir) reads single-file, multi-file (index.json) and per-expert Hub-style safetensors."""
    hf = _hf_model(family, 11)
    if layout == "per_expert":
        hf.config.save_pretrained(tmp_path)
        save_file(_expand_per_expert(hf.state_dict(), family), str(tmp_path / "model.safetensors"))
    else:
        hf.save_pretrained(tmp_path, max_shard_size="100KB" if layout == "sharded" else "5GB")
        assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "sharded")
    mula = MulaForCausalLM.from_hf(tmp_path)
    x = torch.randint(0, 211, (2, 17))
    with torch.no_grad():
        assert (hf(x).logits - mula(x).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=48, shared_expert_gate=True)],
    ids=["olmoe", "qwen2_moe"],
)
def test_save_hf_writes_a_directory_transformers_loads(tmp_path, overrides):
    """save_hf (sharded) produces a directory that transformers' from_pretrained loads to the same logits (for
    Qwen2-MoE with random q/k/v biases: the shared expert written under transformers' name)."""
    cfg = MulaConfig.from_name("mula-tiny-moe", num_layers=2, **overrides)
    mula = init_weights(MulaForCausalLM(cfg), seed=2).eval()
    with torch.no_grad():
        for name, p in mula.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    save_hf(mula, tmp_path, max_shard_bytes=300_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 29))
    with torch.no_grad():
        assert (hf(x).logits - mula(x).logits).abs().max().item() < 1e-4


def test_missing_and_unexpected_keys_are_named(tmp_path):
    """A checkpoint with a missing and an extra tensor fails with both key names in the message."""
    hf = _hf_model("llama", 0)
    hf.config.save_pretrained(tmp_path)
    sd = dict(hf.state_dict())
    del sd["model.layers.1.self_attn.k_proj.weight"]
    sd["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError) as err:
        MulaForCausalLM.from_hf(tmp_path)
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "model.layers.0.mystery.weight" in str(err.value)


def test_missing_per_expert_tensor_is_named(tmp_path):
    """A Hub-style MoE checkpoint lacking one expert's up_proj names the expert and the tensor."""
    hf = _hf_model("olmoe", 0)
    hf.config.save_pretrained(tmp_path)
    sd = _expand_per_expert(hf.state_dict(), "olmoe")
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.*\(3, 'up_proj'\)"):
        MulaForCausalLM.from_hf(tmp_path)


def test_bad_directories_and_unsupported_configs(tmp_path):
    """No config.json, no weights, truncated weights, or an unsupported architecture give clear errors."""
    with pytest.raises(FileNotFoundError, match="config.json"):
        MulaForCausalLM.from_hf(tmp_path)
    hf = _hf_model("llama", 0)
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        MulaForCausalLM.from_hf(tmp_path)
    hf.save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        MulaForCausalLM.from_hf(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        MulaForCausalLM.from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)))
    with pytest.raises(ValueError, match="attention_bias"):
        MulaConfig.from_hf_config(transformers.LlamaConfig(attention_bias=True))


REFUSED = {
    "sigmoid scores, per-head q/k norm": (
        dict(qk_norm_per_head=True, score_function="sigmoid"),
        r"uses \{'score_function': 'sigmoid'\}: transformers' qwen3_moe cannot",
    ),
    "shared experts, per-head q/k norm": (
        dict(qk_norm_per_head=True, shared_experts=1),
        r"uses \{'shared_experts': 1\}: transformers' qwen3_moe cannot",
    ),
    "gated shared expert, full-width q/k norm": (
        dict(shared_expert_gate=True, shared_experts=1),
        r"uses \{'qk_norm': True\}: transformers' qwen2_moe cannot",
    ),
    "ungated shared experts": (
        dict(shared_experts=1),
        r"uses \{'shared_experts': 1\}: the transformers families this export writes",
    ),
    "groups and a selection bias": (
        dict(n_group=2, topk_group=1, bias_update_rate=1e-3),
        r"uses \{'n_group': 2, 'bias_update_rate': 0.001\}",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_models_no_transformers_family_computes_are_refused(case):
    """A Mula model that no exported family computes (DeepSeek-style routing, shared experts beside a per-head q/k
    norm, a gated shared expert beside a full-width q/k norm) is refused by name, never exported to compute
    otherwise."""
    overrides, fragment = REFUSED[case]
    with torch.device("meta"):
        model = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", **overrides))
    with pytest.raises(ValueError, match=fragment):
        model.to_hf()
