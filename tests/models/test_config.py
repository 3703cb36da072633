"""MulaConfig: presets against Table 1 of the Aurora paper, analytic counts, and config errors."""

import pytest
import torch

from mula_lightning.models import PRESETS, MulaConfig, MulaForCausalLM
from mula_lightning.models.config import TABLE1_BILLIONS


@pytest.mark.parametrize("name", list(TABLE1_BILLIONS))
def test_presets_match_table1_within_two_percent(name):
    """Total and active parameter counts of every paper preset are within 2% of Table 1."""
    cfg = MulaConfig.from_name(name)
    total, active = TABLE1_BILLIONS[name]
    assert cfg.num_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert cfg.num_params(active=True) / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_device_model_has_the_formula_parameter_count(name):
    """Building any preset on the meta device allocates nothing and counts exactly what num_params() says."""
    cfg = MulaConfig.from_name(name)
    with torch.device("meta"):
        model = MulaForCausalLM(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    if cfg.is_moe:
        per_layer_inactive = (cfg.num_experts - cfg.top_k) * 3 * cfg.hidden_size * cfg.intermediate_size
        assert cfg.num_params() - cfg.num_params(active=True) == cfg.num_layers * per_layer_inactive
    else:
        assert cfg.num_params() == cfg.num_params(active=True)


def test_presets_follow_table1_shapes():
    """Table 1 shapes (layers, hidden, heads, head 128, intermediate, experts, top-k), vocab 50304, untied."""
    expected = {
        "mula-1b": (16, 2048, 16, 8192, 0, 0),
        "mula-7b-a1b": (16, 2048, 16, 1024, 64, 8),
        "mula-20b-a2b": (32, 2048, 16, 1024, 96, 8),
        "mula-100b-a7b": (48, 3072, 24, 1536, 144, 8),
        "mula-220b-a10b": (64, 3072, 24, 1536, 240, 8),
    }
    for name, shape in expected.items():
        c = MulaConfig.from_name(name)
        assert (c.num_layers, c.hidden_size, c.num_heads, c.intermediate_size, c.num_experts, c.top_k) == shape
        assert c.head_dim == 128 and c.vocab_size == 50304 and not c.tie_word_embeddings and c.qk_norm


def test_shared_expert_preset_is_mula_7b_a1b_with_todays_recipe():
    """``mula-7b-a1b-shared``: Mula-7B-A1B's shape with 7 routed experts + 1 always-on shared expert of the same width,
    so the same active parameters as Table 1's Mula-7B-A1B and one expert per layer more in total; DeepSeek-V3's
    routing (sigmoid, 8 groups keep 4, auxiliary-loss-free balancing, a small sequence-wise loss, no batch aux loss)."""
    base, shared = MulaConfig.from_name("mula-7b-a1b"), MulaConfig.from_name("mula-7b-a1b-shared")
    assert shared.num_params(active=True) == base.num_params(active=True)
    expert = 3 * base.hidden_size * base.intermediate_size
    assert shared.num_params() == base.num_params() + base.num_layers * expert
    assert (shared.num_experts, shared.top_k, shared.shared_experts) == (64, 7, 1)
    assert (shared.score_function, shared.n_group, shared.topk_group, shared.aux_loss_coef) == ("sigmoid", 8, 4, 0.0)
    assert shared.bias_update_rate > 0 and shared.seq_aux_loss_coef > 0
    from mula_lightning.models.cli import parameter_table

    row = next(r for r in parameter_table().splitlines() if r.startswith("mula-7b-a1b-shared "))
    assert row.split()[5:7] == ["64+1", "7"]  # routed + shared experts, routed top-k


def test_unknown_preset_lists_the_known_ones():
    """A typo in a preset name raises and the message lists every known preset."""
    with pytest.raises(ValueError) as err:
        MulaConfig.from_name("mula-7b")
    for name in PRESETS:
        assert name in str(err.value)


def test_overrides_apply_and_unknown_fields_are_named():
    """from_name(**overrides) changes fields; an unknown field is named in the error."""
    cfg = MulaConfig.from_name("mula-tiny-moe", top_k=1, capacity_factor=1.25)
    assert cfg.top_k == 1 and cfg.capacity_factor == 1.25
    with pytest.raises(ValueError, match="num_expert"):
        MulaConfig.from_name("mula-tiny-moe", num_expert=3)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(hidden_size=130, num_heads=4), r"hidden_size \(130\).*num_heads \(4\)"),
        (dict(num_heads=6, num_kv_heads=4, head_dim=32), r"num_heads \(6\).*num_kv_heads \(4\)"),
        (dict(top_k=9), r"top_k \(9\).*num_experts \(8\)"),
        (dict(router_kind="sigmoid"), "sigmoid"),
        (dict(capacity_factor=0.0), r"capacity_factor \(0.0\)"),
        (dict(head_dim=33), r"head_dim \(33\)"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_inconsistent_shapes_raise_with_the_values(overrides, fragment):
    """Shapes that do not divide (or make no sense) raise ValueError quoting the offending values."""
    with pytest.raises(ValueError, match=fragment):
        MulaConfig.from_name("mula-tiny-moe", **overrides)


def test_flops_per_token_counts_active_parameters():
    """6 x (active params - input embedding) + the attention term, so MoE FLOPs follow active, not total, size."""
    c = MulaConfig.from_name("mula-7b-a1b")
    dense_part = c.num_params(active=True) - c.vocab_size * c.hidden_size
    assert c.flops_per_token(2048) == 6 * dense_part + 12 * c.num_layers * c.q_dim * 2048
