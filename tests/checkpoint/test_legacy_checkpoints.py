"""Checkpoints written before optimizer state left ``ShardedTensor`` (and before the states took their parameters'
shapes) still load, into one process and at another layout, and what is saved from them again loads to the same
values.

The fixtures (``tests/checkpoint/legacy/<strategy>/``, written by ``make_legacy_checkpoints.py`` at 2acb738 on 2 gloo
processes) hold a tiny MoE after two AdamW steps, with ``expected.safetensors``: that checkpoint as the code of the
time loaded it into one process. Loading is a copy of stored numbers, so every comparison is exact.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.testing import run_pooled_test

LEGACY = Path(__file__).parent / "legacy"
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
        intermediate_size=8, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _one_process(kind: str, path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into one process with today's code: ``model.<key>``, ``optimizer.<key>``, ``step``."""
    model = MulaForCausalLM(_config())
    if kind == "zero_topo":
        from mula_lightning.checkpoint.dcp_format import load_dcp
        from mula_lightning.parallel.zero import state_dict as zc
        from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
        from mula_lightning.parallel.zero.layout import ZeroTopoLayout

        engine = HierarchicalZeroAdamW(model, ZeroTopoLayout(1, 1, 1), **HP, block_size=16)
        targets = {"model": zc.model_state_dict(engine, model), "optimizer": zc.optimizer_state_dict(engine, True)}
        load_dcp(path, targets)
        zc.load_model_state_dict(engine, targets["model"])
        zc.apply_optimizer_state_dict(engine, targets["optimizer"])
        model_state, optim = zc.full_model_state_dict(engine, model), zc.optimizer_state_dict(engine)
    else:
        from mula_lightning.checkpoint.sharded import load_sharded_checkpoint
        from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
        from mula_lightning.parallel.state_dict import optimizer_state_dict
        from mula_lightning.parallel.topology import build_topology

        topology = build_topology(1)
        opt = ShardedAdamW(model, topology, "ep_aware", **HP)
        load_sharded_checkpoint(path, {"model": model, "optimizer": opt}, topology)
        model_state, optim = model.state_dict(), optimizer_state_dict(opt)
    out = {f"model.{k}": v for k, v in model_state.items()}
    # today's optimizer states are shaped like their parameters; the fixtures stored them as 1-D vectors
    out.update({f"optimizer.{k}": v.reshape(-1) for k, v in optim.items() if isinstance(v, torch.Tensor)})
    out["step"] = torch.tensor(int(optim["step"]))
    return out


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: keys differ"
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


def _strategy(kind: str):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if kind == "zero_topo":  # saved with w = g = o = 2; loaded with w = 1 (each rank a whole primary copy)
        return FabricZeroTopoStrategy(block_size=16, ranks_per_node=2, ranks_per_gpu=1)
    return FabricEPSOStrategy(ep_size=1, sharded_optimizer="dp")  # saved at DP=1 x EP=2, ep_aware


def _load_and_save(rank, world_size, kind, legacy, again):
    from lightning.fabric import Fabric

    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(kind), precision="32-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(legacy, state)
    full = {k: v.clone() for k, v in full_state_dict(model, fabric.strategy).items()}
    fabric.save(again, state)
    return state["step"], full


@pytest.mark.parametrize("kind", ["zero_topo", "epso"])
def test_legacy_checkpoint_loads_in_one_process(kind):
    """The 2-rank ``ShardedTensor`` checkpoint loads into one process to exactly what the code that wrote it read."""
    expected = load_file(str(LEGACY / kind / "expected.safetensors"))
    _assert_equal(_one_process(kind, LEGACY / kind), expected, f"{kind}, one process")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["zero_topo", "epso"])
def test_legacy_checkpoint_loads_at_another_layout_and_saves_again(kind, tmp_path):
    """Loaded by 2 processes at another layout (zero_topo w=1 instead of 2; epso DP=2 x EP=1 instead of DP=1 x EP=2):
    the model and step are the stored ones; saved again in today's format and loaded into one process, model and
    optimizer states equal the stored ones."""
    expected = load_file(str(LEGACY / kind / "expected.safetensors"))
    again = tmp_path / "again"
    for step, full in run_pooled_test(_load_and_save, 2, kind=kind, legacy=str(LEGACY / kind), again=str(again)):
        assert step == int(expected["step"])
        model = {k[len("model.") :]: v for k, v in expected.items() if k.startswith("model.")}
        _assert_equal(full, model, f"{kind}, 2 processes")
    _assert_equal(_one_process(kind, again), expected, f"{kind}, saved again")
