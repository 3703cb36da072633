"""Online upcycling at strategy setup: ``FabricEPSOStrategy(init_from_dense=...)`` builds each rank's experts from
a dense checkpoint, and the resulting expert-parallel MoE computes the dense model's function.

The function is compared in float64 (``precision="64-true"``: the float32 checkpoint's values, computed in float64)
with :func:`mula_lightning.testing.assert_parity`; Fabric hands the logits back in float32 (one rounding)."""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.checkpoint_io import save_model_only
from mula_lightning.models.upcycle import upcycle
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import DistributedTestError, assert_parity, run_pooled_test

SHAPE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=24)


def _dense():
    return init_weights(MulaForCausalLM(MulaConfig.from_name("mula-tiny-dense", **SHAPE)), seed=3)


def _moe_config(**overrides):
    values = dict(SHAPE, num_experts=4, top_k=2, router_kind="topk_softmax", moe_impl="fast")
    values.update(overrides)
    return MulaConfig.from_name("mula-tiny-moe", **values)


def _tokens():
    return torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))


def _setup_upcycled(rank, world_size, path, **overrides):
    strategy = FabricEPSOStrategy(ep_size=2, init_from_dense=path, upcycle={"seed": 1})
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_moe_config(**overrides))
    model = fabric.setup_module(model)
    with torch.no_grad():
        logits = model(_tokens()).logits
    full = gather_expert_parallel_state_dict(model.module, strategy.topology.ep_group)
    return logits, {k: v.clone() for k, v in full.items()}


@pytest.mark.distributed
def test_setup_upcycles_online_and_keeps_the_dense_function(tmp_path):
    """2 ranks (EP=2) upcycle a dense model-only checkpoint at setup: logits equal the dense model's (float64, then
    one float32 rounding), and the gathered weights equal offline upcycling tensor for tensor."""
    dense = _dense()
    path = str(save_model_only(dense, tmp_path / "dense"))
    with torch.no_grad():
        expected = dense.to(torch.float64)(_tokens()).logits
    offline = upcycle(_dense(), num_experts=4, top_k=2, seed=1).state_dict()
    for logits, full in run_pooled_test(_setup_upcycled, 2, path=path, timeout=180):
        # float64 rounding along the model (~1e-13) plus the float32 rounding of the returned logits: 2 x eps32
        assert_parity(logits.double(), expected, reduction_len=2, dtype=torch.float32, msg="upcycled logits")
        assert set(full) == set(offline)
        assert all(torch.equal(full[k], v.double()) for k, v in offline.items())


@pytest.mark.distributed
def test_a_dense_checkpoint_that_does_not_fit_the_model_is_named(tmp_path):
    """A model config whose shapes differ from the dense checkpoint (hidden 48 vs 32) fails with the tensors named."""
    path = str(save_model_only(_dense(), tmp_path / "dense"))
    with pytest.raises(DistributedTestError, match="does not fit the model config"):
        run_pooled_test(_setup_upcycled, 2, path=path, hidden_size=48, timeout=180)
