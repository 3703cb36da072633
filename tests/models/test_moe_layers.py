"""``MulaConfig.moe_layers``: models whose decoder mixes dense and MoE feed-forward layers (partial upcycling)."""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.models.hf_convert import hf_family
from mula_lightning.models.transformer import MulaMLP
from mula_lightning.moe import FastSparseMoEBlock
from mula_lightning.moe.reference import ReferenceMoEBlock


def _mixed(**kw) -> MulaConfig:
    return MulaConfig.from_name("mula-tiny-moe", vocab_size=97, num_layers=4, moe_layers=[3, 1], **kw)


def test_moe_layers_choose_the_block_of_each_layer_and_are_stored_sorted():
    """Only the listed layers get an MoE block, the others a dense SwiGLU; None keeps every layer MoE."""
    cfg = _mixed()
    assert cfg.moe_layers == [1, 3] and cfg.num_moe_layers == 2
    kinds = [type(layer.mlp) for layer in MulaForCausalLM(cfg).model.layers]
    moe = FastSparseMoEBlock if cfg.moe_impl == "fast" else ReferenceMoEBlock
    assert kinds == [MulaMLP, moe, MulaMLP, moe]
    assert MulaConfig.from_name("mula-tiny-moe").num_moe_layers == 4
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_parameter_count_formula_matches_a_mixed_model():
    """num_params (total and active) counts dense FFNs in dense layers and experts in MoE layers only."""
    cfg = _mixed()
    with torch.device("meta"):
        model = MulaForCausalLM(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    unused_experts = cfg.num_moe_layers * (cfg.num_experts - cfg.top_k) * 3 * cfg.hidden_size * cfg.intermediate_size
    assert cfg.num_params(active=True) == cfg.num_params() - unused_experts


def test_aux_losses_come_from_the_moe_layers_only():
    """A mixed model returns one MoEAux per MoE layer, and its aux loss is their weighted sum."""
    model = MulaForCausalLM(_mixed())
    out = model(torch.randint(0, 97, (2, 9)))
    assert len(out.moe_aux) == 2
    torch.testing.assert_close(out.aux_loss, torch.stack([a.aux_loss for a in out.moe_aux]).sum())


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (dict(num_experts=0, top_k=0, moe_layers=[0]), "needs num_experts > 0"),
        (dict(moe_layers=[0, 4]), "offending: [4]"),
        (dict(moe_layers=[1, 1]), "duplicates"),
        (dict(moe_layers=[]), "non-empty"),
    ],
)
def test_bad_moe_layers_name_the_values(overrides, fragment):
    """Invalid moe_layers raise a ValueError naming the offending values."""
    with pytest.raises(ValueError, match="moe_layers") as err:
        MulaConfig.from_name("mula-tiny-moe", **overrides)
    assert fragment in str(err.value)


def test_mixed_models_cannot_be_exported_to_transformers():
    """OLMoE / Mixtral have MoE in every layer: exporting a mixed model names the layers; all-MoE lists export."""
    with pytest.raises(ValueError, match=r"moe_layers \(\[1, 3\]\) makes 2 of 4 layers dense"):
        hf_family(_mixed())
    assert hf_family(MulaConfig.from_name("mula-tiny-moe", moe_layers=[0, 1, 2, 3])) == "olmoe"
