"""Logical-key state dicts of the hierarchical ZeRO engine (reshard on load), DP-scattered writes.

The same keys as :mod:`mula_lightning.parallel.state_dict` (EPSO), written in the one checkpoint format of
:mod:`mula_lightning.checkpoint.dcp_format`, so a run can be resumed at another layout, another world size or in one
process:

* model: the single-device ``state_dict`` (full tensors, unquantized, gathered from the primary chunks);
  replicated on every rank, DCP's planner writes each tensor once;
* optimizer: ``state.<param name>.<exp_avg | exp_avg_sq | master>`` as 1-D tensors of the parameter's numel; each
  rank of the first optimizer group (``rank < o``) writes the ranges its optimizer chunk holds (DP-scattered: every
  writer writes ``1 / o`` of the states), and on load every rank reads its own ranges (no broadcast);
  ``step`` and the param groups' hyper-parameters as plain values.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from mula_lightning.parallel.state_dict import sharded_vector
from mula_lightning.parallel.zero.collectives import all_gather_chunks
from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
from mula_lightning.utils.dist import is_distributed

_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _vectors(engine: HierarchicalZeroAdamW, unit: Any) -> dict[str, torch.Tensor]:
    out = {"exp_avg": unit.exp_avg, "exp_avg_sq": unit.exp_avg_sq}
    if not unit.master_is_primary:
        out["master"] = unit.master
    return out


def optimizer_state_dict(engine: HierarchicalZeroAdamW, for_load: bool = False) -> dict[str, Any]:
    """Logical-key optimizer state (see the module docstring).

    Saving, the ranks of the first optimizer group write; with ``for_load`` every rank reads its own ranges, its
    optimizer group's ranges forming the global layout (they tile every parameter exactly once).
    """
    lay = engine.layout
    writes = for_load or engine.rank < lay.optimizer_size
    first = engine.rank - engine.rank % lay.optimizer_size if for_load else 0  # the optimizer group that tiles it
    out: dict[str, Any] = {
        "step": engine._step,
        "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params"} for g in engine.param_groups]),
    }
    for u in engine.units:
        vectors = _vectors(engine, u)
        for slot in u.buf.slots:
            mine = [s for s in u.buf.segments if s.slot.name == slot.name] if writes else []
            shards = [
                (r, s.param_start, s.numel)
                for r in range(first, first + lay.optimizer_size)
                for s in u.buf.segments_for(lay.positions(r).optimizer)
                if s.slot.name == slot.name
            ]
            for key, vec in vectors.items():
                local = [vec[s.local_start : s.local_start + s.numel] for s in mine]
                if is_distributed():
                    out[f"state.{slot.name}.{key}"] = sharded_vector(local, shards, slot.numel, vec.device, vec.dtype)
                else:
                    out[f"state.{slot.name}.{key}"] = torch.cat(local) if local else vec.new_zeros(0)
    return out


def model_state_dict(engine: HierarchicalZeroAdamW, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unquantized single-device state dict (cloned while the units are gathered)."""
    with engine.full_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def load_model_state_dict(engine: HierarchicalZeroAdamW, state: dict[str, torch.Tensor]) -> None:
    """Write full tensors into every unit's primary chunk (and the fp32 master when parameters are not fp32)."""
    pos = engine.positions
    for u in engine.units:
        u.allocate()
        for slot in u.buf.slots:
            u.buf.params[slot.start : slot.end].copy_(state[slot.name].reshape(-1))
        u.primary.copy_(u.buf.params[pos.weight * u.nw : (pos.weight + 1) * u.nw])
        if not u.master_is_primary:
            u.master.copy_(u.primary[u.opt_offset : u.opt_offset + u.no])
        u.free()


def apply_optimizer_state_dict(engine: HierarchicalZeroAdamW, state: dict[str, Any]) -> None:
    """After ``dcp.load`` filled :func:`optimizer_state_dict` (``for_load=True``): step, hyper-parameters, masters."""
    engine._step = int(state["step"])
    for group, saved in zip(engine.param_groups, json.loads(state["param_groups"])):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    for u in engine.units:
        vectors = _vectors(engine, u)
        if not is_distributed():
            for seg in u.buf.segments:
                for key, vec in vectors.items():
                    src = state.get(f"state.{seg.slot.name}.{key}")
                    if src is not None:
                        vec[seg.local_start : seg.local_start + seg.numel].copy_(
                            src[seg.param_start : seg.param_start + seg.numel]
                        )
        if not u.master_is_primary:
            own = u.primary[u.opt_offset : u.opt_offset + u.no]
            own.copy_(u.master)
            group, size, positions = engine._group("post_step")
            all_gather_chunks(own.clone(), u.primary, group, size, positions, "weights.post_step")
