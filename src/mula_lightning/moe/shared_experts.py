"""Shared experts: the always-on part of an MoE layer (DeepSeek-V3's ``n_shared_experts``, Qwen2-MoE's gated one).

Legend: S = tokens, H = hidden size, I_s = the shared experts' width.

Every token goes through the shared experts besides its routed ones, and their output is added to the weighted sum
of the routed experts' outputs:

* DeepSeek-V3 (``shared_experts = n``): ``n`` SwiGLU experts of the routed experts' width, always on and unweighted;
  n experts side by side are one SwiGLU of ``n`` times the width (transformers stores them so), which this module is.
* Qwen2-MoE (``shared_expert_intermediate_size`` and ``shared_expert_gate``): one SwiGLU of its own width whose
  output is scaled per token by ``sigmoid(gate(x))``, a learned scalar gate.

They are not expert parameters for sharding: expert parallelism leaves them whole on every rank (replicated over
EP, like the router and attention) and the sharded optimizers shard them with the non-expert family. Their names
(``shared_experts.gate_proj`` / ``up_proj`` / ``down_proj``, ``shared_expert_gate``) are DeepSeek-V3's in
transformers; the Qwen2-MoE model conversion renames its ``shared_expert`` to them, while a patched Qwen2-MoE block
(:func:`~mula_lightning.moe.block.patch_hf_moe`) keeps transformers' ``shared_expert``, so the patched model's
parameter names (and checkpoints) do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mula_lightning.moe.config import MoEConfig


class SharedExperts(nn.Module):
    """A SwiGLU MLP ``down(silu(gate x) * up x)`` of width ``intermediate_size`` (the shared experts side by side)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def add_shared_experts(block: nn.Module, x_SH: torch.Tensor, out_SH: torch.Tensor) -> torch.Tensor:
    """``out_SH`` plus the shared experts' output on ``x_SH`` (gated where the block has a gate); ``out_SH`` itself
    when the block has no shared experts."""
    shared = getattr(block, "shared_experts", None)
    if shared is None:  # a patched Qwen2-MoE block keeps transformers' name for it
        shared = getattr(block, "shared_expert", None)
    if shared is None:
        return out_SH
    y_SH = shared(x_SH)
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None:
        y_SH = torch.sigmoid(gate(x_SH)) * y_SH
    return out_SH + y_SH.to(out_SH.dtype)


def build_shared_experts(block: nn.Module, config: MoEConfig, device: torch.device | str | None = None) -> None:
    """Give ``block`` the shared experts (and gate) ``config`` asks for: ``shared_experts``, ``shared_expert_gate``."""
    if config.shared_width:
        block.shared_experts = SharedExperts(config.hidden_size, config.shared_width, device=device)
    if config.shared_expert_gate:
        block.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, device=device)
