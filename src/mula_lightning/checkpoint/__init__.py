"""checkpoint: the formats and protocols of everything a run writes (Aurora paper, Section 4).

* ``dcp_format``: the one on-disk format of sharded checkpoints, written by both sharded strategies: a
  ``torch.distributed.checkpoint`` directory of logical-key tensors plus one metadata item (data only).
* ``slots``: the dual-slot protocol (two slots, a durable marker written last, agreed completion and resume,
  ``ckpt_path="last"``) that :class:`~mula_lightning.callbacks.DualCheckpoint` drives; no Lightning dependency.
* ``async_slots``: the same protocol with the writes in a background thread (state staged to host memory at the
  step, at most one save in flight, a checkpoint-only gloo group for the background collectives).
* ``checksummed_writes`` / ``direct_writes``: how DCP's files reach storage: checksummed on the way, written with
  ``O_DIRECT`` from an aligned buffer (not through the page cache) where the file system allows it.
* ``scattered``: the DP-scattered DCP save planner (replicated tensors written from DP index ``m % DP``, so the
  writes spread over nodes) and load-once-and-broadcast of the weights.
* ``export``: ``mula export CKPT --to hf DIR`` from any checkpoint the project writes.
* ``cli``: ``mula checkpoint convert`` for checkpoints of the earlier pickled format.

Logical-key state dicts (what is inside a checkpoint, independent of the layout) are built next to the engines that
own the tensors (:mod:`mula_lightning.parallel.state_dict`, :mod:`mula_lightning.parallel.zero.state_dict`);
model-only checkpoints are read and written by :mod:`mula_lightning.models.checkpoint_io`, because upcycling (in
``models/``) reads them and dependencies point one way (``models`` <- ``parallel`` <- ``checkpoint``). Every reader
here builds data only (:mod:`mula_lightning.utils.safe_load`).

Names are imported lazily (PEP 562), so that the slot protocol does not pay for the export's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_dcp": "mula_lightning.checkpoint.dcp_format",
    "save_dcp": "mula_lightning.checkpoint.dcp_format",
    "DPScatteredSavePlanner": "mula_lightning.checkpoint.scattered",
    "broadcast_model": "mula_lightning.checkpoint.scattered",
    "load_model_once": "mula_lightning.checkpoint.scattered",
    "AsyncSlotSaver": "mula_lightning.checkpoint.async_slots",
    "CheckpointIntegrityError": "mula_lightning.checkpoint.slots",
    "CheckpointWriteError": "mula_lightning.checkpoint.slots",
    "choose_slot": "mula_lightning.checkpoint.slots",
    "resolve_last": "mula_lightning.checkpoint.slots",
    "save_slot": "mula_lightning.checkpoint.slots",
    "load_any": "mula_lightning.checkpoint.export",
    "load_model_only": "mula_lightning.models.checkpoint_io",
    "save_model_only": "mula_lightning.models.checkpoint_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
