"""Logical-key state dicts of the hierarchical ZeRO engine (reshard on load), DP-scattered writes.

The same keys as :mod:`mula_lightning.parallel.state_dict` (EPSO), written in the one checkpoint format of
:mod:`mula_lightning.checkpoint.dcp_format`, so a run can be resumed at another layout, another world size or in one
process:

* model: the single-device ``state_dict`` keys and shapes, each parameter as the pieces of it in this rank's primary
  chunk (unquantized; :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces`, no gather): every weight group
  holds the whole model, DCP's planner writes each piece once; a load reads straight into the primary chunks;
* optimizer: ``state.<param name>.<exp_avg | exp_avg_sq | master>`` shaped like the parameter; each
  rank of the first optimizer group of a unit's family (``rank < o``; for expert slices, edp index ``< o`` of them)
  writes the ranges its optimizer chunk holds (DP-scattered: every writer writes ``1 / o`` of the states), and on
  load every rank reads its own ranges (no broadcast);
* expert slices (expert parallelism) are saved at their rows of the single-device tensor, so a checkpoint loads at
  any ``ep_size`` or in one process;
  ``step`` and the param groups' hyper-parameters as plain values.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.parallel.state_dict import placed_pieces, state_pieces
from mula_lightning.parallel.tensor_pieces import TensorPieces, flat_range_pieces
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
    out: dict[str, Any] = {
        "step": engine._step,
        "param_groups": json.dumps([{k: v for k, v in g.items() if k != "params"} for g in engine.param_groups]),
    }
    for u in engine.units:
        vectors = _vectors(engine, u)
        writes = for_load or u.family.index < u.family.layout.optimizer_size  # the family's first optimizer group
        for slot in u.buf.slots:
            if not slot.param.requires_grad:  # frozen: no optimizer state, as torch's AdamW and epso keep none
                continue
            mine = [s for s in u.buf.segments if s.slot.name == slot.name] if writes else []
            for key, vec in vectors.items():
                local = [(s.param_start, vec[s.local_start : s.local_start + s.numel]) for s in mine]
                shape = tuple(slot.param.shape)
                if is_distributed():
                    layout = engine.checkpoint_layout(slot.name, slot.param)
                    out[f"state.{slot.name}.{key}"] = state_pieces(local, shape, layout, vec)
                else:  # one process holds every element: the whole state, in the parameter's shape
                    out[f"state.{slot.name}.{key}"] = torch.cat([t for _, t in local]).view(shape)
    return out


def model_state_dict(engine: HierarchicalZeroAdamW, model: torch.nn.Module) -> dict[str, Any]:
    """The model's single-device keys and shapes for DCP, each parameter as the pieces of this rank's primary chunk.

    Nothing is gathered or copied: a :class:`~mula_lightning.parallel.tensor_pieces.TensorPieces` views the primary
    chunk (the unquantized weights, which the engine keeps between steps), so a save writes every rank's chunk (DCP
    writes one replica of each) and a load reads straight into it (then call :func:`load_model_state_dict`).
    Tensors the engine does not own (buffers, frozen parameters) are plain, replicated tensors.
    """
    pieces: dict[int, TensorPieces] = {}
    for u in engine.units:
        lo = u.family.positions.weight * u.nw
        for slot in u.buf.slots:
            s, e = max(lo, slot.start), min(lo + u.nw, slot.end)
            shape = tuple(slot.param.shape)
            held = []
            if s < e:
                held = flat_range_pieces(u.primary[s - lo : e - lo], shape, s - slot.start, e - slot.start)
            full, blocks = engine.checkpoint_layout(slot.name, slot.param)
            held = placed_pieces(held, shape, blocks)  # an expert slice: at its experts' rows
            pieces[id(slot.param)] = TensorPieces(full, held, dtype=u.primary.dtype, device=u.primary.device)
    return {k: pieces.get(id(v), v.detach()) for k, v in model.state_dict(keep_vars=True).items()}


def full_model_state_dict(engine: HierarchicalZeroAdamW, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unquantized single-device state dict (cloned while the units are gathered, on every rank; expert
    slices gathered over the EP group)."""
    with engine.full_parameters():
        if engine.ep_size > 1:
            state = gather_expert_parallel_state_dict(model, engine.ep_group)
        else:
            state = model.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}


@torch.no_grad()
def load_model_state_dict(engine: HierarchicalZeroAdamW, state: dict[str, Any]) -> None:
    """After ``dcp.load`` filled :func:`model_state_dict` (``state``) in place: the primary chunks and the tensors the
    engine does not own hold the loaded values; refresh the fp32 masters of non-fp32 parameters from them."""
    del state  # filled in place: its pieces are views of the primary chunks
    for u in engine.units:
        if not u.master_is_primary:
            u.master.copy_(u.primary[u.opt_offset : u.opt_offset + u.no])


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
                        src = src.reshape(-1)  # any saved shape
                        vec[seg.local_start : seg.local_start + seg.numel].copy_(
                            src[seg.param_start : seg.param_start + seg.numel]
                        )
        if not u.master_is_primary:
            own = u.primary[u.opt_offset : u.opt_offset + u.no]
            own.copy_(u.master)
            group, size, positions = engine._group("post_step", u)
            all_gather_chunks(own.clone(), u.primary, group, size, positions, "weights.post_step")
