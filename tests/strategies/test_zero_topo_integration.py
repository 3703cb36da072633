"""The zero_topo strategy with real processes: Fabric and Trainer training parity, save, resume and reshard.

The reference is one process: the unsharded model on every rank's micro-batch, losses averaged, torch AdamW after
torch's global-norm clipping (max_norm small enough that clipping fires every step). Both sides run in float64
(``precision="64-true"``) and are compared with :func:`mula_lightning.testing.assert_parity`; Lightning hands the
loss back in float32 (three roundings: LM loss, aux loss, their sum), so logged losses carry float32's bound.
"""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.testing import assert_parity, one_process_data_parallel, run_pooled_test
from mula_lightning.testing.lightning_module import MetaCausalLM

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CLIP = 0.05
STEPS, SAVE_AT = 6, 3
DTYPE = torch.float64
H, FF, V, T = 32, 16, 128, 12  # hidden, expert intermediate, vocabulary, sequence
# Rounded operations feeding one element of the loss or a gradient (dots over H, T, 2FF, the router's softmax over
# 4 experts, the vocabulary's softmax; a gradient adds a sum over every rank's tokens, at most 4 ranks x 3 x 2 x T)
# per step; each AdamW step builds on the previous ones.
GRAD_LEN = 2 * (3 * H + T + 2 * FF + 4) + V + 4 * 3 * 2 * T


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
        moe_impl="fast",
    )


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, 12), generator=g)


def _fabric(world_size, **sizes):
    from mula_lightning.strategies import FabricZeroTopoStrategy

    strategy = FabricZeroTopoStrategy(block_size=16, **sizes)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **HP))
    return fabric, model, optimizer


def _steps(fabric, model, optimizer, rank, world_size, start, stop):
    losses = []
    for step in range(start, stop):
        x = _batch(step, rank)
        loss = model(x, labels=x).loss + model(x, labels=x).aux_loss * 0  # two forwards: hooks re-entrant
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fabric_run(rank, world_size, path):
    fabric, model, optimizer = _fabric(world_size, ranks_per_node=2, ranks_per_gpu=2)  # w=2, g=2, o=4
    losses = _steps(fabric, model, optimizer, rank, world_size, 0, SAVE_AT)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
    losses += _steps(fabric, model, optimizer, rank, world_size, SAVE_AT, STEPS)
    # reshard: the checkpoint loads into another layout (ZeRO-3 over 4 ranks) and training goes on identically
    fabric2, model2, optimizer2 = _fabric(world_size, ranks_per_node=4, weight_size=4, grad_size=4, secondary_size=4)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric2.load(path, state)
    resumed = _steps(fabric2, model2, optimizer2, rank, world_size, state["step"], STEPS)
    return losses, resumed


def _reference(world_size, start=0, model=None, opt=None):
    if model is None:
        model = init_weights(MulaForCausalLM(_config()), seed=0).to(DTYPE)
    return one_process_data_parallel(model, _batch, world_size, range(start, STEPS), CLIP, opt, **HP)


@pytest.mark.distributed
def test_fabric_zero_topo_trains_saves_resumes_and_reshards(tmp_path):
    """4 processes (2 simulated nodes x 1 GPU of 2 GCDs) with a tiny MoE: 6 clipped AdamW steps equal one process;
    a checkpoint saved after 3 steps, loaded into a ZeRO-3 layout of the same ranks, continues with the same losses;
    loaded into one process (the engine on one rank), it continues with the same averaged losses."""
    path = str(tmp_path / "ckpt")
    results = run_pooled_test(_fabric_run, 4, path=path, timeout=300)
    ref = _reference(4)
    for rank, (losses, resumed) in enumerate(results):
        expected = torch.tensor([s[rank] for s in ref], dtype=DTYPE)
        f32 = dict(reduction_len=3, dtype=torch.float32)  # the loss Fabric hands back: rounded to float32 3 times
        assert_parity(torch.tensor(losses, dtype=DTYPE), expected, **f32, msg=f"rank {rank} losses")
        assert_parity(torch.tensor(resumed, dtype=DTYPE), expected[SAVE_AT:], **f32, msg=f"rank {rank} resumed")

    from mula_lightning.checkpoint.dcp_format import load_dcp
    from mula_lightning.parallel.zero import state_dict as zc
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    model = MulaForCausalLM(_config()).to(DTYPE)
    engine = HierarchicalZeroAdamW(model, ZeroTopoLayout(1, 1, 1), **HP, block_size=16)
    targets = {"model": zc.model_state_dict(engine, model), "optimizer": zc.optimizer_state_dict(engine, True)}
    meta = load_dcp(__import__("pathlib").Path(path), targets)
    zc.load_model_state_dict(engine, targets["model"])
    zc.apply_optimizer_state_dict(engine, targets["optimizer"])
    assert meta["step"] == SAVE_AT and engine._step == SAVE_AT
    for step in range(SAVE_AT, STEPS):  # one process: the mean over the 4 ranks' micro-batches
        per_rank = [model(_batch(step, r), labels=_batch(step, r)).loss for r in range(4)]
        torch.stack(per_rank).mean().backward()
        engine.clip_grad_norm_(CLIP)
        engine.step()
        got = torch.tensor([p.item() for p in per_rank], dtype=DTYPE)
        assert_parity(got, torch.tensor(ref[step], dtype=DTYPE), reduction_len=STEPS * GRAD_LEN, msg=f"step {step}")


