"""DualCheckpoint under ``lightning.pytorch.Trainer``: the epso strategy with real processes killed inside a save,
and Lightning's own single-device strategy in this process; resumes with ``ckpt_path="last"``.

The training step multiplies the loss by a factor drawn from the global RNG and the loader is resumable, so a
resumed run reproduces an uninterrupted one only when the model, the optimizer shards, the LR schedule, the loops,
the data position and every rank's RNG states all come back.
"""

import os
import random
import signal

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from mula_lightning.callbacks import DualCheckpoint
from mula_lightning.checkpoint.slots import MARKER_NAME, SLOT_NAMES, read_marker
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import EPSOStrategy
from mula_lightning.testing import DistributedTestError, run_pooled_test

MICRO, SEQ, ACCUM = 2, 8, 2


class _Loader:
    """A resumable loader (``state_dict`` / ``load_state_dict``): batch i of rank r is drawn from seed (i, r)."""

    def __init__(self, rank, length=64):
        self.rank, self.length, self.position = rank, length, 0

    def __len__(self):
        return self.length

    def __iter__(self):
        while self.position < self.length:
            seed = self.position * 10 + self.rank
            self.position += 1
            yield torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(seed))
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class _TinyMoE(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = None
        self.losses = {}

    def configure_model(self):
        if self.model is None:
            config = MulaConfig.from_name(
                "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                intermediate_size=8, num_experts=4, top_k=2, moe_impl="fast",
            )  # fmt: skip
            with torch.device("meta"):
                self.model = MulaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        out = self.model(batch, labels=batch)
        loss = (out.loss + out.aux_loss) * (1 + 0.1 * torch.rand(()))  # needs the RNG states back on resume
        self.losses[(self.global_step, batch_idx)] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)), "interval": "step"}]


def _fit(rank, world_size, ckpt_dir, max_steps, kill=None, resume=False, async_save=False):
    torch.manual_seed(50 + rank)
    module = _TinyMoE()
    saving = {}

    def hook(phase):  # every rank kills itself at the same point of the save: the whole job dies there
        if phase == "begin":  # the step of the save (an asynchronous one completes while training goes on)
            saving["step"] = module.trainer.global_step
        if kill is not None and (saving["step"], phase) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint = DualCheckpoint(ckpt_dir, every_n_train_steps=2, phase_hook=hook, async_save=async_save)
    callbacks = [checkpoint] if ckpt_dir else []
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=EPSOStrategy(ep_size=2),
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, _Loader(rank), ckpt_path="last" if resume else None)
    state = gather_expert_parallel_state_dict(module.model, trainer.strategy.topology.ep_group)
    resumed = callbacks[0].resumed_from.name if callbacks and callbacks[0].resumed_from else None
    return module.losses, {k: v.clone() for k, v in state.items()}, resumed


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_trainer_epso_killed_inside_saves_resumes_from_last_and_matches_straight_run(tmp_path, async_save):
    """Two Trainer-level kill trials (2 processes, DP=1 x EP=2, accumulation 2): SIGKILL inside the save of step 4
    at a random protocol phase, resume with ckpt_path="last" (the step-2 slot, the step-4 one has no marker),
    killed again inside a save, then resumed to the end: every loss after each resume and the final weights
    equal a straight 6-step run's. With async_save the kills in the written / agreed phases strike the background
    thread while training has gone on past step 4."""
    phases = ["cleared", "written", "agreed"]
    rng = random.Random(3)
    straight = run_pooled_test(_fit, 2, ckpt_dir=None, max_steps=6, timeout=240)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(DistributedTestError, match="SIGKILL"):
        run_pooled_test(
            _fit, 2, ckpt_dir=ckpt, max_steps=6, kill=(4, rng.choice(phases)), async_save=async_save, timeout=240
        )
    steps = sorted(
        read_marker(tmp_path / "ckpt" / n)["step"] for n in SLOT_NAMES if (tmp_path / "ckpt" / n / MARKER_NAME).exists()
    )
    assert steps == [2]
    with pytest.raises(DistributedTestError, match="SIGKILL"):
        run_pooled_test(
            _fit, 2, ckpt_dir=ckpt, max_steps=6, kill=(4, rng.choice(phases)), resume=True, async_save=async_save,
            timeout=240,
        )  # fmt: skip
    final = run_pooled_test(_fit, 2, ckpt_dir=ckpt, max_steps=6, resume=True, async_save=async_save, timeout=240)
    for rank in range(2):
        losses, state, resumed = final[rank]
        expected_losses, expected_state, _ = straight[rank]
        assert resumed is not None and min(s for s, _ in losses) == 2  # resumed at step 2, trained steps 3..6
        for key, loss in losses.items():
            assert loss == pytest.approx(expected_losses[key], abs=1e-6), f"rank {rank} step/batch {key}"
        for k, v in expected_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {k}")


class _TinyLinear(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
        self.losses = {}

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        loss = loss * (1 + 0.1 * torch.rand(()))
        self.losses[(self.global_step, batch_idx)] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}]


def _single(tmp_path, max_steps, ckpt=True, resume=False, async_save=False):
    torch.manual_seed(5)
    module = _TinyLinear()
    callbacks = [DualCheckpoint(tmp_path / "single", every_n_train_steps=2, async_save=async_save)] if ckpt else []
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=ckpt,
        logger=False, enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACCUM,
    )  # fmt: skip
    trainer.fit(module, _Loader(0, 32), ckpt_path="last" if resume else None)
    return module, callbacks


@pytest.mark.parametrize("async_save", [False, True])
def test_single_device_resume_equivalence_and_fallback_to_the_other_slot(tmp_path, async_save):
    """Lightning's own single-device strategy: 4 steps, stop, resume with ckpt_path="last" to 6 equals 6 straight
    (losses and weights); with the newest slot's payload corrupted, "last" falls back to the older slot and the
    result is still identical. With async_save every save is written in the background (fit waits for the last)."""
    straight, _ = _single(tmp_path, 6, ckpt=False)
    _single(tmp_path, 4, async_save=async_save)
    resumed, callbacks = _single(tmp_path, 6, resume=True, async_save=async_save)
    assert callbacks[0].resumed_from.name == "slot_b"  # step 4 went to the second slot
    for key, loss in resumed.losses.items():
        assert loss == straight.losses[key], key
    assert min(s for s, _ in resumed.losses) == 4
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    # slots now hold steps 6 (slot_b... alternates) and 4; damage the newest one
    newest = max(SLOT_NAMES, key=lambda n: read_marker(tmp_path / "single" / n)["step"])
    payload = tmp_path / "single" / newest / "state.ckpt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    again, callbacks = _single(tmp_path, 6, resume=True, async_save=async_save)
    assert callbacks[0].resumed_from.name != newest
    for k, v in straight.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
