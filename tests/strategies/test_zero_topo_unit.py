"""The zero_topo strategy without processes: registration, settings validation, optimizer take-over."""

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.strategies import FabricZeroTopoStrategy, ZeroTopoStrategy
from mula_lightning.strategies.zero_topo import ZeroTopoSettings, build_engine


def test_registered_under_zero_topo_for_fabric_and_trainer():
    """Importing the package registers both classes as "zero_topo" (Fabric(strategy=...) / Trainer(strategy=...))."""
    assert STRATEGY_REGISTRY["zero_topo"]["strategy"] is FabricZeroTopoStrategy
    assert StrategyRegistry["zero_topo"]["strategy"] is ZeroTopoStrategy


def test_settings_layout_defaults_and_errors():
    """Explicit topology gives the paper's sizes; sizes breaking the dependency rule fail with their values."""
    lay = ZeroTopoSettings(ranks_per_node=4, ranks_per_gpu=2).layout(8)
    assert (lay.weight_size, lay.grad_size, lay.optimizer_size, lay.secondary_size) == (2, 4, 8, 2)
    with pytest.raises(ValueError, match=r"P_g=2, P_w=4"):
        ZeroTopoSettings(ranks_per_node=4, weight_size=4, grad_size=2).layout(8)
    strategy = FabricZeroTopoStrategy(quantize_weights=True, block_size=64, ranks_per_node=1)
    assert strategy.settings.engine_kwargs()["quantize_weights"] and strategy.settings.block_size == 64


def test_build_engine_keeps_param_groups_and_refuses_other_optimizers():
    """The user's AdamW param groups and hyper-parameters carry over; SGD is refused with its name."""
    model = MulaForCausalLM(MulaConfig.from_name("mula-tiny-dense", num_layers=1, vocab_size=64, hidden_size=32))
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    engine = build_engine(model, opt, ZeroTopoSettings(ranks_per_node=1, block_size=16), 1, {})
    assert [g["weight_decay"] for g in engine.param_groups] == [0.01, 0.0] and engine.param_groups[0]["lr"] == 1e-3
    with pytest.raises(TypeError, match="SGD"):
        build_engine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroTopoSettings(ranks_per_node=1), 1, {})
