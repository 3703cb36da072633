"""A transformers directory's weights under Mula's names, each tensor (or part of one) converted when it is read.

Why: ``init_from`` a transformers directory used to load the whole directory and convert it in memory on every rank
that read a tensor: 470 GB per reader for a 235B bf16 checkpoint. :class:`HfStore` plans, from the safetensors
headers alone, where every Mula tensor's elements live, and reads only what is asked for:

* a tensor stored under its Mula name (after transformers' renames: Mixtral's ``block_sparse_moe`` is ``mlp``,
  Qwen2-MoE's ``shared_expert`` is ``shared_experts``): a slice of it;
* a fused expert tensor of a Hub-style checkpoint that stores one tensor per expert (OLMoE, Qwen3-MoE, Mixtral):
  ``gate_up_proj[e]`` is ``cat(gate_e, up_e)`` and ``down_proj[e]`` is ``down_e``, so a slice of experts reads only
  those experts' tensors, and only the rows and columns asked for;
* a dense model exported as a one-expert OLMoE, read by a dense config: ``gate_proj`` / ``up_proj`` are the two
  halves of ``gate_up_proj[0]``, ``down_proj`` is ``down_proj[0]``;
* a tied head: the embedding.

Each Mula tensor is a stack (over experts, for a fused expert tensor) of row-wise concatenations of *segments*, each
a row range of one stored tensor (optionally at one index of its leading dimension): a box of the Mula tensor maps
to a box of every segment it overlaps. :func:`~mula_lightning.models.hf_convert.hf_to_mula_state_dict` is the
in-memory conversion the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.hf_keys import (
    MIXTRAL_EXPERT_KEY,
    MIXTRAL_NAMES,
    OLMOE_EXPERT_KEY,
    SAFETENSORS_DTYPE_NAMES,
    checked_expert_ids,
    hf_key_to_mula,
)
from mula_lightning.models.upcycle_source import Index, SafetensorsStore, TensorStore, index_bounds

__all__ = ["HfStore"]


@dataclass(frozen=True)
class _Segment:
    """Rows ``[row0, row0 + rows)`` of stored tensor ``key`` (of ``key[lead]`` when ``lead`` is not None)."""

    key: str
    rows: int
    row0: int = 0
    lead: int | None = None


@dataclass(frozen=True)
class _Plan:
    """A Mula tensor: ``shape``, ``dtype`` and its segments (one list per expert when ``stacked``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Any, ...]
    stacked: bool = False


