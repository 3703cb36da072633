"""Sharded checkpoints of the ``epso`` strategies: modules and EPSO optimizers by logical key, the rest as metadata.

What goes where (the file format is :mod:`mula_lightning.checkpoint.dcp_format`, shared with ``zero_topo``):

* an ``nn.Module``: its logical-key state dict (:func:`~mula_lightning.parallel.state_dict.model_state_dict`;
  expert tensors as DTensors sharded over EP), written DP-scattered (:class:`DPScatteredSavePlanner`: replicated
  tensors of model shard m are written from DP index ``m % DP``) and, on load, read once per model shard and
  broadcast to its replicas (:func:`~mula_lightning.checkpoint.scattered.load_model_once`);
* a (wrapped) :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW`: its owned ranges as 1-D
  ``state.<param>.<key>`` vectors, each read back by its owner at any layout;
* state dicts made by the Trainer's hooks (``state_dict``, ``optimizer_<i>``) as they are;
* anything else (loops, callbacks, schedulers, plain values) goes to the metadata item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from mula_lightning.checkpoint.dcp_format import load_dcp, save_dcp, saved_keys
from mula_lightning.checkpoint.scattered import DPScatteredSavePlanner, broadcast_model, load_model_once
from mula_lightning.parallel.sharded_optimizer import ShardedAdamW, unwrap_optimizer
from mula_lightning.parallel.state_dict import apply_optimizer_state_dict, model_state_dict, optimizer_state_dict
from mula_lightning.parallel.topology import MoETopology

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint", "sharded_checkpoint_parts"]


def _to_saveable(value: Any, topology: MoETopology) -> Any:
    if isinstance(value, nn.Module):
        return model_state_dict(value, topology)
    if isinstance(unwrap_optimizer(value), ShardedAdamW):
        return optimizer_state_dict(unwrap_optimizer(value))
    return None


def sharded_checkpoint_parts(
    state: dict[str, Any], topology: MoETopology, metadata: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], DPScatteredSavePlanner]:
    """What :func:`save_sharded_checkpoint` writes: (logical-key tensors, metadata entries, the DP-scattered planner).

    The tensors view this rank's live state (nothing copied): an asynchronous save stages them to host memory first.
    """
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = dict(metadata or {})
    for key, value in state.items():
        saveable = _to_saveable(value, topology)
        if saveable is not None:
            tensors[key] = saveable
        elif isinstance(value, dict) and (key == "state_dict" or key.startswith("optimizer_")):
            tensors[key] = value
        else:
            extra[key] = value.state_dict() if hasattr(value, "state_dict") else value
    # replicated items are written from DP index m % DP for model-parallel shard m (spread over nodes)
    return tensors, extra, DPScatteredSavePlanner(topology.dp_size, topology.ep_size, topology.stage_size)


def save_sharded_checkpoint(
    path: Path, state: dict[str, Any], topology: MoETopology, metadata: dict[str, Any] | None = None
) -> None:
    """Write a DCP directory: modules and sharded optimizers by logical key, everything else as metadata.

    The metadata holds tensors and plain data only (``torch.save`` bytes, read back with ``weights_only=True``).

    Args:
        state: modules, (wrapped) sharded optimizers, state dicts made by the Trainer's hooks, or plain objects
            (those go to the metadata, as their ``state_dict()`` when they have one).
        metadata: more entries (the Trainer's loops, callbacks, schedulers, ...): tensors and plain data.
    """
    tensors, extra, planner = sharded_checkpoint_parts(state, topology, metadata)
    save_dcp(path, tensors, extra, planner=planner)


def load_sharded_checkpoint(path: Path, state: dict[str, Any], topology: MoETopology, strict: bool = True):
    """Load a :func:`save_sharded_checkpoint` directory into ``state`` in place, at any layout.

    Modules and sharded optimizers in ``state`` are filled from their logical keys; other entries are restored
    from the metadata (``load_state_dict`` when they have one). Returns the metadata entries that are
    not in ``state`` (Fabric's contract; for the Trainer, the rest of its checkpoint dict).
    """
    saved = saved_keys(path)
    targets: dict[str, Any] = {}
    modules: list[nn.Module] = []
    for key, value in state.items():
        saveable = _to_saveable(value, topology)
        if saveable is None:
            continue
        if key not in saved:
            if strict:
                raise KeyError(f"{path}: the checkpoint has no {key!r} (it holds {sorted(saved)})")
            continue
        if isinstance(value, nn.Module):  # weights: one reader per shard, broadcast to the replicas after the load
            modules.append(value)
            saveable = load_model_once(saveable, topology)
            if not saveable:
                continue
        targets[key] = saveable  # optimizer shards: read by their owners
    metadata = load_dcp(path, targets, strict)
    for module in modules:
        broadcast_model(module, topology)
    for key, value in state.items():
        if key in targets and isinstance(unwrap_optimizer(value), ShardedAdamW):
            apply_optimizer_state_dict(unwrap_optimizer(value), targets[key])
    for key in list(state):
        if key in targets or key not in metadata or isinstance(state[key], nn.Module):
            continue
        if hasattr(state[key], "load_state_dict"):
            state[key].load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return {k: v for k, v in metadata.items() if k not in state}
