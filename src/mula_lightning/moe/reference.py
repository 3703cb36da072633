"""The plain, obviously-correct MoE block: route, then loop over experts.

Legend: B = batch, T = sequence, S = B*T tokens, H = hidden, I = expert intermediate size, E = experts,
K = experts per token.

This is the reference every fast path is checked against, and the layout every MoE block in the package
shares (so state dicts move freely between them and match transformers 5.x):

* ``gate.weight``: (E, H) router (see :mod:`mula_lightning.moe.router`);
* ``experts.gate_up_proj``: (E, 2I, H), the gate projection stacked above the up projection;
* ``experts.down_proj``: (E, H, I);
* with shared experts, ``shared_experts.{gate,up,down}_proj`` (a SwiGLU MLP) and ``shared_expert_gate`` (1, H)
  (:mod:`~mula_lightning.moe.shared_experts`).

Expert e computes ``down_e(silu(gate_e x) * up_e x)``; the block output of a token is the sum of its K
experts' outputs weighted by the router weights (dropped pairs contribute zero), plus its shared experts' output.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mula_lightning.moe.config import MoEConfig, as_moe_config
from mula_lightning.moe.router import Router, RouterOutput
from mula_lightning.moe.shared_experts import add_shared_experts, build_shared_experts
from mula_lightning.utils.precision import upcast


@dataclass
class MoEAux:
    """Per-layer, per-micro-batch side outputs of an MoE block.

    Attributes:
        aux_loss: ``aux_loss_coef * load_balance_loss + z_loss_coef * z_loss`` (+ ``seq_aux_loss_coef *
            seq_balance_loss``; in the graph).
        load_balance_loss: unweighted load-balancing loss (in the graph).
        z_loss: unweighted router z-loss (in the graph).
        tokens_per_expert: (E,) routed (token, k) pairs per expert after capacity drops (no grad).
        num_dropped: pairs dropped by capacity (no grad).
        expert_bias: (E,) the router's selection bias (auxiliary-loss-free balancing), None without one.
        seq_balance_loss: unweighted sequence-wise balance loss (in the graph), None when not computed.
    """

    aux_loss: torch.Tensor
    load_balance_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_dropped: torch.Tensor
    expert_bias: torch.Tensor | None = None
    seq_balance_loss: torch.Tensor | None = None

    @classmethod
    def from_router(
        cls, out: RouterOutput, aux_loss_coef: float, z_loss_coef: float, seq_aux_loss_coef: float = 0.0
    ) -> MoEAux:
        aux_loss = aux_loss_coef * out.load_balance_loss + z_loss_coef * out.z_loss
        if out.seq_balance_loss is not None:
            aux_loss = aux_loss + seq_aux_loss_coef * out.seq_balance_loss
        return cls(
            aux_loss=aux_loss,
            load_balance_loss=out.load_balance_loss,
            z_loss=out.z_loss,
            tokens_per_expert=out.tokens_per_expert_E,
            num_dropped=out.num_dropped,
            expert_bias=out.expert_bias_E,
            seq_balance_loss=out.seq_balance_loss,
        )

    def detach(self) -> MoEAux:
        """The same statistics out of the graph (for logging after the step, without keeping the graph alive)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return MoEAux(**{k: v.detach() if v is not None else None for k, v in values.items()})


class ExpertWeights(nn.Module):
    """The fused SwiGLU weights of E experts (no forward: the blocks decide how to compute)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw each expert's matrices as ``nn.Linear`` draws its weight (uniform within 1/sqrt(fan_in)), so that a
        block built alone computes on numbers, not on whatever memory ``torch.empty`` returned; a Mula model's
        :func:`~mula_lightning.models.init_weights` redraws them from (seed, name). Nothing is drawn on the meta
        device."""
        self.gate_up_proj.uniform_(-(self.hidden_size**-0.5), self.hidden_size**-0.5)
        self.down_proj.uniform_(-(self.intermediate_size**-0.5), self.intermediate_size**-0.5)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"

    def expert_forward(self, e: int, x_NH: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (local index) on ``N`` tokens: ``down(silu(gate x) * up x)``."""
        gate_NI, up_NI = F.linear(x_NH, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate_NI) * up_NI, self.down_proj[e])


class ReferenceMoEBlock(nn.Module):
    """Router + a Python loop over experts. Slow, simple, the ground truth."""

    def __init__(self, config: MoEConfig | Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        config = as_moe_config(config)  # an MoEConfig, or a model config's .moe
        self.config = config
        self.gate = Router.from_config(config, device=device)
        self.experts = ExpertWeights(config.num_experts, config.hidden_size, config.intermediate_size, device=device)
        build_shared_experts(self, config, device)

    def forward_with_aux(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        shape = x_BTH.shape
        x_SH = x_BTH.reshape(-1, shape[-1])
        routed = self.gate(x_SH, x_BTH.shape[0] if x_BTH.dim() == 3 else 1)
        out_SH = torch.zeros_like(x_SH)
        for e in range(self.experts.num_experts):
            token_idx, k_idx = torch.where(routed.indices_SK == e)
            if token_idx.numel() == 0:
                continue
            y_NH = self.experts.expert_forward(e, x_SH[token_idx])
            w_N1 = routed.weights_SK[token_idx, k_idx].unsqueeze(-1)
            out_SH = out_SH.index_add(0, token_idx, (upcast(y_NH) * w_N1).to(x_SH.dtype))
        out_SH = add_shared_experts(self, x_SH, out_SH)
        c = self.config
        aux = MoEAux.from_router(routed, c.aux_loss_coef, c.z_loss_coef, c.seq_aux_loss_coef)
        return out_SH.reshape(shape), aux

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.forward_with_aux(x_BTH)[0]
