"""``HfStore``: a transformers directory read one Mula tensor, or one box of it, at a time equals the in-memory
conversion, and reads only the bytes of what is asked for.

The reference is :func:`~mula_lightning.models.hf_convert.hf_to_mula_state_dict` of the whole directory
(``load_hf_directory``), the conversion ``MulaForCausalLM.from_hf`` is held to against transformers' logits.
Directories are written by transformers' own ``save_pretrained`` (fused 5.x expert tensors, one or several files),
by ``save_hf`` (a dense model as a one-expert OLMoE), and in the Hub's per-expert layout (OLMoE / Qwen3-MoE names,
Mixtral's ``block_sparse_moe.experts.E.w1``).
"""

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.hf_convert import config_from_hf, hf_to_mula_state_dict, load_hf_directory, save_hf
from mula_lightning.models.hf_store import HfStore

SHAPE = dict(vocab_size=97, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(intermediate_size=24, moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2)
FAMILIES = {
    "olmoe": (transformers.OlmoeConfig, dict(intermediate_size=12, num_experts=6, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(**MOE, head_dim=8, decoder_sparse_step=1)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(**MOE, shared_expert_intermediate_size=20)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=12, num_local_experts=6, num_experts_per_tok=2)),
    "llama": (transformers.LlamaConfig, dict(intermediate_size=40)),
}


def _per_expert(state: dict, mixtral: bool) -> dict:
    """The Hub's layout: one tensor per expert and projection (Mixtral: ``block_sparse_moe``, ``w1 / w3 / w2``)."""
    out = {}
    for key, value in state.items():
        stem, _, leaf = key.rpartition(".experts.")
        moe = stem.replace(".mlp", ".block_sparse_moe") if mixtral else stem
        if leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in value):
                names = ("w1", "w3") if mixtral else ("gate_proj.weight", "up_proj.weight")
                for name, part in zip(names, (gate, up)):
                    out[f"{moe}.experts.{e}.{name}" + (".weight" if mixtral else "")] = part.contiguous()
        elif leaf == "down_proj":
            for e, part in enumerate(value):
                out[f"{moe}.experts.{e}." + ("w2.weight" if mixtral else "down_proj.weight")] = part.contiguous()
        else:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral else key] = value.contiguous()
    return out


def _directory(tmp_path, family, layout):
    if family == "dense as one expert":  # save_hf writes a dense q/k-norm Mula model as a one-expert OLMoE
        config = MulaConfig.from_name("mula-tiny-dense", vocab_size=97, hidden_size=32, num_layers=2,
                                      num_heads=4, num_kv_heads=2, intermediate_size=24)  # fmt: skip
        return save_hf(init_weights(MulaForCausalLM(config), seed=4), tmp_path / "hf")
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra, eos_token_id=0))
    path = tmp_path / "hf"
    if layout == "per expert":
        hf.config.save_pretrained(path)
        save_file(_per_expert(hf.state_dict(), family == "mixtral"), str(path / "model.safetensors"))
    else:
        hf.save_pretrained(path, max_shard_size="40KB" if layout == "several files" else "5GB")
    return path


CASES = [
    ("olmoe", "one file"), ("olmoe", "per expert"), ("qwen3_moe", "per expert"), ("qwen2_moe", "several files"),
    ("mixtral", "per expert"), ("llama", "several files"), ("dense as one expert", "one file"),
]  # fmt: skip


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}, {lay}" for f, lay in CASES])
def test_every_tensor_and_box_equals_the_in_memory_conversion(tmp_path, family, layout):
    """Every Mula tensor read whole equals the converted one; random boxes (expert rows, row and column ranges,
    empty ones) equal that box, and the raw bytes read from the files are exactly the box's: no expert, row or
    column outside it is read."""
    path = _directory(tmp_path, family, layout)
    hf_config, state = load_hf_directory(path)
    config = config_from_hf(hf_config)
    reference = hf_to_mula_state_dict(state, config)
    store = HfStore(path, config)
    with torch.device("meta"):
        expected = dict(MulaForCausalLM(config).named_parameters())
    assert set(expected) <= store.keys()
    g = torch.Generator().manual_seed(0)
    for name in expected:
        value = reference[name]
        assert store.shape(name) == tuple(value.shape) and torch.equal(store.read(name), value), name
        for _ in range(3):
            box = []
            for size in value.shape:
                a = int(torch.randint(0, size + 1, (1,), generator=g))
                box.append(slice(a, int(torch.randint(a, size + 1, (1,), generator=g))))
            before = store.files.bytes_read
            part = store.read(name, tuple(box))
            assert torch.equal(part, value[tuple(box)]), (name, box)
            assert store.files.bytes_read - before == part.numel() * part.element_size(), (name, box)


def test_bad_per_expert_checkpoints_and_a_dense_config_for_experts_are_named(tmp_path):
    """A Hub-style checkpoint missing one expert's tensor names the layer, the expert and the projection; expert ids
    with a gap are named; a dense config cannot read several experts."""
    path = _directory(tmp_path, "olmoe", "per expert")
    hf_config, state = load_hf_directory(path)
    config = config_from_hf(hf_config)
    for drop, match in [
        ("model.layers.1.mlp.experts.3.up_proj.weight", r"model.layers.1.mlp: missing .*\(3, 'up_proj'\)"),
        ("model.layers.0.mlp.experts.2.", r"model.layers.0.mlp: expert ids are not contiguous from 0: \[0, 1, 3"),
    ]:
        broken = tmp_path / drop
        hf_config.save_pretrained(broken)
        save_file({k: v for k, v in state.items() if not k.startswith(drop)}, str(broken / "model.safetensors"))
        with pytest.raises(KeyError, match=match):
            HfStore(broken, config)
    dense = MulaConfig(**{**config.to_dict(), "num_experts": 0, "top_k": 0})
    with pytest.raises(ValueError, match="model.layers.0.mlp: a dense config cannot load 6 experts"):
        HfStore(path, dense)
