"""``init_from`` sources: every kind of weights a run can start from gives back exactly the stored tensors, expert
rows are read as slices, and a source that does not fit is named before anything is copied."""

from __future__ import annotations

import json

import pytest
import torch

from mula_lightning.checkpoint.init_source import InitWeights, init_source_config, init_source_kind
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.checkpoint_io import save_model_only
from mula_lightning.models.hf_convert import save_hf

SHAPE = dict(vocab_size=80, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=16)


def _model(preset="mula-tiny-moe", seed=3, **overrides):
    extra = dict(num_experts=4, top_k=2) if preset == "mula-tiny-moe" else {}
    config = MulaConfig.from_name(preset, **{**SHAPE, **extra, **overrides})
    return init_weights(MulaForCausalLM(config), seed=seed)


def _fresh(config):
    """The same architecture with other weights, so that a load that copies nothing fails the comparison."""
    return init_weights(MulaForCausalLM(config), seed=99)


def _assert_same(a: MulaForCausalLM, b: MulaForCausalLM):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k


def test_model_only_source_loads_exactly_and_reads_expert_rows_as_slices(tmp_path):
    """A model-only directory: its config comes back, every parameter equals the stored one bit for bit, and asking
    for the rows of one expert slice reads only those bytes."""
    source = _model()
    path = save_model_only(source, tmp_path / "weights")
    assert init_source_kind(path) == "model-only"
    assert init_source_config(path) == source.config
    loaded = InitWeights(path).load_into(_fresh(source.config))
    _assert_same(loaded, source)

    weights = InitWeights(path)
    name = "model.layers.0.mlp.experts.down_proj"
    full = dict(source.named_parameters())[name]
    part = weights.read(source.config, name, slice(2, 4))
    assert torch.equal(part, full[2:4])
    assert weights.store.bytes_read == full[2:4].numel() * full.element_size()


FAMILIES = {
    "olmoe": ("mula-tiny-moe", {}),
    "olmoe, one expert (a dense model with q/k norm)": ("mula-tiny-dense", {}),
    "qwen3_moe": ("mula-tiny-moe", dict(qk_norm_per_head=True, moe_layers=[1], dense_intermediate_size=48)),
    "qwen2_moe": ("mula-tiny-moe", dict(qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=24,
                                        shared_expert_gate=True)),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_directory_source_computes_the_same_function(tmp_path, family):
    """A transformers directory (OLMoE for the MoE and the dense q/k-norm model, Qwen3-MoE and Qwen2-MoE) gives the
    Mula config back and parameters equal to the exported ones."""
    preset, overrides = FAMILIES[family]
    source = _model(preset, **overrides)
    path = save_hf(source, tmp_path / "hf")
    assert json.loads((path / "config.json").read_text())["model_type"] == family.split(",")[0]
    assert init_source_kind(path) == "transformers"
    config = init_source_config(path)
    assert config.vocab_size == source.config.vocab_size and config.num_experts == source.config.num_experts
    _assert_same(InitWeights(path).load_into(_fresh(config)), source)


def test_selection_bias_travels_with_a_model_only_source(tmp_path):
    """A model trained with auxiliary-loss-free balancing: its routers' biases load with its weights; a source without
    a bias (a model trained with the loss) gives a biased config zero biases, whatever the buffer held before."""
    source = _model(bias_update_rate=0.01)
    with torch.no_grad():
        for layer in source.model.layers:
            layer.mlp.gate.e_score_correction_bias.normal_()
    loaded = InitWeights(save_model_only(source, tmp_path / "biased")).load_into(_fresh(source.config))
    _assert_same(loaded, source)
    plain = save_model_only(_model(), tmp_path / "plain")
    target = _fresh(source.config)
    target.model.layers[0].mlp.gate.e_score_correction_bias.fill_(float("nan"))
    InitWeights(plain).load_into(target)
    assert all(torch.equal(layer.mlp.gate.e_score_correction_bias, torch.zeros(4)) for layer in target.model.layers)


def test_full_checkpoint_source_reads_the_stored_config_and_the_model_tensors_only(tmp_path):
    """A Lightning ``.ckpt`` written by MulaLM (state dict under ``model.``, config under ``mula``): config and weights
    come back, the optimizer entries are ignored."""
    source = _model()
    ckpt = tmp_path / "run.ckpt"
    state = {f"model.{k}": v for k, v in source.state_dict().items()}
    torch.save(
        {"state_dict": state, "optimizer_states": [{"state": {}}], "mula": {"config": source.config.to_dict()}}, ckpt
    )
    assert init_source_kind(ckpt) == "full checkpoint"
    assert init_source_config(ckpt) == source.config
    _assert_same(InitWeights(ckpt).load_into(_fresh(source.config)), source)


def test_bad_sources_are_named(tmp_path):
    """A missing path, a folder of something else, a config without weights, a checkpoint without a config and weights
    of another shape each raise an error that names the path (and the tensors)."""
    with pytest.raises(FileNotFoundError, match="nowhere: no such file"):
        init_source_kind(tmp_path / "nowhere")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match="notes: not a model-only checkpoint"):
        init_source_kind(tmp_path / "notes")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "config.json").write_text(json.dumps(_model().config.to_dict()))
    with pytest.raises(FileNotFoundError, match="without model.safetensors"):
        init_source_kind(lonely)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(ValueError, match="holds no model config"):
        init_source_config(foreign)
    path = save_model_only(_model(), tmp_path / "weights")
    other = MulaConfig(**{**_model().config.to_dict(), "hidden_size": 48})
    with pytest.raises(ValueError, match=r"does not fit the model config.*source \(80, 32\) vs model \(80, 48\)"):
        InitWeights(path).load_into(MulaForCausalLM(other))


