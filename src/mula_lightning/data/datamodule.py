"""``MulaDataModule``: prepared shards -> Lightning dataloaders that resume at the exact next sample.

Both storage formats of ``prepare`` are read: memory-mapped ``npy`` shards (:class:`TokenShardDataset`) and litdata
chunks (:class:`~mula_lightning.data.litdata_io.LitdataTokenDataset`, through ``StreamingDataset``); the sampler,
the order and the resume position are the same for both.

Batches are ``{"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}``; ``labels`` equal ``input_ids``
except on validation padding rows, where they are ``-100``. Labels are not shifted: the model shifts them
internally, like transformers' causal LMs.

Data-parallel layout. ``dp_rank`` / ``dp_size`` default to what the strategy reports through Lightning's
``distributed_sampler_kwargs`` (``{"num_replicas", "rank"}``); strategies with expert or tensor parallelism report
their data-parallel group there, so ranks of one expert-parallel group that must see different data do.

Exact resume. Lightning saves :meth:`MulaDataModule.state_dict` in every checkpoint and calls
:meth:`load_state_dict` before building dataloaders on ``fit(ckpt_path=...)``. The state is the training
sampler's position in *global samples*, advanced in :meth:`on_before_batch_transfer` for each training
micro-batch the loop really uses (a prefetched batch is not counted), so the resumed loader yields the very next
instance, even with another number of devices or another micro-batch size. (If the LightningModule overrides
``on_before_batch_transfer`` too, Lightning calls only the module's hook; call ``datamodule.on_before_batch_transfer``
from it.) The training DataLoader is itself stateful (:class:`ResumableDataLoader`), so Lightning's loop also
stores the position and knows the loader resumes mid-epoch. In a Fabric loop, call :meth:`mark_consumed` after
each micro-batch and save :meth:`state_dict` with the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from mula_lightning.data.dataset import MegatronSampler, TokenShardDataset, collate_batch
from mula_lightning.data.manifest import DataManifest


class ResumableDataLoader(DataLoader):
    """A DataLoader whose ``state_dict`` is its sampler's position.

    Lightning treats loaders with ``state_dict`` / ``load_state_dict`` as resumable: it stores the state in the
    loop's checkpoint section as well and does not warn about a mid-epoch resume. Both copies hold one position.
    """

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.sampler.load_state_dict(state_dict)


class MulaDataModule(LightningDataModule):
    """Training and validation loaders over a dataset written by ``mula data prepare``.

    Args:
        data_dir: the prepared dataset folder (holds ``manifest.json``).
        micro_batch_size: instances per rank per training step (``B``).
        global_batch_size: instances per optimizer step over all DP ranks (a multiple of ``B x dp_size``;
            ``None`` = ``B x dp_size``); the last partial global batch of a pass is dropped.
        val_micro_batch_size: per-rank validation batch (default ``micro_batch_size``).
        seq_len: the context the model trains on; checked against the data (``None`` accepts the data's).
        num_workers: DataLoader worker processes (reading memory maps is cheap; 0-2 is usually enough).
        pin_memory: pin host batches for faster copies to an accelerator.
        dp_rank: this rank's data-parallel index (``None``: from the trainer's strategy).
        dp_size: data-parallel ranks (``None``: from the trainer's strategy).
        tokenizer: optional tokenizer file or folder to compare with the data's tokenizer hash before training.
    """

    def __init__(
        self,
        data_dir: str,
        micro_batch_size: int = 8,
        global_batch_size: int | None = None,
        val_micro_batch_size: int | None = None,
        seq_len: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.val_micro_batch_size = val_micro_batch_size or micro_batch_size
        self.seq_len = seq_len
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.tokenizer = tokenizer
        self._manifest: DataManifest | None = None
        self.train_sampler: MegatronSampler | None = None
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ metadata
    @property
    def manifest(self) -> DataManifest:
        """The dataset's verified manifest (loaded on first use)."""
        if self._manifest is None:
            self._manifest = DataManifest.load(self.data_dir)
            if self.seq_len is not None and self.seq_len != self._manifest.seq_len:
                raise ValueError(
                    f"seq_len ({self.seq_len}) differs from the context size of the data in {self.data_dir} "
                    f"({self._manifest.seq_len}); re-run `mula data prepare --seq-len {self.seq_len}`"
                )
            if self.tokenizer is not None:
                self._manifest.check_tokenizer(self.tokenizer)
        return self._manifest

    @property
    def vocab_size(self) -> int:
        """The vocabulary of the data; a model config without ``vocab_size`` should take it."""
        return self.manifest.vocab_size

    def _dp_layout(self) -> tuple[int, int]:
        rank, size = self.dp_rank, self.dp_size
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None) if self.trainer is not None else None
        if rank is None:
            rank = int(kwargs["rank"]) if kwargs else 0
        if size is None:
            size = int(kwargs["num_replicas"]) if kwargs else 1
        if not 0 <= rank < size:
            raise ValueError(f"dp_rank ({rank}) must be in [0, dp_size ({size}))")
        return rank, size

    # ------------------------------------------------------------------------------------------- loaders
    def setup(self, stage: str | None = None) -> None:
        """Verify the shards no one verified yet (each by one rank; collective under a process group: see
        :meth:`DataManifest.verify_checksums_once`), open the splits and build the training sampler (restoring a
        loaded position, if any)."""
        manifest = self.manifest
        manifest.verify_checksums_once()
        dataset_class: type[TokenShardDataset] = TokenShardDataset
        if manifest.storage == "litdata":  # the same instances and sampler, read through litdata's StreamingDataset
            from mula_lightning.data.litdata_io import LitdataTokenDataset

            dataset_class = LitdataTokenDataset
        self.train_dataset = dataset_class(self.data_dir, "train", manifest)
        self.val_dataset = dataset_class(self.data_dir, "val", manifest) if manifest.num_instances("val") else None
        rank, size = self._dp_layout()
        self.train_sampler = MegatronSampler(
            self.train_dataset, self.micro_batch_size, rank, size, global_batch_size=self.global_batch_size
        )
        if self._pending_state is not None:
            self.train_sampler.load_state_dict(self._pending_state)
            self._pending_state = None

    def _loader(self, dataset: TokenShardDataset, sampler: MegatronSampler, batch_size: int) -> DataLoader:
        return ResumableDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_batch,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_sampler is None:
            self.setup("fit")
        return self._loader(self.train_dataset, self.train_sampler, self.micro_batch_size)

    def val_dataloader(self) -> DataLoader | list:
        if self.train_sampler is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, size = self._dp_layout()
        sampler = MegatronSampler(self.val_dataset, self.val_micro_batch_size, rank, size, pad=True)
        return self._loader(self.val_dataset, sampler, self.val_micro_batch_size)

    def test_dataloader(self) -> DataLoader | list:
        """The held-out split for ``trainer.test`` / ``mula test`` (``prepare`` writes train and val only)."""
        return self.val_dataloader()

    # ------------------------------------------------------------------------------------- exact resume
    def mark_consumed(self, num_micro_batches: int = 1) -> None:
        """Advance the training position by ``num_micro_batches`` micro-batches (for Fabric loops)."""
        if self.train_sampler is None:
            raise RuntimeError("call setup() (or train_dataloader()) before mark_consumed()")
        self.train_sampler.mark_consumed(num_micro_batches)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count each training micro-batch the loop uses, so a checkpoint stores the exact position."""
        trainer = self.trainer
        if trainer is not None and trainer.training and not trainer.sanity_checking and self.train_sampler is not None:
            self.train_sampler.mark_consumed(1)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training data position (global samples consumed + dataset fingerprint)."""
        if self.train_sampler is None:
            return dict(self._pending_state or {})
        return self.train_sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s position; refused (ValueError) if it belongs to another dataset."""
        if not state_dict:
            return
        if self.train_sampler is None:
            self._pending_state = dict(state_dict)
        else:
            self.train_sampler.load_state_dict(state_dict)

    @staticmethod
    def real_token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens that carry a loss after the model's shift (``labels[:, 1:] != -100``), for normalising a
        padded validation loss by the all-reduced count of real tokens."""
        return (batch["labels"][:, 1:] != -100).sum()

    def __repr__(self) -> str:
        return f"MulaDataModule(data_dir={os.fspath(self.data_dir)!r}, micro_batch_size={self.micro_batch_size})"
