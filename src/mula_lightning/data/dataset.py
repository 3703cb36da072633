"""Reading prepared shards: a lazily memory-mapped dataset and a Megatron-style, exactly resumable sampler.

Shapes: ``N`` instances in a split, ``T = seq_len``, ``B = micro_batch_size``, ``D = dp_size``.

Data order. ``prepare`` already wrote the instances in one global random order, so reading is sequential. Each
*step* of ``S = B * D`` consecutive instances is cut into ``D`` contiguous slices, one per data-parallel rank
(rank ``r`` reads instances ``[start + r*B, start + (r+1)*B)``), never a strided pattern: each rank reads one
contiguous range of one memory-mapped file per micro-batch (the paper's "contiguous manner").

State. The position is the number of *global* samples consumed in the current pass over the data (plus the pass
number and the manifest fingerprint), not a per-rank batch index. A resumed run with another ``D`` or ``B``
therefore starts at the very next instance: nothing is repeated and nothing is skipped. A checkpoint taken on
other data is refused, because the fingerprint differs.

Equal shapes (needed by expert parallelism, where every rank joins every all-to-all): training drops the last
partial *global* batch of a pass, so every rank always gets ``B x T``; validation keeps every instance and pads
the last step with index ``-1``, which the dataset turns into a row of EOS ids whose labels are all ``-100``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from mula_lightning.data.manifest import DataManifest

PAD_INDEX = -1
IGNORE_INDEX = -100


def check_token_ids(block: np.ndarray, vocab_size: int, where: str, first: int) -> None:
    """Every id of ``block`` (instances ``first, first + 1, ...`` of ``where``) must lie in the vocabulary.

    Raises:
        ValueError: naming ``where``, the instance, the position and the first id outside the vocabulary.
    """
    if block.size and int(block.max()) >= vocab_size:
        row, col = np.argwhere(block >= vocab_size)[0]
        raise ValueError(
            f"{where}: token id {int(block[row, col])} at instance {first + int(row)}, position {int(col)} is "
            f"outside the vocabulary ({vocab_size} ids): the data is corrupt; re-run `mula data prepare`"
        )


class TokenShardDataset(Dataset):
    """The instances of one split, read lazily from memory-mapped ``.npy`` shards.

    Nothing is mapped until the first read, and the maps are dropped when the dataset is pickled, so DataLoader
    worker processes map the files themselves. Items are dicts ``{"input_ids": (T,), "labels": (T,)}`` of int64;
    :meth:`__getitems__` returns a whole batch ``(B, T)`` and reads contiguous index runs as one slice.

    Integrity: sizes, shapes and dtypes are checked by the manifest (headers only); a shard's SHA-256 is checked
    when it is mapped only if nobody verified it before (:meth:`DataManifest.verify_checksum_once`: ``prepare``
    and ``mula data verify`` stamp the shards, and ``MulaDataModule.setup`` verifies unstamped ones once over all
    ranks, so DataLoader workers and ranks never re-read a shard for hashing); every read checks its token ids
    against the vocabulary and names the shard, the instance and the id of the first one outside it.

    Args:
        root: the dataset folder written by ``prepare``.
        split: ``"train"`` or ``"val"``.
        manifest: an already loaded manifest of ``root`` (loaded and verified otherwise).
        verify_checksums: check the SHA-256 of shards not verified before, on first open (see above).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        manifest: DataManifest | None = None,
        verify_checksums: bool = True,
    ) -> None:
        self.root = Path(root)
        self.manifest = manifest or DataManifest.load(self.root)
        if self.manifest.storage != "npy":
            raise ValueError(
                f"{self.root} was prepared with format {self.manifest.storage!r}; TokenShardDataset reads 'npy' "
                "(MulaDataModule reads 'litdata' with LitdataTokenDataset)"
            )
        self.split = split
        self.seq_len = self.manifest.seq_len
        self.eos_id = self.manifest.eos_id
        shards = self.manifest.shards(split)
        self._shards = shards
        self.vocab_size = self.manifest.vocab_size
        self.verify_checksums = verify_checksums
        self._files = [self.root / s["file"] for s in shards]
        self._offsets = np.cumsum([0] + [s["num_instances"] for s in shards])  # shard k holds [off[k], off[k+1])
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    def _shard_maps(self) -> list[np.ndarray]:
        if self._maps is None:
            if self.verify_checksums:
                for shard in self._shards:
                    self.manifest.verify_checksum_once(shard)
            self._maps = [np.load(f, mmap_mode="r") for f in self._files]
        return self._maps

    def _check_ids(self, part: np.ndarray, k: int, first: int) -> None:
        """Token ids of instances ``[first, first + len(part))`` of shard ``k`` must lie in the vocabulary."""
        check_token_ids(part, self.vocab_size, f"shard {self._files[k]}", first)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Instances ``[start, stop)`` as a ``(stop - start, T)`` array (one slice per shard touched)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"range [{start}, {stop}) is outside split {self.split!r} of {len(self)} instances")
        maps = self._shard_maps()
        parts = []
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._offsets[k + 1]))
            local = int(start - self._offsets[k])
            part = maps[k][local : int(end - self._offsets[k])]
            self._check_ids(part, k, local)
            parts.append(part)
            start, k = end, k + 1
        if len(parts) == 1:
            return np.asarray(parts[0])
        return np.concatenate(parts) if parts else np.empty((0, self.seq_len), self.manifest.dtype)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.__getitems__([index])
        return {k: v[0] for k, v in batch.items()}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """A batch ``{"input_ids": (B, T), "labels": (B, T)}``; index ``-1`` is a padding row (labels ``-100``)."""
        first = int(indices[0]) if len(indices) else 0
        if first >= 0 and list(indices) == list(range(first, first + len(indices))):  # the sampler's usual batch
            input_ids = torch.from_numpy(self.read(first, first + len(indices)).astype(np.int64))
            return {"input_ids": input_ids, "labels": input_ids.clone()}
        ids = np.asarray(indices, dtype=np.int64)
        tokens = np.full((len(ids), self.seq_len), self.eos_id, dtype=np.int64)
        real = ids != PAD_INDEX
        run_start = 0
        while run_start < len(ids):  # copy maximal runs of consecutive indices with one slice each
            run_end = run_start + 1
            if real[run_start]:
                while run_end < len(ids) and real[run_end] and ids[run_end] == ids[run_end - 1] + 1:
                    run_end += 1
                first = int(ids[run_start])
                tokens[run_start:run_end] = self.read(first, first + run_end - run_start)
            run_start = run_end
        input_ids = torch.from_numpy(tokens)
        labels = input_ids.clone()
        labels[torch.from_numpy(~real)] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


