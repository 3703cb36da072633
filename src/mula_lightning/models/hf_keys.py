"""How transformers checkpoints name the tensors Mula names otherwise: the Hub's per-expert keys (OLMoE, Qwen-MoE,
Mixtral), the family renames, safetensors' dtype names. Shared by the in-memory conversion
(:mod:`~mula_lightning.models.hf_convert`) and the per-tensor reader (:mod:`~mula_lightning.models.hf_store`), so
the two cannot drift apart.
"""

from __future__ import annotations

import re
from typing import Any

from mula_lightning.models.safetensors_file import SAFETENSORS_DTYPE_NAMES  # safetensors' dtype names

__all__ = [
    "MIXTRAL_EXPERT_KEY",
    "MIXTRAL_NAMES",
    "OLMOE_EXPERT_KEY",
    "SAFETENSORS_DTYPE_NAMES",
    "checked_expert_ids",
    "hf_key_to_mula",
]

#: a Hub-style per-expert tensor: OLMoE / Qwen-MoE (``mlp.experts.E.gate_proj.weight``) and Mixtral (``w1/w2/w3``)
OLMOE_EXPERT_KEY = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
MIXTRAL_EXPERT_KEY = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_key_to_mula(key: str) -> str:
    """The Mula name of a transformers key that is stored whole (transformers' family-specific renames)."""
    return key.replace(".mlp.shared_expert.", ".mlp.shared_experts.").replace(".block_sparse_moe.", ".mlp.")


def checked_expert_ids(prefix: str, experts: dict[int, dict[str, Any]]) -> list[int]:
    """The expert ids of one MoE layer's per-expert tensors (``{id: {projection: tensor or key}}``), sorted.

    Raises:
        KeyError: ids that are not contiguous from 0, or an expert missing a projection (both named).
    """
    ids = sorted(experts)
    if ids != list(range(len(ids))):
        raise KeyError(f"{prefix}: expert ids are not contiguous from 0: {ids}")
    missing = [(e, n) for e in ids for n in ("gate_proj", "up_proj", "down_proj") if n not in experts[e]]
    if missing:
        raise KeyError(f"{prefix}: missing per-expert weights {missing}")
    return ids
