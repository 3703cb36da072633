"""The epso strategy under ``lightning.pytorch.Trainer`` with real processes.

A tiny LightningModule builds ``MulaForCausalLM`` on the meta device in ``configure_model``; the strategy makes it
expert parallel, materialises it and shards AdamW. Training is compared with one process computing the same
math (losses averaged over every rank's micro-batches, torch AdamW, torch's norm clipping, the same LR schedule).
Both sides run in float64 (``precision="64-true"``) and are compared with :func:`mula_lightning.testing.assert_parity`.
"""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.parallel.ledger import CommLedger
from mula_lightning.strategies import EPSOStrategy
from mula_lightning.testing import DistributedTestError, adamw_parameter_scale, assert_parity, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MICRO, SEQ, ACCUM, CLIP = 2, 12, 2, 0.05
DTYPE = torch.float64
H, FF, V = 32, 16, 128  # hidden, expert intermediate, vocabulary
# Rounded operations feeding one element of a gradient per step: dots over H, SEQ (attention), 2FF, the router's
# softmax over 8 experts, the vocabulary's softmax, and the sum over every rank's micro-batch tokens (at most
# 4 ranks x ACCUM x MICRO x SEQ); each AdamW step builds on the previous ones.
GRAD_LEN = 2 * (3 * H + SEQ + 2 * FF + 8) + V + 4 * ACCUM * MICRO * SEQ


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=16,
        num_experts=8,
        top_k=2,
        moe_impl="fast",
    )


def _samples(world_size):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (world_size * MICRO * ACCUM, SEQ), generator=g)  # one optimizer step per epoch


def _schedule(step):
    return 1.0 / (1.0 + step)


class _TinyLM(LightningModule):
    def __init__(self, optimizer_cls=torch.optim.AdamW):
        super().__init__()
        self.model = None
        self.optimizer_cls = optimizer_cls

    def configure_model(self):
        if self.model is None:
            with torch.device("meta"):
                self.model = MulaForCausalLM(_config())

    def training_step(self, batch, batch_idx):
        out = self.model(batch, labels=batch)
        return out.loss + out.aux_loss

    def configure_optimizers(self):
        hp = HP if self.optimizer_cls is torch.optim.AdamW else {"lr": HP["lr"]}
        opt = self.optimizer_cls(self.parameters(), **hp)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def _trainer(world_size, ep, mode="ep_aware", tp=1, cp=1, sampled=False, **kwargs):
    return Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=EPSOStrategy(ep_size=ep, sharded_optimizer=mode, tp_size=tp, sequence_parallel=tp > 1, cp_size=cp),
        precision="64-true",
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=sampled,  # Lightning's sampler over the strategy's distinct batches
        **kwargs,
    )


def _loader(world_size, rank, replicas=None):
    """Rank r reads samples r, r + W, ... (explicitly, so the test does not depend on Lightning's sampler); with
    ``replicas`` (TP or CP: fewer distinct batches than ranks), Lightning's (shuffling) DistributedSampler over the
    strategy's ``replicas`` distinct batches decides."""
    if replicas is not None:
        return DataLoader(_samples(replicas), batch_size=MICRO, shuffle=False)
    return DataLoader(_samples(world_size)[rank::world_size], batch_size=MICRO, shuffle=False)


def _full_state(module, trainer):
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    if trainer.strategy.tp_size > 1:  # experts gathered over ep, tensor-parallel weights over tp
        return {k: v.clone() for k, v in full_state_dict(module.model, trainer.strategy).items()}
    state = gather_expert_parallel_state_dict(module.model, trainer.strategy.topology.ep_group)
    return {k: v.clone() for k, v in state.items()}


def _fit(rank, world_size, ep, epochs, save=None, resume=None, mode="ep_aware", tp=1, cp=1, replicas=None):
    """``replicas``: the distinct batches when Lightning's sampler hands them out (TP, CP, or a resume at another
    layout that reads what the saved one read)."""
    module = _TinyLM()
    trainer = _trainer(world_size, ep, mode, tp, cp, sampled=replicas is not None, max_epochs=epochs)
    with CommLedger() as ledger:
        trainer.fit(module, _loader(world_size, rank, replicas), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    reduce_scatters = len([r for r in ledger.records if r.op == "reduce_scatter" and r.tag.startswith("optimizer.")])
    return _full_state(module, trainer), reduce_scatters, trainer.global_step


def _reference(world_size, steps, shuffled=False):
    """One process standing for ``world_size`` data-parallel ranks; ``shuffled``: each rank reads what Lightning's
    DistributedSampler gives it (epoch e: a permutation seeded 0 + e, rank r taking every W-th index from r)."""
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    data = _samples(world_size)
    for epoch in range(steps):  # one step per epoch
        if shuffled:
            data = _samples(world_size)[torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))]
        losses = []
        for rank in range(world_size):  # rank r reads samples r, r + W, ...
            mine = data[rank::world_size]
            for m in range(ACCUM):
                x = mine[m * MICRO : (m + 1) * MICRO]
                out = model(x, labels=x)
                losses.append(out.loss + out.aux_loss)
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict()


