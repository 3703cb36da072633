"""``MulaDataModule`` under a real Lightning Trainer: batch format, validation padding, and exact resume."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from mula_lightning.data import MulaDataModule

SEQ = 4


class Recorder(LightningModule):
    """Records the first instance id of every training micro-batch; its loss touches a single weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].dtype == torch.long
        self.seen.append((batch["input_ids"][:, 0] // SEQ).tolist())
        return self.w * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(data_dir, max_steps: int, ckpt_dir=None, ckpt_path=None) -> Recorder:
    model = Recorder()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=6, save_top_k=-1)] if ckpt_dir else []
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(ckpt_dir),
        callbacks=callbacks,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=MulaDataModule(str(data_dir), micro_batch_size=2), ckpt_path=ckpt_path)
    return model


def test_trainer_resume_continues_from_the_exact_next_sample(tmp_path, make_arange_dataset):
    """Resuming a Trainer from a checkpoint mid-epoch (and mid second epoch) yields exactly the batches an
    uninterrupted run yields after that step; the second epoch starts the data over from instance 0."""
    data = make_arange_dataset(tmp_path / "d", 23, SEQ)  # 11 micro-batches of 2 per epoch
    full = _fit(data, 15, ckpt_dir=tmp_path / "ckpt").seen
    assert full[:11] == [[2 * i, 2 * i + 1] for i in range(11)] and full[11] == [0, 1]
    for step in (6, 12):
        (ckpt,) = (tmp_path / "ckpt").glob(f"*step={step}.ckpt")
        assert torch.load(ckpt, weights_only=False)["MulaDataModule"]["consumed_samples"] == 2 * step
        resumed = _fit(data, 15, ckpt_path=str(ckpt)).seen
        assert resumed == full[step:]


def test_datamodule_state_moves_to_another_dp_size(tmp_path, make_arange_dataset):
    """A position saved at dp_size 1 resumes on two DP ranks with micro-batch 3: the ranks' first step is the
    next six instances, rank 0 the first three and rank 1 the next three."""
    data = make_arange_dataset(tmp_path / "d", 40, SEQ)
    dm = MulaDataModule(str(data), micro_batch_size=2)
    loader = dm.train_dataloader()
    for _, _ in zip(range(5), loader):
        dm.mark_consumed()
    state = dm.state_dict()
    firsts = []
    for rank in range(2):
        other = MulaDataModule(str(data), micro_batch_size=3, dp_rank=rank, dp_size=2)
        other.load_state_dict(state)
        firsts.append((next(iter(other.train_dataloader()))["input_ids"][:, 0] // SEQ).tolist())
    assert firsts == [[10, 11, 12], [13, 14, 15]]


def test_validation_batches_have_equal_shapes_and_ignored_padding(tmp_path, make_arange_dataset):
    """Validation loaders on two DP ranks give equal shapes; padding rows carry labels -100, which the real-token
    count (for normalising the loss) leaves out; vocab size and seq_len come from the manifest."""
    data = make_arange_dataset(tmp_path / "d", 20, SEQ)
    batches = [list(MulaDataModule(str(data), 2, dp_rank=r, dp_size=2).val_dataloader()) for r in range(2)]
    shapes = {tuple(b["input_ids"].shape) for rank in batches for b in rank}
    assert shapes == {(2, SEQ)}
    real = sum(int(MulaDataModule.real_token_count(b)) for rank in batches for b in rank)
    assert real == 5 * (SEQ - 1)
    dm = MulaDataModule(str(data), seq_len=SEQ)
    assert dm.vocab_size == 2**31 and dm.manifest.seq_len == SEQ
    try:
        MulaDataModule(str(data), seq_len=8).setup("fit")
    except ValueError as e:
        assert "seq_len (8) differs from the context size" in str(e)
    else:
        raise AssertionError("a seq_len other than the data's must be refused")


def test_worker_processes_read_the_same_batches(tmp_path, make_arange_dataset):
    """With DataLoader worker processes (the dataset is pickled without its memory maps and re-maps lazily) the
    training batches are identical to in-process loading."""
    data = make_arange_dataset(tmp_path / "d", 30, SEQ)
    serial = list(MulaDataModule(str(data), micro_batch_size=4).train_dataloader())
    parallel = list(MulaDataModule(str(data), micro_batch_size=4, num_workers=2).train_dataloader())
    assert len(serial) == len(parallel) == 7
    for a, b in zip(serial, parallel):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_dp_layout_comes_from_the_strategy(tmp_path, make_arange_dataset):
    """Without explicit dp_rank / dp_size the DataModule takes the strategy's ``distributed_sampler_kwargs`` (where
    expert-parallel strategies report their data-parallel group), and defaults to one rank without it."""
    from types import SimpleNamespace

    data = make_arange_dataset(tmp_path / "d", 40, SEQ)
    dm = MulaDataModule(str(data), micro_batch_size=3)
    dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 2}, training=False)
    first = next(iter(dm.train_dataloader()))
    assert (dm.train_sampler.dp_rank, dm.train_sampler.dp_size) == (2, 4)
    assert (first["input_ids"][:, 0] // SEQ).tolist() == [6, 7, 8]
    alone = MulaDataModule(str(data), micro_batch_size=3)
    alone.setup("fit")
    assert (alone.train_sampler.dp_rank, alone.train_sampler.dp_size) == (0, 1)
