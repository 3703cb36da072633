"""Expert-parallel token dispatchers for FastSparseMoE: all-gather (Algorithm 1) and variable-size all-to-all.

Legend: S = tokens of this rank, K = experts per token, E = experts of the layer, EP = expert-parallel ranks,
NR = E / EP local experts, H = hidden size, P = (token, k) pairs this rank sends, R = pairs it receives.

Both implement :class:`~mula_lightning.moe.token_dispatcher.TokenDispatcher`; the block's forward is the same with
either (route -> dispatch -> local experts -> combine). EP rank r owns experts ``[r*E/EP, (r+1)*E/EP)`` (dim 0 of
the fused expert tensors). The router and every non-expert parameter are replicated. Routing always happens on the
source rank, on its own tokens (capacity drops and auxiliary losses are therefore per source rank, as in the
single-device block).

``AllGatherDispatcher`` (the Aurora paper, lines 11-13 and 116): all-gather the input (S, H), the router
weights (S, K) and indices (S, K) over the EP group; run stages 2-5 for the local experts on all EP*S tokens;
reduce-scatter the (EP*S, H) partial outputs back to their source ranks. With expert tensor parallelism (Megatron's
ETP) the group is the EP x ETP ranks and each computes its part of its experts' intermediate dimension: the same
reduce-scatter also sums those partial down projections (one transport, ETP times the tokens per rank). Backward:
reduce-scatter of the input and weight gradients, all-gather of the output gradient. Per rank and layer this sends
``(EP-1)*S*(H*b + 4K + 8K)`` bytes forward for the gathers plus ``(EP-1)*S*H*b`` for the reduce-scatter
(b = activation bytes), and the same volume backward without the indices. Needs the same S on every EP rank.

Host reads (on an accelerator each drains the kernel queue): one per layer and dispatch for either transport. The
all-gather dispatcher's count exchange carries, besides each rank's S (checked equal), how many of its pairs go to
each EP rank's experts (``8 * (1 + EP)`` bytes per rank), so the routed-row count of the dispatch plan needs no read
of its own; the all-to-all one reads its send and receive split sizes together after exchanging them on the device.

``AllToAllDispatcher`` (torchtitan, Megatron): each (token, k) pair is sent only to the rank owning its
expert; the expert outputs come back by the reverse all-to-all and are weighted and summed on the source rank,
in fixed (token, k) order. It sends ``H*b`` bytes per remote pair each way (plus the pair's expert id forward),
so it moves less than the all-gather when K < EP; token counts may differ between ranks.

| per rank, per layer  | all-gather                         | all-to-all                         |
|----------------------|------------------------------------|------------------------------------|
| tokens the experts see | EP*S (every rank's)              | R received pairs                   |
| forward bytes        | (EP-1)*S*(2*H*b + 12K)             | P_remote*(H*b + 8) + R_remote*H*b  |
| working memory       | (EP*S, H) gathered + partial out   | (P, H) send + (R, H) receive       |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.dispatch import build_dispatch_plan
from mula_lightning.moe.router import RouterOutput, count_per_expert
from mula_lightning.moe.token_dispatcher import DispatchedTokens, TokenDispatcher
from mula_lightning.parallel.collectives import (
    all_gather_into_tensor,
    all_to_all_single,
    exchange_split_counts,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
)
from mula_lightning.parallel.topology import check_divisible
from mula_lightning.utils.precision import at_least_float32, upcast

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "ExpertParallelDispatcher", "make_dispatcher"]


class ExpertParallelDispatcher(TokenDispatcher):
    """A dispatcher over an expert process group: this rank holds experts ``[r*E/EP, (r+1)*E/EP)``.

    With expert tensor parallelism (``etp_size > 1``) the group holds ``EP x ETP`` ranks, ``etp_size`` consecutive
    ones sharing an expert slice (each with ``1/ETP`` of every expert's intermediate dimension): group rank
    ``g = r * ETP + t`` holds experts of EP rank ``r``, intermediate part ``t``.

    Args:
        num_experts: E.
        ep_group: the process group of the ranks that split the experts (EP x ETP of them).
        etp_size: the expert-tensor-parallel degree (divides the group's size).
    """

    def __init__(self, num_experts: int, ep_group: Any, etp_size: int = 1) -> None:
        group_size, group_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        check_divisible(group_size, etp_size, "the expert group's size", "etp_size")
        ep_size, ep_rank = group_size // etp_size, group_rank // etp_size
        check_divisible(num_experts, ep_size, "num_experts", "ep_size")
        per = num_experts // ep_size
        super().__init__(num_experts, ep_rank * per, (ep_rank + 1) * per - 1)
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.etp_size, self.etp_rank = etp_size, group_rank % etp_size

    def local_plan(self, indices_SK: torch.Tensor, all_routed: bool | None = None, num_rows: int | None = None):
        """Stages 2-3 for this rank's experts on the tokens it holds (gathered or received); ``all_routed`` and
        ``num_rows`` as for :func:`~mula_lightning.moe.dispatch.build_dispatch_plan` (what the caller knows)."""
        return build_dispatch_plan(
            indices_SK, self.num_experts, self.n_start, self.n_end, all_routed=all_routed, num_rows=num_rows
        )

    def pairs_per_ep_rank(self, indices_SK: torch.Tensor) -> torch.Tensor:
        """(EP,) int64 on the device: how many of these (token, k) pairs go to each EP rank's experts (pairs dropped
        by capacity, index -1, go nowhere)."""
        dest = torch.div(indices_SK, self.num_local_experts, rounding_mode="floor")  # -1 stays negative
        return count_per_expert(dest, self.ep_size)

    def extra_repr(self) -> str:
        etp = f", etp_rank={self.etp_rank}/{self.etp_size}" if self.etp_size > 1 else ""
        return f"{super().extra_repr()}, ep_rank={self.ep_rank}/{self.ep_size}{etp}"


class AllGatherDispatcher(ExpertParallelDispatcher):
    """Algorithm 1's transport: all-gather tokens, weights and indices; reduce-scatter the partial outputs.

    Args:
        num_experts: E.
        ep_group: the expert-parallel process group.
        check_token_counts: compare every rank's token count first (one tiny all-gather per layer, which also
            carries the pair counts that size this rank's dispatch plan) and raise a clear error instead of a hang
            or garbage when they differ. Without it the plan reads its routed-row count back itself.
    """

    name = "allgather"

    def __init__(self, num_experts: int, ep_group: Any, etp_size: int = 1, check_token_counts: bool = True) -> None:
        super().__init__(num_experts, ep_group, etp_size)
        self.check_token_counts = check_token_counts

    def dispatch(self, x_SH: torch.Tensor, routed: RouterOutput, dropless: bool = False) -> DispatchedTokens:
        group = self.ep_group
        num_rows = None
        if self.check_token_counts:
            # every rank's S and its pairs per EP rank: the one host read of the layer's dispatch
            mine = torch.cat(
                [torch.tensor([x_SH.shape[0]], device=x_SH.device), self.pairs_per_ep_rank(routed.indices_SK)]
            )
            table = (
                all_gather_into_tensor(mine, group, level="ep", tag="moe.token_count").view(-1, mine.numel()).tolist()
            )
            counts = [row[0] for row in table]
            if len(set(counts)) > 1:
                raise ValueError(
                    f"the all-gather MoE dispatcher needs the same number of tokens on every EP rank, got {counts} "
                    "(feed equal micro-batch shapes, or use dispatcher='alltoall')"
                )
            num_rows = sum(row[1 + self.ep_rank] for row in table)  # pairs of every rank for this rank's experts
        x_all = forward_allgather_backward_reducescatter(x_SH, group, level="ep", tag="moe.dispatch.x")
        w_all = forward_allgather_backward_reducescatter(routed.weights_SK, group, level="ep", tag="moe.dispatch.w")
        idx_all = forward_allgather(routed.indices_SK, group, level="ep", tag="moe.dispatch.idx")
        # With no token for this rank's experts the experts still return a (0, H) result that depends on x_all, so
        # backward reaches the dispatch collectives: every EP rank must run them, or the others would wait forever.
        return DispatchedTokens(x_SH=x_all, plan=self.local_plan(idx_all, num_rows=num_rows), weights_SK=w_all)

    def combine(
        self, y_RH: torch.Tensor, tokens: DispatchedTokens, reuse_dead_activations: bool = False,
        backend: str = "grouped_mm",
    ) -> torch.Tensor:  # fmt: skip
        partial = combine_expert_outputs(y_RH, tokens.weights_SK, tokens.plan, reuse_dead_activations, backend)
        return forward_reducescatter_backward_allgather(partial, self.ep_group, level="ep", tag="moe.combine")


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Variable-size all-to-all: each (token, k) pair travels to its expert's rank and its output comes back."""

    name = "alltoall"

    def __init__(self, num_experts: int, ep_group: Any, etp_size: int = 1) -> None:
        if etp_size > 1:
            raise ValueError(
                f"dispatcher='alltoall' with etp_size ({etp_size}) > 1 is not supported: each pair would go to every "
                "expert-tensor-parallel rank of its expert; use dispatcher='allgather'"
            )
        super().__init__(num_experts, ep_group)

    def dispatch(self, x_SH: torch.Tensor, routed: RouterOutput, dropless: bool = False) -> DispatchedTokens:
        group, ep = self.ep_group, self.ep_size
        top_k = routed.indices_SK.shape[1]
        per = self.num_local_experts
        idx = routed.indices_SK.reshape(-1)
        dest = torch.where(idx >= 0, torch.div(idx, per, rounding_mode="floor"), torch.full_like(idx, ep))
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination, token order inside
        # send and receive sizes, exchanged on the device and read back together: the one host read of the dispatch
        input_splits, output_splits = exchange_split_counts(
            count_per_expert(dest, ep), group, level="ep", tag="moe.a2a.counts"
        )
        pairs = order[: sum(input_splits)]  # drop the pairs removed by capacity (dest == EP, sorted last)
        token_of_pair = torch.div(pairs, top_k, rounding_mode="floor")
        x_recv = all_to_all_single(
            x_SH.index_select(0, token_of_pair), output_splits, input_splits, group, level="ep", tag="moe.a2a.x"
        )
        with torch.no_grad():
            e_recv = all_to_all_single(
                idx.index_select(0, pairs), output_splits, input_splits, group, level="ep", tag="moe.a2a.idx"
            )
        # each received pair is one "token" with K = 1, and every one is for this rank's experts
        plan = self.local_plan(e_recv.unsqueeze(1), all_routed=True)
        state = (pairs, input_splits, output_splits, x_SH.shape[0], top_k, x_SH.dtype)
        return DispatchedTokens(
            x_SH=x_recv, plan=plan, weights_SK=routed.weights_SK, state=state, weights_on_rows=False
        )

    def combine(
        self, y_RH: torch.Tensor, tokens: DispatchedTokens, reuse_dead_activations: bool = False,
        backend: str = "grouped_mm",
    ) -> torch.Tensor:  # fmt: skip
        """The outputs travel back pair by pair and are summed on the token's rank (whatever ``backend``)."""
        pairs, input_splits, output_splits, num_tokens, top_k, x_dtype = tokens.state
        y_recv = y_RH.index_select(0, tokens.plan.slot_row_SK.reshape(-1))  # back to received order
        y_back = all_to_all_single(y_recv, input_splits, output_splits, self.ep_group, level="ep", tag="moe.a2a.y")
        w_pair = tokens.weights_SK.reshape(-1).index_select(0, pairs)
        hidden = y_RH.shape[-1]
        acc = torch.zeros(num_tokens * top_k, hidden, dtype=at_least_float32(x_dtype), device=y_RH.device)
        acc = acc.index_copy(0, pairs, upcast(y_back) * upcast(w_pair).unsqueeze(-1))  # each slot written once
        return acc.view(num_tokens, top_k, hidden).sum(dim=1).to(x_dtype)  # fixed k order: deterministic


#: transport name -> dispatcher class, for ``apply_expert_parallel(dispatcher=...)`` and the strategies
DISPATCHERS: dict[str, type[ExpertParallelDispatcher]] = {
    AllGatherDispatcher.name: AllGatherDispatcher,
    AllToAllDispatcher.name: AllToAllDispatcher,
}


def make_dispatcher(name: str, num_experts: int, ep_group: Any, etp_size: int = 1) -> ExpertParallelDispatcher:
    """The dispatcher called ``name`` (``"allgather"`` or ``"alltoall"``) for ``num_experts`` over ``ep_group``
    (``etp_size`` consecutive ranks of it sharing each expert slice)."""
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher ({name!r}) must be one of {tuple(DISPATCHERS)}")
    return DISPATCHERS[name](num_experts, ep_group, etp_size)