def _sources(tmp_path, source):
    """The same weights as a model-only directory, a Lightning ``.ckpt``, a one-process DCP directory and a
    transformers directory."""
    import torch.distributed.checkpoint as dcp

    state = {f"model.{k}": v for k, v in source.state_dict().items()}
    ckpt = tmp_path / "run.ckpt"
    torch.save({"state_dict": state, "mula": {"config": source.config.to_dict()}}, ckpt)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return {"model-only": save_model_only(source, tmp_path / "weights"), ".ckpt": ckpt, "dcp": tmp_path / "dcp",
            "transformers": save_hf(source, tmp_path / "hf")}  # fmt: skip


@pytest.mark.parametrize("kind", ["model-only", ".ckpt", "dcp", "transformers"])
def test_read_range_reads_only_the_range_from_every_source(tmp_path, kind):
    """``InitWeights.read_range`` (what a ZeRO weight chunk reads): random flat ranges of every parameter, inside a
    row, across rows, whole tensors and empty, equal the flattened parameter's elements in the buffer's dtype, and
    the store counts exactly the range's bytes (no whole tensor is read to cut a range out of it)."""
    source = _model()
    weights = InitWeights(_sources(tmp_path, source)[kind])
    g = torch.Generator().manual_seed(1)
    for name, value in source.named_parameters():
        flat = value.detach().reshape(-1)
        for start, count in [(0, flat.numel()), (flat.numel() // 2, 0)] + [
            (s := int(torch.randint(0, flat.numel(), (1,), generator=g)),
             int(torch.randint(0, flat.numel() - s + 1, (1,), generator=g))) for _ in range(3)
        ]:  # fmt: skip
            out = torch.full((count,), float("nan"), dtype=torch.float64)
            before = weights.store.bytes_read
            weights.read_range(source.config, name, out, start)
            assert torch.equal(out, flat[start : start + count].double()), (name, start, count)
            assert weights.store.bytes_read - before == count * flat.element_size()
    (tmp_path / "again").mkdir()
    _assert_same(InitWeights(_sources(tmp_path / "again", source)[kind]).load_into(_fresh(source.config)), source)
