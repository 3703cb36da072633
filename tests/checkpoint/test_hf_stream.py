"""``mula export`` of sharded checkpoints, streamed one tensor at a time, against the in-memory export.

The reference is the export as it was before streaming (``read_checkpoint`` then ``save_hf``: every tensor read,
the model built, the state dict converted and written at once). Both read the same stored numbers, so tensors,
configs and the transformers models' logits must be identical, bit for bit.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mula_lightning.checkpoint.export import export_to_hf, read_checkpoint
from mula_lightning.checkpoint.hf_stream import export_dcp_to_hf, write_safetensors_streaming
from mula_lightning.models import MulaConfig
from mula_lightning.models.hf_convert import save_hf
from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.fabric_run import fabric_after_one_step

SMALL = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=8)


def _config(kind):
    if kind == "moe":
        return MulaConfig.from_name("mula-tiny-moe", **SMALL, num_experts=4, top_k=2, moe_impl="fast")
    if kind == "qwen2_moe":  # q/k/v biases, a gated shared expert transformers names mlp.shared_expert
        return MulaConfig.from_name(
            "mula-tiny-moe", **SMALL, num_experts=4, top_k=2, moe_impl="fast", qk_norm=False, qkv_bias=True,
            shared_expert_intermediate_size=12, shared_expert_gate=True,
        )  # fmt: skip
    return MulaConfig.from_name("mula-tiny-dense", **SMALL)  # exported as a one-expert OLMoE: joins two tensors


def _save(rank, world_size, kind, path):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if kind != "dense":  # DP=2 x EP=2, experts sliced over EP
        strategy = FabricEPSOStrategy(ep_size=2)
    else:  # ZeRO-3 over 4 ranks: every tensor cut into flat-range pieces
        strategy = FabricZeroTopoStrategy(weight_size=4, grad_size=4, optimizer_size=4, block_size=16)
    fabric, model, optimizer = fabric_after_one_step(strategy, world_size, rank, _config(kind))
    fabric.save(path, {"model": model, "optimizer": optimizer})


def _tensors(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _logits(directory, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["moe", "dense", "qwen2_moe"])
def test_streamed_export_equals_the_in_memory_export(tmp_path, kind):
    """A checkpoint written by 4 processes (MoE and a Qwen2-MoE-shaped model: epso DP=2 x EP=2; dense: zero_topo
    ZeRO-3, flat-range pieces) and exported streamed gives the same transformers directory as the in-memory export:
    same tensors (names, dtypes, values), same config.json, identical logits; split into several files, the index
    names every tensor's file."""
    path = tmp_path / "ckpt"
    run_pooled_test(_save, 4, kind=kind, path=str(path))
    config = _config(kind)
    streamed, parameters, _ = export_to_hf(path, tmp_path / "streamed", config)
    model, _ = read_checkpoint(path, config)
    reference = save_hf(model, tmp_path / "reference")
    assert parameters == sum(p.numel() for p in model.parameters())
    got, expected = _tensors(streamed), _tensors(reference)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert json.loads((streamed / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(streamed, tokens), _logits(reference, tokens))

    split, _ = export_dcp_to_hf(path, tmp_path / "split", config, "model.", max_shard_bytes=4096)
    index = json.loads((split / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in split.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert sorted(index["weight_map"]) == sorted(expected)
    for name, file in index["weight_map"].items():
        with safe_open(str(split / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), expected[name]), name
    assert torch.equal(_logits(split, tokens), _logits(reference, tokens))


def test_streaming_writer_matches_safetensors_and_checks_what_it_is_given(tmp_path):
    """Tensors of several dtypes (bf16 included) and shapes written one by one read back equal through
    safetensors; a produced tensor of another shape or dtype than announced is refused, naming it."""
    values = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7, dtype=torch.float64),
        "c": torch.randn(2, 3, 4).to(torch.bfloat16),
        "d": torch.arange(5, dtype=torch.int64),
        "e": torch.ones(()),
    }
    entries = [(k, tuple(v.shape), v.dtype) for k, v in values.items()]
    write_safetensors_streaming(tmp_path / "x.safetensors", entries, lambda k: values[k])
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in values.items())
    with pytest.raises(ValueError, match=r"a: produced \(5, 3\) torch.float32, expected \(3, 5\)"):
        write_safetensors_streaming(tmp_path / "y.safetensors", entries, lambda k: values[k].t().contiguous())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # nothing half-written left behind