def _assert_state_close(got, expected, what, steps=3):
    for k, v in expected.items():
        scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=CLIP, eps=HP["eps"]) + v.abs().max().item()
        assert_parity(got[k], v, reduction_len=steps * GRAD_LEN, scale=scale, msg=f"{what}: {k}")


@pytest.mark.distributed
def test_trainer_checkpoint_reshards_to_another_world_size_and_mode(tmp_path):
    """A checkpoint saved after 2 steps at 4 ranks (DP 2 x EP 2, ep_aware; accumulation 2, clipping, LR schedule)
    loads at 2 ranks (EP 2, mode dp) with the weights of one process after 2 steps. (Accumulation, clipping, skipped
    steps, schedulers and resumes at one layout, with one reduction per window, are the Trainer loop tester's:
    ``tests/testing/test_trainer_conformance.py``.)"""
    path = str(tmp_path / "step2.ckpt")
    for rank, (state, _, steps) in enumerate(run_pooled_test(_fit, 4, ep=2, epochs=2, save=path, timeout=300)):
        assert steps == 2
        _assert_state_close(state, _reference(4, 2), f"saved, rank {rank}")
    at_two = run_pooled_test(_fit, 2, ep=2, epochs=2, resume=path, mode="dp", timeout=300)  # nothing left to do
    for state, _, steps in at_two:
        assert steps == 2
        _assert_state_close(state, _reference(4, 2), "resharded to 2 ranks")


@pytest.mark.distributed
def test_trainer_tensor_parallel_folded_with_ep_resumes_to_the_straight_run(tmp_path):
    """4 processes, TP=2 with sequence parallelism folded with EP=2, Lightning's own sampler over the 2 dense
    data-parallel ranks: save after 2 steps (accumulation 2, clipping, LR schedule), resume for 1 more, and the
    weights equal one process running the 2 data-parallel batches for 3 steps."""
    path = str(tmp_path / "step2.ckpt")
    run_pooled_test(_fit, 4, ep=2, tp=2, replicas=2, epochs=2, save=path, timeout=300)
    resumed = run_pooled_test(_fit, 4, ep=2, tp=2, replicas=2, epochs=3, resume=path, timeout=300)
    for rank, (state, _, steps) in enumerate(resumed):
        assert steps == 3
        _assert_state_close(state, _reference(2, 3, shuffled=True), f"tp2 x ep2 resumed, rank {rank}")


@pytest.mark.distributed
def test_trainer_context_parallel_saves_at_cp2_and_resumes_at_cp1_to_the_straight_run(tmp_path):
    """4 processes, CP 2 folded with EP 2 beside DP 2 (each sequence's chunks over a pair of ranks, Lightning's
    sampler over the 2 distinct batches): save after 2 steps (accumulation 2, clipping, LR schedule), resume at
    CP 1 on 2 processes (EP 2, the same 2 batches per step) at step 2 for 1 more, and the weights equal one process
    running the 2 batches' whole sequences for 3 steps."""
    path = str(tmp_path / "step2.ckpt")
    for rank, (state, _, steps) in enumerate(
        run_pooled_test(_fit, 4, ep=2, cp=2, replicas=2, epochs=2, save=path, timeout=300)
    ):
        assert steps == 2
        _assert_state_close(state, _reference(2, 2, shuffled=True), f"cp2 x ep2 saved, rank {rank}")
    for rank, (state, _, steps) in enumerate(
        run_pooled_test(_fit, 2, ep=2, replicas=2, epochs=3, resume=path, timeout=300)
    ):
        assert steps == 3
        _assert_state_close(state, _reference(2, 3, shuffled=True), f"resumed at cp1, rank {rank}")


def _bad(rank, world_size, case):
    module = _TinyLM(optimizer_cls=torch.optim.SGD if case == "sgd" else torch.optim.AdamW)
    kwargs = {}
    if case == "mixed":
        kwargs["precision"] = "bf16-mixed"
    if case == "value":
        kwargs["gradient_clip_algorithm"] = "value"
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=EPSOStrategy(ep_size=3 if case == "ep" else 2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        gradient_clip_val=0.5,
        **kwargs,
    )
    trainer.fit(module, DataLoader(_samples(world_size), batch_size=MICRO))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case,fragment",
    [
        ("mixed", "bf16-mixed"),
        ("value", "gradient_clip_algorithm='value'"),
        ("sgd", "got SGD"),
        ("ep", r"world size \(2\) must be divisible by ep_size \(3\)"),
    ],
)
def test_trainer_bad_settings_fail_clearly(case, fragment):
    """Mixed precision, value clipping, a non-AdamW optimizer and an EP size that does not divide are named."""
    with pytest.raises(DistributedTestError, match=fragment):
        run_pooled_test(_bad, 2, case=case, timeout=120)
