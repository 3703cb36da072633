"""Bad input for the dual-slot protocol (one process): damaged payloads, markers and model configs are named in
the error and the other slot is used when it is valid; a failed write leaves no marker and the old slot intact."""

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from mula_lightning.callbacks import DualCheckpoint
from mula_lightning.checkpoint.slots import (
    MARKER_NAME,
    CheckpointIntegrityError,
    CheckpointWriteError,
    resolve_last,
    save_slot,
    slot_step,
)

SIG = {"w": [4, 4]}


def _save(root, step, signature=SIG):
    tensors = {"w": torch.full((4, 4), float(step))}
    return save_slot(root, step, lambda p: torch.save(tensors, p), signature=signature)


def _two_slots(root):
    return _save(root, 2), _save(root, 4)


def test_slots_alternate_and_the_oldest_is_overwritten(tmp_path):
    """Steps 1, 2, 3 go to slot_a, slot_b, slot_a; resume takes the newest (3) and the payload matches it."""
    assert [_save(tmp_path, s).name for s in (1, 2, 3)] == ["slot_a", "slot_b", "slot_a"]
    slot = resolve_last(tmp_path, SIG)
    assert slot_step(slot) == 3 and torch.load(slot / "state.ckpt")["w"][0, 0] == 3


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _wrong_marker_checksum(path):
    marker_file = path.parent / MARKER_NAME
    marker = json.loads(marker_file.read_text())
    marker["files"]["state.ckpt"]["xxh3_64"] ^= 0x10
    marker_file.write_text(json.dumps(marker))


def _garbled_marker(path):
    (path.parent / MARKER_NAME).write_text('{"step": 4, "fil')


@pytest.mark.parametrize(
    "damage,fragment",
    [
        (_flip_byte, "xxh3_64"),
        (_truncate, "truncated"),
        (_wrong_marker_checksum, "xxh3_64"),
        (_garbled_marker, "unreadable marker"),
    ],
)
def test_damaged_newest_slot_falls_back_to_the_other_and_both_damaged_is_a_clear_error(tmp_path, damage, fragment):
    """A corrupt or truncated payload, a marker with a wrong checksum or a garbled marker: resume uses the older
    slot; once the older one is damaged too, CheckpointIntegrityError names the problem of each slot."""
    old, new = _two_slots(tmp_path)
    damage(new / "state.ckpt")
    assert resolve_last(tmp_path, SIG) == old
    _flip_byte(old / "state.ckpt")
    with pytest.raises(CheckpointIntegrityError, match=fragment) as info:
        resolve_last(tmp_path, SIG)
    assert "slot_a" in str(info.value) and "slot_b" in str(info.value)


def test_checkpoint_of_another_model_config_is_skipped_and_named(tmp_path):
    """A slot written by another model config is not loaded: the other slot is used; with only such slots the
    error names the key and both shapes."""
    _save(tmp_path, 2)
    _save(tmp_path, 4, signature={"w": [8, 4]})
    assert slot_step(resolve_last(tmp_path, SIG)) == 2
    _save(tmp_path, 6, signature={"w": [8, 4]})  # overwrites step 2: now both are from the other config
    with pytest.raises(CheckpointIntegrityError, match=r"another model config.*'w': \(\[8, 4\], \[4, 4\]\)"):
        resolve_last(tmp_path, SIG)


def test_failed_write_leaves_no_marker_and_the_previous_slot_resumes(tmp_path):
    """A writer that fails half-way raises CheckpointWriteError naming the rank and cause; the slot it was
    writing has no marker, and resume still finds the previous complete one."""
    _save(tmp_path, 2)

    def broken(path):
        path.write_bytes(b"half")
        raise OSError("disk quota exceeded")

    with pytest.raises(CheckpointWriteError, match="rank 0: OSError: disk quota exceeded"):
        save_slot(tmp_path, 4, broken, signature=SIG)
    assert not (tmp_path / "slot_b" / MARKER_NAME).exists()
    assert slot_step(resolve_last(tmp_path, SIG)) == 2
    assert resolve_last(tmp_path / "empty") is None  # never saved: nothing to resume, not an error


class _Linear(LightningModule):
    def __init__(self, width):
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, width, resume):
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[DualCheckpoint(tmp_path / "ckpt", every_n_train_steps=1)],
    )  # fmt: skip
    trainer.fit(_Linear(width), DataLoader(torch.randn(8, width), batch_size=2), ckpt_path="last" if resume else None)


def test_trainer_resume_into_another_model_config_is_a_clear_error(tmp_path):
    """ckpt_path="last" with a model of another width: the error names the parameter and both shapes instead of
    a load failure deep inside torch."""
    _fit(tmp_path, 4, resume=False)
    with pytest.raises(CheckpointIntegrityError, match=r"net.weight.*\[1, 4\], \[1, 3\]"):
        _fit(tmp_path, 3, resume=True)
