"""``MulaProgress`` under the Trainer: progress lines on the global rank 0 only, every ``log_every_n_steps`` and at
the end, a validation line when results come, and Lightning's bar kept on a terminal, taken away off one."""

import io
import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from torch.utils.data import DataLoader

from mula_lightning.callbacks.progress import MulaProgress, resolve_progress_bar
from mula_lightning.testing import run_pooled_test


class _TinyLM(LightningModule):
    """A linear layer on token rows, logging what ``MulaLM`` logs (``train/loss``, ``train/lr``, ``val/loss``)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch["input_ids"].float()).pow(2).mean()
        self.log("train/loss", loss)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch["input_ids"].float()).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return DataLoader([{"input_ids": torch.randint(0, 9, (2, 8), generator=g)} for _ in range(n)], batch_size=None)


def _fit(rank, world_size):
    stream = io.StringIO()
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=7, log_every_n_steps=3, val_check_interval=5,
        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=True, callbacks=[MulaProgress(stream=stream)],
        use_distributed_sampler=False,
    )  # fmt: skip
    resolve_progress_bar(trainer)  # what `mula fit` does: the output is no terminal
    trainer.fit(_TinyLM(), _batches(10), _batches(1))
    return stream.getvalue(), trainer.progress_bar_callback is None


@pytest.mark.distributed
def test_lines_are_printed_once_every_n_steps_with_a_validation_line():
    """2 processes, output not a terminal: rank 0 prints steps 3 and 6 and the last step 7 (step / max steps, loss,
    lr, tokens/s over both ranks and per device, host memory, time per step, time left) and the validation results at
    step 5; rank 1 prints nothing; Lightning's bar was taken away on both."""
    (lines, no_bar), (other, other_no_bar) = run_pooled_test(_fit, 2, timeout=120)
    lines = lines.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 3/7", lines[1], "step 6/7", "step 7/7"]
    assert re.fullmatch(r"validation at step 5: val/loss \d+\.\d{4}", lines[1]), lines[1]
    fields = lines[0].split(" | ")
    assert fields[1].startswith("loss ") and fields[2] == "lr 1.00e-02"
    assert "tok/s (" in fields[3] and fields[4].endswith("GiB host") and fields[5].endswith("s/step")
    assert fields[6].startswith("left ") and "left" not in lines[-1]
    assert other == "" and no_bar and other_no_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_keeps_lightnings_bar_and_lines_replace_it_elsewhere():
    """``auto`` on a terminal with the Trainer's bar: no lines, the bar stays; ``auto`` without a bar, or ``lines``
    anywhere: lines, and the bar is taken away; ``bar`` and ``off`` print no lines; an unknown mode is named."""

    def trainer(progress, bar=True):
        return Trainer(accelerator="cpu", devices=1, enable_progress_bar=bar, logger=False, callbacks=[progress],
                       enable_checkpointing=False)  # fmt: skip

    progress = MulaProgress(stream=_Terminal())
    kept = trainer(progress)
    resolve_progress_bar(kept)
    assert isinstance(kept.progress_bar_callback, ProgressBar) and not progress.prints_lines(kept)
    assert MulaProgress(stream=_Terminal()).prints_lines(trainer(MulaProgress(), bar=False))
    forced = trainer(MulaProgress(mode="lines", stream=_Terminal()))
    resolve_progress_bar(forced)
    assert forced.progress_bar_callback is None
    for mode in ("bar", "off"):
        assert not MulaProgress(mode=mode).prints_lines(trainer(MulaProgress(), bar=False))
    with pytest.raises(ValueError, match="progress mode 'tqdm' is not one of"):
        MulaProgress(mode="tqdm")
