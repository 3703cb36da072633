"""litdata storage: the same permuted instances, written as litdata token chunks and read back by the DataModule.

For users who stream data from object storage with ``litdata.StreamingDataset`` rather than memory-mapping local
shards. ``prepare(..., format="litdata")`` writes each split with ``litdata.optimize`` and ``TokensLoader`` into
``litdata/<split>``: every item is one instance of ``seq_len`` tokens, so reading with
``TokensLoader(block_size=seq_len)`` gives back exactly the instances, in the permuted order, that the ``npy``
format would hold. The folder is written under a temporary name and renamed, like every other output. Tokens keep
the manifest's dtype (``uint16`` chunks for vocabularies up to 65536; ``uint32`` ids, which litdata cannot store,
are written as ``int32``: every id is below 2**31).

:class:`LitdataTokenDataset` is what :class:`~mula_lightning.data.MulaDataModule` reads such a dataset with: the
instances by index through ``StreamingDataset`` (random access, no shuffling of its own), so the project's sampler
decides the order and the resume position exactly as for ``npy`` shards (exact resume, any DP size), and every read
checks its token ids against the vocabulary. ``open_litdata`` gives the plain ``StreamingDataset`` for litdata's own
loaders.
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mula_lightning.data.dataset import TokenShardDataset, check_token_ids
from mula_lightning.data.manifest import DataManifest

LITDATA_DIR = "litdata"
_CACHE_VARS = {"DATA_OPTIMIZER_CACHE_FOLDER": "chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": "data"}


def _yield_instances(id_range: tuple[int, int], ids: np.ndarray, reader: Any):
    """litdata worker function: the instances ``ids[start:end]`` as 1-D token tensors, in order."""
    import torch

    start, end = id_range
    block = reader.read(ids[start:end])
    for row in block:  # uint16 stays uint16; litdata has no uint32, and every id fits int32
        yield torch.from_numpy(np.ascontiguousarray(row.astype(np.int32) if row.dtype == np.uint32 else row))


def write_litdata_split(out: Path, split: str, ids: np.ndarray, reader: Any, shard_tokens: int) -> dict[str, Any]:
    """Write one split into ``<out>/litdata/<split>`` (skipped when a previous run finished it).

    Args:
        out: the dataset folder.
        split: ``"train"`` or ``"val"``.
        ids: global instance ids in the order to write them.
        reader: maps instance ids to token rows (:class:`~mula_lightning.data.shards.InstanceReader`).
        shard_tokens: tokens per litdata chunk (rounded to whole instances).
    """
    target = out / LITDATA_DIR / split
    per_chunk = max(1, shard_tokens // reader.seq_len)
    if len(ids) and not target.is_dir():
        tmp = target.with_name(f"{split}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        # litdata stages files in <cache>/chunks and <cache>/data (default: /tmp); keep them beside the output.
        scratch = target.with_name(f"cache.tmp-{os.getpid()}")
        saved = {k: os.environ.get(k) for k in _CACHE_VARS}
        os.environ.update({k: str(scratch / sub) for k, sub in _CACHE_VARS.items()})
        try:
            _optimize(ids, reader, tmp, per_chunk)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(scratch, ignore_errors=True)
        os.replace(tmp, target)
    return {"num_instances": len(ids), "dir": f"{LITDATA_DIR}/{split}", "shards": []}


def _optimize(ids: np.ndarray, reader: Any, output_dir: Path, per_chunk: int) -> None:
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    step = max(1, min(per_chunk, 4096))
    ranges = [(s, min(s + step, len(ids))) for s in range(0, len(ids), step)]
    optimize(
        fn=partial(_yield_instances, ids=ids, reader=reader),
        inputs=ranges,
        output_dir=str(output_dir),
        chunk_size=per_chunk * reader.seq_len,
        item_loader=TokensLoader(),
        num_workers=1,
        reorder_files=False,
        start_method="fork" if os.name == "posix" else None,  # the reader's memory maps are inherited, not copied
        verbose=False,
    )


def open_litdata(root: str | os.PathLike, split: str = "train", **kwargs: Any):
    """A ``litdata.StreamingDataset`` over a split written by ``prepare(..., format="litdata")``.

    Args:
        root: the dataset folder.
        split: ``"train"`` or ``"val"``.
        kwargs: passed to ``StreamingDataset`` (``shuffle``, ``cache_dir``, ...).

    Raises:
        ValueError: the dataset was not written in the litdata format.
    """
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    manifest = DataManifest.load(root)
    if manifest.storage != "litdata":
        raise ValueError(f"{root} was prepared with format {manifest.storage!r}, not 'litdata'")
    path = Path(root) / manifest.content["splits"][split]["dir"]
    return StreamingDataset(str(path), item_loader=TokensLoader(block_size=manifest.seq_len), **kwargs)


class LitdataTokenDataset(TokenShardDataset):
    """The instances of one split of a litdata-format dataset, by index, with the interface of
    :class:`~mula_lightning.data.dataset.TokenShardDataset` (``read``, ``__getitems__``), so the sampler and the
    DataModule treat both formats alike.

    The ``StreamingDataset`` is opened on first read in each process (DataLoader workers open their own).

    Args:
        root: the dataset folder written by ``prepare(..., format="litdata")``.
        split: ``"train"`` or ``"val"``.
        manifest: an already loaded manifest of ``root``.
        cache_dir: litdata's cache folder (its default when None).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        manifest: DataManifest | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.manifest = manifest or DataManifest.load(self.root)
        if self.manifest.storage != "litdata":
            raise ValueError(f"{self.root} was prepared with format {self.manifest.storage!r}, not 'litdata'")
        self.split = split
        self.seq_len = self.manifest.seq_len
        self.eos_id = self.manifest.eos_id
        self.vocab_size = self.manifest.vocab_size
        self.cache_dir = cache_dir
        self._length = self.manifest.num_instances(split)
        self._stream: Any = None

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_stream"] = None
        return state

    def read(self, start: int, stop: int) -> np.ndarray:
        """Instances ``[start, stop)`` as a ``(stop - start, T)`` array of the manifest's dtype."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"range [{start}, {stop}) is outside split {self.split!r} of {len(self)} instances")
        if self._stream is None:
            kwargs = {"cache_dir": self.cache_dir} if self.cache_dir else {}
            self._stream = open_litdata(self.root, self.split, **kwargs)
        rows = [self._stream[i].numpy() for i in range(start, stop)]
        block = np.stack(rows) if rows else np.empty((0, self.seq_len), self.manifest.dtype)
        check_token_ids(block, self.vocab_size, f"litdata chunks {self.root / LITDATA_DIR / self.split}", start)
        return block.astype(self.manifest.dtype, copy=False)
