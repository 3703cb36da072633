"""Expert parallelism for FastSparseMoE: all-gather dispatch (Algorithm 1) or all-to-all dispatch.

Legend: S = tokens of this rank, K = experts per token, E = experts of the layer, EP = expert-parallel ranks,
NR = E / EP local experts, H = hidden size, P = (token, k) pairs this rank sends, R = pairs it receives.

EP rank r owns experts ``[r*E/EP, (r+1)*E/EP)`` (dim 0 of the fused expert tensors). The router and every
non-expert parameter are replicated. Routing always happens on the source rank, on its own tokens (capacity
drops and auxiliary losses are therefore per source rank, as in the single-device block).

``dispatcher="allgather"`` (the Aurora paper, lines 11-13 and 116): all-gather the input (S, H), the router
weights (S, K) and indices (S, K) over the EP group; run stages 2-5 for the local experts on all EP*S tokens;
reduce-scatter the (EP*S, H) partial outputs back to their source ranks. Backward: reduce-scatter of the input
and weight gradients, all-gather of the output gradient. Per rank and layer this sends
``(EP-1)*S*(H*b + 4K + 8K)`` bytes forward for the gathers plus ``(EP-1)*S*H*b`` for the reduce-scatter
(b = activation bytes), and the same volume backward without the indices. Needs the same S on every EP rank.

``dispatcher="alltoall"`` (torchtitan, Megatron): each (token, k) pair is sent only to the rank owning its
expert; the expert outputs come back by the reverse all-to-all and are weighted and summed on the source rank,
in fixed (token, k) order. It sends ``H*b`` bytes per remote pair each way (plus the pair's expert id forward),
so it moves less than the all-gather when K < EP; token counts may differ between ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.dispatch import build_dispatch_plan
from mula_lightning.moe.reference import MoEAux
from mula_lightning.moe.router import RouterOutput
from mula_lightning.parallel.collectives import (
    all_gather_into_tensor,
    all_to_all_single,
    exchange_split_sizes,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
)
from mula_lightning.parallel.params import is_expert_param
from mula_lightning.parallel.topology import check_divisible
from mula_lightning.utils.precision import at_least_float32, upcast

DISPATCHERS = ("allgather", "alltoall")


class ExpertParallelMoEBlock(FastSparseMoEBlock):
    """A :class:`FastSparseMoEBlock` whose experts are split over an EP group (see the module docstring).

    Built by :func:`apply_expert_parallel` from an existing block: it takes over that block's router and expert
    modules (the same parameter objects, expert tensors cut to the local slice), so optimizers and state-dict
    keys stay valid.

    Args:
        block: the single-device block to split.
        ep_group: the expert-parallel process group.
        dispatcher: ``"allgather"`` or ``"alltoall"``.
        check_token_counts: with the all-gather dispatcher, compare every rank's token count first (one tiny
            all-gather per layer) and raise a clear error instead of a hang or garbage.
    """

    def __init__(
        self, block: FastSparseMoEBlock, ep_group: Any, dispatcher: str = "allgather", check_token_counts: bool = True
    ) -> None:
        nn.Module.__init__(self)  # no new parameters: the block's own modules are adopted below
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher ({dispatcher!r}) must be one of {DISPATCHERS}")
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        check_divisible(block.num_experts, self.ep_size, "num_experts", "ep_size")
        self.config = block.config
        self.num_experts = block.num_experts
        self.top_k = block.top_k
        self.jitter_noise = block.jitter_noise
        self.dispatcher = dispatcher
        self.check_token_counts = check_token_counts
        per = self.num_experts // self.ep_size
        self.n_start, self.n_end = self.ep_rank * per, (self.ep_rank + 1) * per - 1
        self.gate = block.gate
        self.experts = block.experts
        if self.experts.gate_up_proj.shape[0] == self.num_experts:  # still full: keep only the local slice
            for p in (self.experts.gate_up_proj, self.experts.down_proj):
                p.data = p.data[self.n_start : self.n_end + 1].clone()
        self.experts.num_experts = per

    def extra_repr(self) -> str:
        return (
            f"experts [{self.n_start}, {self.n_end}] of {self.num_experts}, ep_rank={self.ep_rank}/{self.ep_size}, "
            f"dispatcher={self.dispatcher}"
        )

    def forward_with_aux(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        shape = x_BTH.shape
        if self.training and self.jitter_noise > 0:
            x_BTH = x_BTH * torch.empty_like(x_BTH).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x_SH = x_BTH.reshape(-1, shape[-1])
        routed = self.route(x_SH)
        if self.dispatcher == "allgather":
            out_SH = self._allgather_dispatch(x_SH, routed)
        else:
            out_SH = self._alltoall_dispatch(x_SH, routed)
        aux = MoEAux.from_router(routed, self.config.aux_loss_coef, self.config.z_loss_coef)
        return out_SH.to(x_BTH.dtype).reshape(shape), aux

    def _run_local_experts(self, x_SH: torch.Tensor, indices_SK: torch.Tensor):
        """Stages 2-4 for this rank's experts on the tokens it holds (gathered or received)."""
        plan = build_dispatch_plan(indices_SK, self.num_experts, self.n_start, self.n_end)
        # With no token for this rank's experts the experts still return a (0, H) result that depends on x_SH, so
        # backward reaches the dispatch collectives: every EP rank must run them, or the others would wait forever.
        return self.experts(x_SH, plan), plan

    def _allgather_dispatch(self, x_SH: torch.Tensor, routed: RouterOutput) -> torch.Tensor:
        group = self.ep_group
        if self.check_token_counts:
            counts = all_gather_into_tensor(
                torch.tensor([x_SH.shape[0]], device=x_SH.device), group, level="ep", tag="moe.token_count"
            ).tolist()
            if len(set(counts)) > 1:
                raise ValueError(
                    f"the all-gather MoE dispatcher needs the same number of tokens on every EP rank, got {counts} "
                    "(feed equal micro-batch shapes, or use dispatcher='alltoall')"
                )
        x_all = forward_allgather_backward_reducescatter(x_SH, group, level="ep", tag="moe.dispatch.x")
        w_all = forward_allgather_backward_reducescatter(routed.weights_SK, group, level="ep", tag="moe.dispatch.w")
        idx_all = forward_allgather(routed.indices_SK, group, level="ep", tag="moe.dispatch.idx")
        y_RH, plan = self._run_local_experts(x_all, idx_all)
        partial = combine_expert_outputs(y_RH, w_all, plan, self.reuse_dead_activations)  # (EP*S, H): local experts
        return forward_reducescatter_backward_allgather(partial, group, level="ep", tag="moe.combine")

    def _alltoall_dispatch(self, x_SH: torch.Tensor, routed: RouterOutput) -> torch.Tensor:
        group, ep = self.ep_group, self.ep_size
        num_tokens, top_k = routed.indices_SK.shape
        per = self.num_experts // ep
        idx = routed.indices_SK.reshape(-1)
        dest = torch.where(idx >= 0, torch.div(idx, per, rounding_mode="floor"), torch.full_like(idx, ep))
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination, token order inside
        send_counts = torch.bincount(dest, minlength=ep + 1)[:ep]
        input_splits = send_counts.tolist()
        pairs = order[: sum(input_splits)]  # drop the pairs removed by capacity (dest == EP, sorted last)
        token_of_pair = torch.div(pairs, top_k, rounding_mode="floor")
        output_splits = exchange_split_sizes(input_splits, group, level="ep", tag="moe.a2a.counts")
        x_recv = all_to_all_single(
            x_SH.index_select(0, token_of_pair), output_splits, input_splits, group, level="ep", tag="moe.a2a.x"
        )
        with torch.no_grad():
            e_recv = all_to_all_single(
                idx.index_select(0, pairs), output_splits, input_splits, group, level="ep", tag="moe.a2a.idx"
            )
        y_RH, plan = self._run_local_experts(x_recv, e_recv.unsqueeze(1))  # each received pair is one "token"
        y_recv = y_RH.index_select(0, plan.slot_row_SK.reshape(-1))  # back to received order
        y_back = all_to_all_single(y_recv, input_splits, output_splits, group, level="ep", tag="moe.a2a.y")
        w_pair = routed.weights_SK.reshape(-1).index_select(0, pairs)
        acc = torch.zeros(num_tokens * top_k, x_SH.shape[-1], dtype=at_least_float32(x_SH.dtype), device=x_SH.device)
        acc = acc.index_copy(0, pairs, upcast(y_back) * upcast(w_pair).unsqueeze(-1))  # each slot written once
        return acc.view(num_tokens, top_k, -1).sum(dim=1).to(x_SH.dtype)  # fixed k order: deterministic


