"""Model-only checkpoints written by every rank of a sharded run, without gathering the model anywhere.

Why: ``ModelOnlyCheckpoint`` used to gather every tensor (all experts) on every rank and let rank 0 write one
file: at 220B that is the model on each rank, every 1000 steps. Here (collective over the default group):

1. every rank casts what it holds (zero_topo: the pieces of its primary chunks; epso: its expert slices and the
   replicated tensors) to the checkpoint's dtype and writes it into a staging DCP directory inside the new
   checkpoint (DCP writes each replicated piece once; epso's planner spreads those writes over the DP ranks);
2. the model-only files (Mula names, transformers' shard names and index beyond 5 GiB) and, with ``hf_export``, the
   transformers directory are streamed out of the staging directory one tensor at a time
   (:mod:`mula_lightning.checkpoint.hf_stream`), file ``i`` by rank ``i % world``;
3. rank 0 writes the config, data and trainer-state files, removes the staging directory, fsyncs, and renames the
   temporary directory into place: a ``step-*`` directory is complete or absent, as before.

The result is the format of :mod:`mula_lightning.models.checkpoint_io` (one ``model.safetensors`` when the weights
fit in one file), loadable by ``load_model_only``, ``restore_weights``, ``init_from`` and ``mula export``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.checkpoint.dcp_format import save_dcp
from mula_lightning.checkpoint.hf_stream import export_dcp_to_hf, write_safetensors_streaming
from mula_lightning.parallel.tensor_pieces import map_held
from mula_lightning.utils.dist import is_distributed, rank_world
from mula_lightning.utils.io import fsync_dir
from mula_lightning.utils.safe_load import SafeFileSystemReader, dcp_load

__all__ = ["TRAINER_STATE_NAME", "cast_shards", "save_model_only_sharded"]

STAGING = ".dcp"
TRAINER_STATE_NAME = "trainer_state.json"


def cast_shards(value: Any, dtype: torch.dtype | None) -> Any:
    """A copy of what this rank holds of a tensor in ``dtype`` (floating point only; None keeps the dtype):
    :class:`TensorPieces` piece by piece, a DTensor as the pieces of its local shard, a plain tensor whole."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(dtype, copy=True) if dtype is not None and t.is_floating_point() else t.clone()

    return map_held(value, cast)


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def save_model_only_sharded(
    state: dict[str, Any],
    planner: Any,
    config: Any,
    path: str | Path,
    dtype: torch.dtype | None = torch.bfloat16,
    hf_export: bool = False,
    meta: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write the model-only checkpoint ``path`` from every rank's shards (see the module docstring; collective).

    Args:
        state: the model's logical-key state on this rank (Mula names; TensorPieces, DTensors or plain tensors).
        planner: the DCP save planner of the strategy (None: deduplication by DCP's default).
        config: the model's ``MulaConfig``.
        dtype, hf_export, meta, data: as for ``ModelOnlyCheckpoint`` / ``save_weights``.
    """
    from mula_lightning.checkpoint.export import write_tokenizer
    from mula_lightning.models.checkpoint_io import CONFIG_NAME, save_data_info
    from mula_lightning.models.hf_convert import plan_shards, shard_names, write_shard_index

    rank, world = rank_world()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")  # one name for every rank: they all write into it
    staging = tmp / STAGING
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    save_dcp(staging, {"model": {k: cast_shards(v, dtype) for k, v in state.items()}}, {}, planner)
    _barrier()

    items = SafeFileSystemReader(str(staging)).read_metadata().state_dict_metadata
    stored = {k[len("model.") :]: (tuple(md.size), md.properties.dtype) for k, md in items.items()
              if k.startswith("model.") and hasattr(md, "size")}  # fmt: skip
    if config.tie_word_embeddings:
        stored.pop("lm_head.weight", None)

    def produce(key: str) -> torch.Tensor:
        shape, tensor_dtype = stored[key]
        target = {f"model.{key}": torch.empty(shape, dtype=tensor_dtype)}
        dcp_load(target, staging, strict=True, no_dist=True)
        return target[f"model.{key}"]

    sizes = [(k, math.prod(shape) * d.itemsize) for k, (shape, d) in stored.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    for i, (keys, name) in enumerate(zip(shards, shard_names(len(shards)))):
        if i % world == rank:
            write_safetensors_streaming(tmp / name, [(k, *stored[k]) for k in keys], produce)
    if hf_export:
        export_dcp_to_hf(staging, tmp / "hf", config, "model.", max_shard_bytes, part=(rank, world))
    _barrier()
    if rank == 0:
        write_shard_index(tmp, shards, sum(n for _, n in sizes))
        (tmp / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        if data is not None:
            save_data_info(tmp, data)
            if hf_export:
                write_tokenizer(tmp / "hf", data, config.vocab_size)
        info = {**(meta or {}), "dtype": str(dtype).replace("torch.", "") if dtype else "as trained"}
        (tmp / TRAINER_STATE_NAME).write_text(json.dumps(info, indent=1))
        shutil.rmtree(staging)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        for directory in [tmp, *(d for d in tmp.rglob("*") if d.is_dir())]:
            fsync_dir(directory)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    _barrier()
    return path
