"""Where tokens travel between the router and the experts: the ``TokenDispatcher`` interface and its local form.

Legend: S = tokens of this rank, K = experts per token, E = experts of the layer, H = hidden size,
SL = tokens the local experts see (S on one device, EP*S after an all-gather, received pairs after an all-to-all),
RT = routed rows of the local experts.

:class:`~mula_lightning.moe.block.FastSparseMoEBlock` has one forward, the same on one device and under expert
parallelism (torchtitan's MoE and OLMo-core's ``apply_ep`` have the same shape)::

    routed = route(x_SH)                               # stage 1, always on the source rank
    tokens = dispatcher.dispatch(x_SH, routed)         # move tokens to their experts; stages 2-3 (the plan)
    y_RH   = experts(tokens.x_SH, tokens.plan)         # stage 4, the local experts only
    out_SH = dispatcher.combine(y_RH, tokens, reuse)   # stage 5 and the way back to the source rank

A dispatcher owns the *transport* and the *expert range* of this rank; it holds no parameters. Expert
parallelism (:func:`mula_lightning.parallel.apply_expert_parallel`) cuts the expert tensors and swaps the block's
:class:`LocalDispatcher` for a communicating one (``AllGatherDispatcher``, ``AllToAllDispatcher`` in
:mod:`mula_lightning.parallel.token_dispatchers`, next to the collectives they use), in place. A new transport
(DeepEP-style, tensor-parallel experts) is one more subclass of :class:`TokenDispatcher`, not another block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.dispatch import DispatchPlan, build_dispatch_plan
from mula_lightning.moe.router import RouterOutput

__all__ = ["DispatchedTokens", "LocalDispatcher", "TokenDispatcher"]


@dataclass
class DispatchedTokens:
    """What :meth:`TokenDispatcher.dispatch` hands to the local experts and, afterwards, to its own ``combine``.

    Attributes:
        x_SH: (SL, H) tokens the local experts read (rows of ``plan``'s token index space).
        plan: the dispatch plan of the local experts over those SL tokens.
        weights_SK: the router weights its ``combine`` applies: aligned with ``x_SH`` and indexed by the plan's slots
            when ``weights_on_rows``; otherwise the source tokens' (the transport weights on the way back); None when
            the rows arrive weighted already (the experts applied them).
        state: whatever else the transport needs to bring the outputs home (split sizes, pair order, ...).
        weights_on_rows: ``weights_SK`` follows the plan's slots, so the experts may apply it to their rows.
    """

    x_SH: torch.Tensor
    plan: DispatchPlan
    weights_SK: torch.Tensor | None = None
    state: Any = None
    weights_on_rows: bool = True


class TokenDispatcher:
    """The transport between the router and the local experts of one MoE block (see the module docstring).

    Args:
        num_experts: E, the experts of the layer (global ids ``0 .. E-1``).
        n_start: first expert held by this rank (global id).
        n_end: last expert held by this rank (global id, inclusive, as in Algorithm 1).

    Subclasses implement :meth:`dispatch` and :meth:`combine`; both run on every rank of the dispatcher's group
    for every forward (a rank whose experts get no token must still take part in the collectives).
    """

    #: the name ``apply_expert_parallel(dispatcher=...)`` and the strategies use for this transport
    name: str = ""

    def __init__(self, num_experts: int, n_start: int = 0, n_end: int | None = None) -> None:
        n_end = num_experts - 1 if n_end is None else n_end
        if not 0 <= n_start <= n_end < num_experts:
            raise ValueError(
                f"local experts [n_start={n_start}, n_end={n_end}] must lie in [0, num_experts={num_experts})"
            )
        self.num_experts = num_experts
        self.n_start, self.n_end = n_start, n_end

    @property
    def num_local_experts(self) -> int:
        return self.n_end - self.n_start + 1

    @property
    def holds_all_experts(self) -> bool:
        return self.n_start == 0 and self.n_end == self.num_experts - 1

    def dispatch(self, x_SH: torch.Tensor, routed: RouterOutput, dropless: bool = False) -> DispatchedTokens:
        """Move this rank's tokens to the ranks of their experts and build the plan of the local experts.

        Args:
            x_SH: (S, H) this rank's tokens.
            routed: the router's output for them (weights and indices (S, K); index -1 = dropped by capacity).
            dropless: the router drops no pair (lets a dispatcher that holds every expert skip a count).
        """
        raise NotImplementedError

    def combine(
        self, y_RH: torch.Tensor, tokens: DispatchedTokens, reuse_dead_activations: bool = False,
        backend: str = "grouped_mm",
    ) -> torch.Tensor:  # fmt: skip
        """Weight and sum the local experts' outputs (RT, H) and bring them back: (S, H) for this rank's tokens.

        ``backend`` (a keyword, passed only when the experts run in the Triton kernels: ``"triton"``) lets a dispatcher
        combine with those kernels too; a dispatcher written without the argument keeps working with the others."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.name}, experts [{self.n_start}, {self.n_end}] of {self.num_experts}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class LocalDispatcher(TokenDispatcher):
    """Every expert on this device: no communication (Algorithm 1's all-gather and reduce-scatter are identities).

    Stages 2-3 build the plan of all E experts on the S tokens; Stage 5 is the fp32 weighted combine. Sends
    nothing; memory is the plan (a few int64 vectors of length S*K).
    """

    name = "local"

    def dispatch(self, x_SH: torch.Tensor, routed: RouterOutput, dropless: bool = False) -> DispatchedTokens:
        all_routed = True if dropless and self.holds_all_experts else None
        # the router counted the kept pairs of every expert: over the whole range those are the plan's counts
        counts = routed.tokens_per_expert_E if self.holds_all_experts else None
        plan = build_dispatch_plan(
            routed.indices_SK, self.num_experts, self.n_start, self.n_end, all_routed, token_counts=counts
        )
        return DispatchedTokens(x_SH=x_SH, plan=plan, weights_SK=routed.weights_SK)

    def combine(
        self, y_RH: torch.Tensor, tokens: DispatchedTokens, reuse_dead_activations: bool = False,
        backend: str = "grouped_mm",
    ) -> torch.Tensor:  # fmt: skip
        return combine_expert_outputs(y_RH, tokens.weights_SK, tokens.plan, reuse_dead_activations, backend)
