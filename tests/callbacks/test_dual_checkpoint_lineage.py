"""DualCheckpoint lineages: every marker names its run; a resume keeps the run's id; a fresh run refuses another
run's slots in its directory (unless told to overwrite them), so that a later ``ckpt_path="last"`` can never pick
a step of a different run."""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader

from mula_lightning.callbacks import DualCheckpoint
from mula_lightning.callbacks.dual_checkpoint import CheckpointLineageError
from mula_lightning.checkpoint.slots import slot_lineages


class _Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dirpath, max_steps, resume=False, overwrite=False):
    dual = DualCheckpoint(dirpath, every_n_train_steps=2, overwrite=overwrite)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[dual], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Tiny(), DataLoader(RandomDataset(4, 64), batch_size=2), ckpt_path="last" if resume else None)
    return dual


def test_resume_keeps_the_lineage_and_a_fresh_run_refuses_another_runs_slots(tmp_path):
    """Run A saves steps 2 and 4; its resume to step 6 writes the same run id. A fresh run B in the same directory
    stops before its first step naming the slots and the ways out; with ``overwrite=True`` it removes A's markers
    first, so a later resume can only find B's steps."""
    first = _fit(tmp_path, 4)
    lineages = slot_lineages(tmp_path)
    assert sorted(step for step, _ in lineages.values()) == [2, 4]
    assert {rid for _, rid in lineages.values()} == {first.run_id}
    resumed = _fit(tmp_path, 6, resume=True)
    assert resumed.run_id == first.run_id and resumed.resumed_from is not None
    assert {rid for _, rid in slot_lineages(tmp_path).values()} == {first.run_id}

    with pytest.raises(CheckpointLineageError, match=r"another run: slot_\w \(step \d, run [0-9a-f]+\).*overwrite"):
        _fit(tmp_path, 2)
    assert sorted(step for step, _ in slot_lineages(tmp_path).values()) == [4, 6]  # nothing was touched

    fresh = _fit(tmp_path, 2, overwrite=True)
    assert fresh.run_id != first.run_id
    assert list(slot_lineages(tmp_path).values()) == [(2, fresh.run_id)]
    again = _fit(tmp_path, 4, resume=True)
    assert again.run_id == fresh.run_id and again.resumed_from is not None


def test_fresh_run_in_an_empty_directory_and_resume_without_slots_start_a_lineage(tmp_path):
    """``ckpt_path="last"`` with no slot yet (a first attempt under ``mula launch``) starts fresh with its own id,
    which the next resume adopts."""
    started = _fit(tmp_path / "d", 2, resume=True)
    assert started.resumed_from is None and started.run_id
    assert _fit(tmp_path / "d", 4, resume=True).run_id == started.run_id