def _trainer_fit(rank, world_size, epochs, save=None, resume=None):
    from mula_lightning.strategies import ZeroTopoStrategy

    data = torch.stack([_batch(s, r) for s in range(3) for r in range(world_size)]).reshape(-1, 12)
    # one optimizer step per epoch: rank r reads its 2 rows of each of the 3 steps' batches, accumulating 3
    mine = torch.cat([data[(s * world_size + rank) * 2 : (s * world_size + rank) * 2 + 2] for s in range(3)])
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, quantize_weights=False, block_size=16),
        precision="64-true",
        accumulate_grad_batches=3,
        gradient_clip_val=CLIP,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = MetaCausalLM(_config(), aux_loss=False, **HP)
    trainer.fit(module, DataLoader(mine, batch_size=2, shuffle=False), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    with trainer.strategy.engine.full_parameters():
        return {k: v.clone() for k, v in module.model.state_dict().items()}, trainer.global_step


@pytest.mark.distributed
def test_trainer_zero_topo_checkpoint_reshards_to_four_processes(tmp_path):
    """2 processes (one GPU of 2 GCDs): Trainer with accumulation 3 and clipping, 2 epochs, then a save; the
    checkpoint loads on 4 processes (2 simulated nodes, other shard sizes) with the same full weights. (Resuming and
    training on at one layout against one process is the Trainer loop tester's:
    ``tests/testing/test_trainer_conformance.py``.)"""
    path = str(tmp_path / "trainer.ckpt")
    saved = run_pooled_test(_trainer_fit, 2, epochs=2, save=path, timeout=300)[0][0]
    for state, steps in run_pooled_test(_trainer_fit, 4, epochs=2, resume=path, timeout=300):
        assert steps == 2  # restored at the end of epoch 2: nothing left to train
        for k, v in saved.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=f"resharded to 4 processes: {k}")


def _masters_after_reversed_load(rank, world_size, path):
    """bf16 weights with fp32 masters: a step, a save, another step, then a load of ``{"optimizer", "model"}`` (the
    optimizer first in the dict); the masters saved and the masters after the load."""
    from mula_lightning.strategies import FabricZeroTopoStrategy

    strategy = FabricZeroTopoStrategy(block_size=16, ranks_per_node=2, weight_size=2, grad_size=2)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    engine = fabric.strategy.engine
    for step in range(2):
        x = _batch(step, rank)
        fabric.backward(model(x, labels=x).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            fabric.save(path, {"model": model, "optimizer": optimizer})
            saved = [u.master.clone() for u in engine.units if not u.master_is_primary]
    fabric.load(path, {"optimizer": optimizer, "model": model})
    return saved, [u.master.clone() for u in engine.units if not u.master_is_primary]


@pytest.mark.distributed
def test_a_load_restores_the_saved_fp32_masters_not_the_rounded_weights(tmp_path):
    """bf16 weights keep fp32 masters in the optimizer's state: a load of the model and its optimizer (here the
    optimizer first in the dict) restores the saved masters. Before, loading the model refreshed the masters from
    the loaded bf16 weights after DCP had filled them with the saved ones, in either order: every resume of a bf16
    run rounded its masters to bf16 (up to 2^-8 relative)."""
    for saved, loaded in run_pooled_test(_masters_after_reversed_load, 2, path=str(tmp_path / "ckpt"), timeout=180):
        assert saved, "bf16 weights with fp32 masters expected"
        for want, got in zip(saved, loaded, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