def collate_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataLoader ``collate_fn``: :meth:`TokenShardDataset.__getitems__` already returns the batch."""
    return batch


class MegatronSampler(DistributedSampler):
    """This rank's sample indices: a contiguous slice of each step of ``micro_batch_size * dp_size`` instances.

    Use with ``DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler)``. It subclasses
    ``DistributedSampler`` only so that Lightning does not wrap it in another distributed sampler; the order is
    its own (see the module docstring) and ``set_epoch`` has no effect on it.

    Progress is advanced by :meth:`mark_consumed` once per micro-batch that training actually used (not per
    batch the loader prefetched); :class:`~mula_lightning.data.MulaDataModule` calls it from Lightning's batch
    hook, a Fabric loop calls it after each micro-batch. When a pass over the data is complete, the next
    ``iter()`` starts the next pass at instance 0.

    Args:
        dataset: the split to sample (only its length and ``manifest.fingerprint`` are used).
        micro_batch_size: instances per rank per micro-batch (``B``).
        dp_rank: this rank's data-parallel index.
        dp_size: data-parallel ranks (``D``).
        global_batch_size: instances per optimizer step over all ranks; a multiple of ``B * D`` (gradient
            accumulation); ``None`` means ``B * D``. Training drops the last partial global batch.
        pad: keep every instance and pad the last step with ``-1`` (validation) instead of dropping it.
    """

    def __init__(
        self,
        dataset: TokenShardDataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        global_batch_size: int | None = None,
        pad: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
        step = micro_batch_size * dp_size
        global_batch_size = global_batch_size or step
        if micro_batch_size < 1 or global_batch_size % step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of micro_batch_size "
                f"({micro_batch_size}) x dp_size ({dp_size}) = {step}"
            )
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.global_batch_size, self.pad, self.step = global_batch_size, pad, step
        self.length = len(dataset)
        self.fingerprint = dataset.manifest.fingerprint
        if pad:
            self.epoch_samples = -(-self.length // step) * step
        else:
            self.epoch_samples = self.length // global_batch_size * global_batch_size
        if self.epoch_samples == 0:
            raise ValueError(
                f"split {dataset.split!r} of {dataset.root} has {self.length} instances, fewer than one global batch "
                f"of {global_batch_size} (micro_batch_size {micro_batch_size} x dp_size {dp_size} x accumulation)"
            )
        self.consumed_samples = 0  # global samples used by training, all passes together
        self.data_epoch = 0  # passes completed
        self.epoch_consumed = 0  # global samples used in the current pass
        self.batches_in_epoch = 0  # this loader's micro-batches used in the current pass

    def _pass_finished(self) -> bool:
        # Not one more full step left (after a resume with a larger step, the remainder is this pass's tail).
        return self.epoch_samples - self.epoch_consumed < self.step

    def _roll_over(self) -> None:
        if self._pass_finished():
            self.data_epoch += 1
            self.epoch_consumed = 0
            self.batches_in_epoch = 0

    def __iter__(self) -> Iterator[int]:
        self._roll_over()
        b, r = self.micro_batch_size, self.dp_rank
        for start in range(self.epoch_consumed, self.epoch_samples - self.step + 1, self.step):
            first = start + r * b
            for index in range(first, first + b):
                yield index if index < self.length else PAD_INDEX

    def __len__(self) -> int:
        """Samples this rank yields in the current pass: consumed micro-batches plus those still to come.

        Lightning compares its restored batch counter with ``len(dataloader)`` to end an epoch, so after a resume
        the already consumed micro-batches are counted in as well.
        """
        if self._pass_finished():  # the next iter() starts a new pass
            return self.epoch_samples // self.step * self.micro_batch_size
        left = (self.epoch_samples - self.epoch_consumed) // self.step
        return (self.batches_in_epoch + left) * self.micro_batch_size

    def mark_consumed(self, num_micro_batches: int = 1) -> None:
        """Record that training used the next ``num_micro_batches`` micro-batches (on every rank)."""
        self._roll_over()
        self.consumed_samples += num_micro_batches * self.step
        self.epoch_consumed += num_micro_batches * self.step
        self.batches_in_epoch += num_micro_batches

    def state_dict(self) -> dict[str, Any]:
        """The data position: global samples consumed, the pass, and the dataset fingerprint."""
        return {
            "consumed_samples": self.consumed_samples,
            "data_epoch": self.data_epoch,
            "epoch_consumed": self.epoch_consumed,
            "batches_in_epoch": self.batches_in_epoch,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (any ``dp_size`` / ``micro_batch_size`` may have written it).

        Raises:
            ValueError: ``state`` was saved while reading another dataset.
        """
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"the checkpoint's data position belongs to dataset {state.get('fingerprint')}, but the data being "
                f"loaded has fingerprint {self.fingerprint}: resume on the dataset the run started with, or start "
                "the data position afresh"
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.data_epoch = int(state["data_epoch"])
        self.epoch_consumed = int(state["epoch_consumed"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
