"""The epso strategy with Fabric: identical initialisation across layouts, checkpoints across layouts,
activation checkpointing and regional compile, bf16-true precision, and clear errors for bad settings."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import DistributedTestError, run_pooled_test


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
        moe_impl="fast",
    )


def _setup(world_size, ep, mode="ep_aware", precision="32-true", **strategy_kwargs):
    strategy = FabricEPSOStrategy(ep_size=ep, sharded_optimizer=mode, **strategy_kwargs)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return fabric, strategy, model, optimizer


def _train(fabric, model, optimizer, steps, rank, start=0):
    losses = []
    for step in range(start, start + steps):
        x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(step * 100 + rank))
        out = model(x, labels=x)
        fabric.backward(out.loss + out.aux_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((out.loss + out.aux_loss).item())
    return losses


def _full(strategy, model):
    return {
        k: v.clone() for k, v in gather_expert_parallel_state_dict(model.module, strategy.topology.ep_group).items()
    }


def _initial_state(rank, world_size, ep):
    _, strategy, model, _ = _setup(world_size, ep)
    return _full(strategy, model)


@pytest.mark.distributed
def test_every_layout_starts_bit_identical_to_one_process():
    """Meta-built models materialised at DP=2 x EP=2 and DP=4 x EP=1 equal init_weights(seed 0) bit for bit."""
    expected = init_weights(MulaForCausalLM(_config()), seed=0).state_dict()
    for ep in (2, 1):
        for state in run_pooled_test(_initial_state, 4, ep=ep, timeout=180):
            assert set(state) == set(expected)
            assert all(torch.equal(state[k], v) for k, v in expected.items())


def _save(rank, world_size, ep, mode, path):
    fabric, strategy, model, optimizer = _setup(world_size, ep, mode)
    _train(fabric, model, optimizer, 2, rank)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    return _full(strategy, model)


def _load(rank, world_size, ep, mode, path):
    fabric, strategy, model, optimizer = _setup(world_size, ep, mode)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    return _full(strategy, model), state["step"], remainder, strategy.sharded_optimizer._step


@pytest.mark.distributed
@pytest.mark.parametrize("save_at,load_at", [((4, 2, "ep_aware"), (2, 2, "dp")), ((2, 2, "dp"), (4, 2, "ep_aware"))])
def test_checkpoint_reshards_between_layouts_and_loads_in_one_process(tmp_path, save_at, load_at):
    """fabric.save at one DP x EP layout / mode, fabric.load at another: same weights, step and optimizer step;
    the same directory also loads into a plain single-process MulaForCausalLM with DCP."""
    path = str(tmp_path / "ckpt")
    saved = run_pooled_test(_save, save_at[0], ep=save_at[1], mode=save_at[2], path=path, timeout=180)[0]
    for weights, step, remainder, opt_step in run_pooled_test(
        _load, load_at[0], ep=load_at[1], mode=load_at[2], path=path, timeout=180
    ):
        assert step == 2 and opt_step == 2 and remainder == {}
        assert all(torch.equal(weights[k], v) for k, v in saved.items())
    single = MulaForCausalLM(_config())
    target = {"model": single.state_dict()}
    dcp.load(target, checkpoint_id=path)
    assert all(torch.equal(single.state_dict()[k], v) for k, v in saved.items())


def _losses(rank, world_size, **strategy_kwargs):
    fabric, _, model, optimizer = _setup(world_size, 2, **strategy_kwargs)
    return _train(fabric, model, optimizer, 3, rank)


@pytest.mark.distributed
def test_activation_checkpointing_and_regional_compile_do_not_change_training():
    """Recomputing decoder layers and compiling attention/norms (eager backend) give the same losses."""
    plain = run_pooled_test(_losses, 2, timeout=180)
    changed = run_pooled_test(_losses, 2, activation_checkpointing=True, compile={"backend": "eager"}, timeout=300)
    torch.testing.assert_close(torch.tensor(changed), torch.tensor(plain), rtol=1e-6, atol=1e-6)


def _bf16(rank, world_size):
    fabric, strategy, model, optimizer = _setup(world_size, 2, precision="bf16-true")
    losses = _train(fabric, model, optimizer, 3, rank)
    opt = strategy.sharded_optimizer
    dtypes = {p.dtype for p in model.parameters()}
    return losses, dtypes, {f: set(s) for f, s in opt.shards.items()}, opt.state_bytes()


@pytest.mark.distributed
def test_bf16_true_keeps_bf16_parameters_and_fp32_master_shards():
    """bf16-true: parameters are bf16, the optimizer keeps fp32 master shards (12 bytes per owned element)."""
    for losses, dtypes, shard_keys, nbytes in run_pooled_test(_bf16, 2, timeout=180):
        assert dtypes == {torch.bfloat16}
        assert all(keys == {"exp_avg", "exp_avg_sq", "master"} for keys in shard_keys.values())
        assert all(torch.isfinite(torch.tensor(losses)))
        assert nbytes % 12 == 0


def _bad(rank, world_size, case):
    if case == "mixed":
        _setup(world_size, 2, precision="bf16-mixed")
    fabric, _, model, optimizer = _setup(world_size, 2)
    x = torch.randint(0, 96, (2, 10))
    fabric.backward(model(x, labels=x).loss)
    fabric.clip_gradients(model, optimizer, clip_val=0.1)


@pytest.mark.distributed
@pytest.mark.parametrize("case,fragment", [("mixed", "bf16-mixed"), ("value", "clipping by value")])
def test_fabric_bad_settings_fail_clearly(case, fragment):
    """Mixed precision and value clipping are refused with messages naming them."""
    with pytest.raises(DistributedTestError, match=fragment):
        run_pooled_test(_bad, 2, case=case, timeout=120)