def apply_expert_parallel(model: nn.Module, ep_group: Any, dispatcher: str = "allgather") -> nn.Module:
    """Make every MoE block of ``model`` expert parallel over ``ep_group``, in place; returns ``model``.

    Each block keeps only this rank's experts ``[r*E/EP, (r+1)*E/EP)`` (its expert parameters are cut to that
    slice; parameter objects and state-dict keys are unchanged). Works on the meta device too.

    Raises:
        ValueError: when ``ep_size`` does not divide ``num_experts``, or a block is not a FastSparseMoEBlock.
    """
    from mula_lightning.moe.reference import ReferenceMoEBlock

    for name, module in list(model.named_modules()):
        if isinstance(module, ExpertParallelMoEBlock):
            continue
        if isinstance(module, ReferenceMoEBlock):
            raise ValueError(
                f"{name}: expert parallelism needs FastSparseMoEBlock (moe_impl='fast'), not ReferenceMoEBlock"
            )
        if isinstance(module, FastSparseMoEBlock):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ExpertParallelMoEBlock(module, ep_group, dispatcher))
    return model


def gather_expert_parallel_state_dict(model: nn.Module, ep_group: Any) -> dict[str, torch.Tensor]:
    """The full (single-device) state dict of an expert-parallel model, on every rank of ``ep_group``.

    Expert tensors are all-gathered along dim 0 over the group (in EP-rank order, i.e. expert order); the
    others are returned as they are. The inverse of :func:`apply_expert_parallel` for saving full weights.
    """
    out = {}
    for name, tensor in model.state_dict().items():
        if is_expert_param(name) and dist.get_world_size(ep_group) > 1:
            out[name] = all_gather_into_tensor(tensor.contiguous(), ep_group, level="ep", tag="ep.gather_state")
        else:
            out[name] = tensor
    return out
