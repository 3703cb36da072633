"""Data: tokenize -> global shuffle -> memory-mapped shards, an exactly resumable sampler, and the DataModule.

- :func:`prepare` (``mula data prepare``): Section 4 of the Aurora paper, resumable and atomic.
- :class:`DataManifest`: what was prepared, verified against the shards; gives the model its vocabulary size.
- :class:`TokenShardDataset` and :class:`MegatronSampler`: contiguous per-rank slices of each global batch,
  resumable across a change of data-parallel size or micro-batch size.
- :class:`MulaDataModule`: the LightningDataModule wiring both, with state-dict hooks for exact resume.

``prepare`` is imported eagerly: its name is also its module's, and the function must win. The other names
are imported on first use, so ``prepare``'s worker processes never import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from mula_lightning.data.prepare import prepare

_EXPORTS = {
    "DataManifest": "mula_lightning.data.manifest",
    "TokenShardDataset": "mula_lightning.data.dataset",
    "MegatronSampler": "mula_lightning.data.dataset",
    "MulaDataModule": "mula_lightning.data.datamodule",
    "open_litdata": "mula_lightning.data.litdata_io",
    "LitdataTokenDataset": "mula_lightning.data.litdata_io",
}

__all__ = [
    "DataManifest",
    "LitdataTokenDataset",
    "MegatronSampler",
    "MulaDataModule",
    "TokenShardDataset",
    "open_litdata",
    "prepare",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mula_lightning.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