class HfStore(TensorStore):
    """The weights of the transformers directory ``path`` under Mula's names for ``config`` (see the module
    docstring); ``files`` is the raw safetensors store.

    Raises:
        FileNotFoundError: no safetensors weights, or a file the index lists is missing.
        KeyError: a Hub-style MoE checkpoint with expert ids that are not contiguous from 0 or a missing per-expert
            tensor (named).
        ValueError: a dense config for a checkpoint of several experts.
    """

    def __init__(self, path: str | Path, config: MulaConfig) -> None:
        super().__init__()
        self.path = Path(path)
        self.files = SafetensorsStore(self.path)
        entries = self.files.entries()
        self._stored = {k: (shape, SAFETENSORS_DTYPE_NAMES[dtype]) for k, (shape, dtype) in entries.items()}
        self._plans = self._plan(self._stored, config)

    def _plan(self, stored: dict[str, tuple[tuple[int, ...], torch.dtype]], config: MulaConfig) -> dict[str, _Plan]:
        plans: dict[str, _Plan] = {}
        per_expert: dict[str, dict[int, dict[str, str]]] = {}
        for key, (shape, dtype) in stored.items():
            if m := OLMOE_EXPERT_KEY.match(key):
                prefix, e, name = m.group(1), int(m.group(2)), m.group(3)
            elif m := MIXTRAL_EXPERT_KEY.match(key):
                prefix, e, name = f"{m.group(1)}.mlp", int(m.group(2)), MIXTRAL_NAMES[m.group(3)]
            else:
                plans[hf_key_to_mula(key)] = _Plan(shape, dtype, (_Segment(key, shape[0] if shape else 1),))
                continue
            per_expert.setdefault(prefix, {}).setdefault(e, {})[name] = key
        for prefix, experts in per_expert.items():
            ids = checked_expert_ids(prefix, experts)
            gate, down = stored[experts[0]["gate_proj"]], stored[experts[0]["down_proj"]]
            inter, hidden = gate[0][0], down[0][0]
            plans[f"{prefix}.experts.gate_up_proj"] = _Plan(
                (len(ids), 2 * inter, *gate[0][1:]), gate[1],
                tuple((_Segment(experts[e]["gate_proj"], inter), _Segment(experts[e]["up_proj"], inter)) for e in ids),
                stacked=True,
            )  # fmt: skip
            plans[f"{prefix}.experts.down_proj"] = _Plan(
                (len(ids), *down[0]), down[1], tuple((_Segment(experts[e]["down_proj"], hidden),) for e in ids), True
            )
        if config.tie_word_embeddings and "model.embed_tokens.weight" in plans:
            plans["lm_head.weight"] = plans["model.embed_tokens.weight"]
        if not config.is_moe:  # a dense model exported as a one-expert OLMoE comes back dense
            for i in range(config.num_layers):
                p = f"model.layers.{i}.mlp"
                if f"{p}.experts.gate_up_proj" not in plans:
                    continue
                gate_up, down = plans.pop(f"{p}.experts.gate_up_proj"), plans.pop(f"{p}.experts.down_proj")
                plans.pop(f"{p}.gate.weight", None)
                if gate_up.shape[0] != 1:
                    raise ValueError(f"{p}: a dense config cannot load {gate_up.shape[0]} experts")
                half, (hidden, inter) = gate_up.shape[1] // 2, down.shape[1:]
                if gate_up.stacked:  # one tensor per expert: expert 0's own
                    (gate, up), (down_rows,) = gate_up.parts[0], down.parts[0]
                else:  # fused (1, 2I, H) and (1, H, I): halves of expert 0
                    key = gate_up.parts[0].key
                    gate, up = _Segment(key, half, 0, lead=0), _Segment(key, half, half, lead=0)
                    down_rows = _Segment(down.parts[0].key, hidden, lead=0)
                plans[f"{p}.gate_proj.weight"] = _Plan((half, *gate_up.shape[2:]), gate_up.dtype, (gate,))
                plans[f"{p}.up_proj.weight"] = _Plan((half, *gate_up.shape[2:]), gate_up.dtype, (up,))
                plans[f"{p}.down_proj.weight"] = _Plan((hidden, inter), down.dtype, (down_rows,))
        return plans

    def keys(self) -> set[str]:
        return set(self._plans)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._plans[key].shape

    def _rows(self, segments: tuple[_Segment, ...], bounds: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        """The box ``bounds`` of the row-wise concatenation of ``segments``."""
        (lo, hi), rest = bounds[0], [slice(a, b) for a, b in bounds[1:]]
        pieces, offset = [], 0
        for seg in segments:
            a, b = max(lo, offset), min(hi, offset + seg.rows)
            if a < b:
                rows = slice(seg.row0 + a - offset, seg.row0 + b - offset)
                index = (slice(seg.lead, seg.lead + 1), rows, *rest) if seg.lead is not None else (rows, *rest)
                part = self.files.read(seg.key, index)
                pieces.append(part[0] if seg.lead is not None else part)
            offset += seg.rows
        if not pieces:
            return torch.empty([b - a for a, b in bounds], dtype=dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def _read(self, key: str, index: Index) -> torch.Tensor:
        plan = self._plans[key]
        bounds = index_bounds(index, plan.shape, key)
        if not plan.shape:  # a scalar: read whole
            return self.files.read(plan.parts[0].key)
        if not plan.stacked:
            return self._rows(plan.parts, bounds, plan.dtype)
        (lo, hi), inner = bounds[0], bounds[1:]
        experts = [self._rows(plan.parts[e], inner, plan.dtype) for e in range(lo, hi)]
        if not experts:
            return torch.empty([b - a for a, b in bounds], dtype=plan.dtype)
        return torch.stack(experts)
