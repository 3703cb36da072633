"""The MoE router: scores, top-k choice, capacity drops, forced uniform routing and auxiliary losses.

Legend: S = tokens on this rank, H = hidden size, E = experts, K = experts chosen per token.

Two router kinds compute the weights of the K chosen experts:

* ``softmax_topk`` (OLMoE; "ST" in the Llama-3 upcycling paper): ``p = softmax(logits)`` over all E experts,
  then the K largest ``p``; optionally renormalised to sum to one (``norm_topk_prob``).
* ``topk_softmax`` (Mixtral): the K largest logits, then a softmax over those K only. This is the same
  function as ``softmax_topk`` with ``norm_topk_prob=True`` (softmax is monotonic, and renormalising K
  softmax values is a softmax over their logits); the upcycling paper relies on it for exact equivalence.

``softmax_topk`` takes its scores from ``score_function``: a softmax over the experts (above), or each logit's
sigmoid on its own (DeepSeek-V3; the chosen scores are the weights, ``norm_topk_prob`` renormalises them). With
group-limited routing (``n_group > 1``, DeepSeek's) the experts form ``n_group`` contiguous groups, a group's score is
the sum of its two best expert scores, and a token chooses its top-k among the experts of its ``topk_group`` best
groups (the others are masked with -inf, not 0 as transformers' DeepSeek-V3 does: the same choice while scores are
positive, and the stated rule when they are not). ``routed_scaling_factor`` multiplies the chosen weights last. With
sigmoid scores the load-balancing loss takes each token's scores normalised to sum to one as its probabilities.

Auxiliary-loss-free balancing (DeepSeek-V3): a router with ``expert_bias`` holds ``e_score_correction_bias`` (E,),
an fp32 buffer added to the scores to choose the experts (before the group scores) and never to the weights, which
are the unbiased scores at the chosen indices. While training with ``bias_update_rate > 0`` every forward adds its
tokens' choices (before capacity drops: the demand the bias balances) to :attr:`Router.pending_load`, except a
recomputation replaying its forward and any forward inside :func:`paused_load_counting`; once per optimizer step
:func:`~mula_lightning.moe.balancing.update_expert_bias` sums them over the ranks and moves the bias.

Router math runs in fp32 whatever the activation dtype. The auxiliary losses (Switch / OLMoE load balancing, router
z-loss, and where asked DeepSeek-V3's sequence-wise balance loss) are computed here, per layer and per micro-batch,
from the router's own choice (before capacity drops) and returned unweighted; the block weights them by the config's
coefficients.

Sequence parallelism splits a sequence's tokens over ranks, yet the losses are those of the whole sequence
(Megatron's ``sequence_partition_group``): a router given ``sequence_reduce`` (a sum over those ranks, set by tensor
parallelism) sums the expert counts, token counts and statistics of its rank's tokens with the others'
(:func:`sequence_parallel_router_losses`, one all-reduce of ``2E + 2`` values), so every rank reports the
sequence's losses while its backward carries only its own tokens' share: the shares' sum is the sequence's gradient.

Capacity: expert e may take ``ceil(capacity_factor * S * K / E)`` (token, k) pairs; pairs beyond that are
dropped in token order (row-major over ``(S, K)``): their index becomes -1 and their weight 0.

Recomputation (activation checkpointing) must not route differently from the forward it repeats: inside
:func:`routing_replay`, the first run of a forward records every router's decisions (the chosen experts before and
after capacity drops) and a recomputation takes them back in the same order instead of choosing again, so a
near-tie that rounds the other way, or a changed weight, cannot move a token to another expert between the forward
and its backward. The weights of the chosen experts are recomputed from the logits (they carry the gradient).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mula_lightning.moe.balance_scope import scoped_balance_loss
from mula_lightning.moe.config import ROUTER_KINDS, MoEConfig, capacity, check_routing
from mula_lightning.utils.precision import upcast


@dataclass
class RouterOutput:
    """What the router hands to dispatch, and what monitoring reads.

    Attributes:
        logits_SE: raw router logits (fp32).
        weights_SK: weights of the chosen experts (fp32, 0 where dropped).
        indices_SK: chosen expert ids (int64, -1 where dropped by capacity).
        load_balance_loss: unweighted Switch/OLMoE load-balancing loss (scalar).
        z_loss: unweighted router z-loss (scalar).
        tokens_per_expert_E: (token, k) pairs each expert receives after drops (int64, no grad).
        num_dropped: (token, k) pairs dropped by capacity (int64 scalar, no grad).
        expert_bias_E: the router's selection bias (fp32, the buffer itself), None without one.
        seq_balance_loss: unweighted sequence-wise balance loss (DeepSeek-V3), None unless the router computes it.
    """

    logits_SE: torch.Tensor
    weights_SK: torch.Tensor
    indices_SK: torch.Tensor
    load_balance_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    num_dropped: torch.Tensor
    expert_bias_E: torch.Tensor | None = None
    seq_balance_loss: torch.Tensor | None = None


def count_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``indices`` (any shape) name each of the ``num_experts`` experts, as an int64 (E,) tensor
    on their device; entries outside ``[0, num_experts)`` (-1: a pair dropped by capacity) are not counted.

    Why not ``torch.bincount``: it sizes its output by the largest value, which it reads back to the host: a
    synchronisation on CUDA and XPU at every call, several per MoE layer, each stalling the host's kernel queue until
    the device catches up. A scatter-add into a fixed number of buckets (one more for the entries not counted) never
    waits for the device, and integer sums are exact in any order.
    """
    flat = indices.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, bucket, torch.ones_like(bucket))[:num_experts]


def load_balancing_loss(
    probs_SE: torch.Tensor, indices_SK: torch.Tensor, counts_E: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer / OLMoE auxiliary loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the number of (token, k) pairs routed to e divided by S (so ``sum_e f_e = K``, as in OLMoE and
    transformers), ``P_e`` the mean router probability of e. Its minimum, K, is reached by uniform routing.
    ``counts_E``: those numbers of pairs (:func:`count_per_expert` of ``indices_SK``) when the caller has them.
    """
    num_tokens, num_experts = probs_SE.shape
    if counts_E is None:
        counts_E = count_per_expert(indices_SK, num_experts)
    f_E = counts_E.to(probs_SE.dtype) / max(num_tokens, 1)
    p_E = probs_SE.mean(dim=0)
    return num_experts * torch.sum(f_E * p_E)


def sequence_balance_loss(
    probs_SE: torch.Tensor,
    indices_SK: torch.Tensor,
    num_sequences: int,
    sequence_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the ``num_sequences`` sequences the S
    tokens are (each ``S / num_sequences`` consecutive tokens, a sequence's): per sequence ``sum_e f_e P_e`` with
    ``f_e = E / (K T) x`` (the sequence's (token, k) pairs routed to e) and ``P_e`` the mean over its T tokens of e's
    probability (scores normalised to sum to one). Its minimum, 1, is a sequence spread evenly over the experts.

    With ``sequence_reduce`` (sequence parallelism: each rank holds a part of every sequence) the counts, probability
    sums and lengths are summed over the ranks first; as in :func:`sequence_parallel_router_losses`, the value is the
    whole sequences' and the gradient this rank's tokens' share.
    """
    num_tokens, num_experts = probs_SE.shape
    top_k = indices_SK.shape[1]
    if num_sequences < 1 or num_tokens % num_sequences:
        raise ValueError(f"{num_tokens} tokens do not split into {num_sequences} sequences of equal length")
    length = num_tokens // num_sequences
    with torch.no_grad():
        counts_BE = torch.zeros(num_sequences, num_experts, dtype=probs_SE.dtype, device=probs_SE.device)
        pairs = indices_SK.reshape(num_sequences, length * top_k)
        counts_BE.scatter_add_(1, pairs, torch.ones_like(pairs, dtype=probs_SE.dtype))
    prob_sums_BE = probs_SE.reshape(num_sequences, length, num_experts).sum(1)
    total = probs_SE.new_tensor(float(length))
    if sequence_reduce is not None:
        with torch.no_grad():
            packed = sequence_reduce(torch.cat([counts_BE.reshape(-1), prob_sums_BE.detach().reshape(-1), total[None]]))
            size = num_sequences * num_experts
            counts_BE, whole_sums_BE = packed[:size].view_as(counts_BE), packed[size:-1].view_as(counts_BE)
            total = packed[-1]
    f_BE = counts_BE * (num_experts / (top_k * total))
    share = (f_BE * prob_sums_BE / total).sum(-1).mean()
    if sequence_reduce is None:
        return share
    whole = (f_BE * whole_sums_BE / total).sum(-1).mean()
    return share + (whole - share).detach()


def router_z_loss(logits_SE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits_SE, dim=-1).square().mean()


def sequence_parallel_router_losses(
    logits_SE: torch.Tensor,
    probs_SE: torch.Tensor,
    indices_SK: torch.Tensor,
    sequence_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`load_balancing_loss` and :func:`router_z_loss` of a sequence split over ranks, from this rank's part.

    ``sequence_reduce`` sums a tensor over the ranks holding the other parts (no autograd). Each loss is
    ``share + (whole - share).detach()``: its value is the whole sequence's on every rank, its gradient the share of
    this rank's tokens (``f_e`` and the token count are the sequence's, the router probabilities this rank's), so
    the ranks' backwards add up to the whole sequence's gradient.
    """
    num_tokens, num_experts = probs_SE.shape
    lse_sq_S = torch.logsumexp(logits_SE, dim=-1).square()
    with torch.no_grad():
        counts_E = torch.zeros(num_experts, dtype=probs_SE.dtype, device=probs_SE.device)
        counts_E.scatter_add_(0, indices_SK.reshape(-1), torch.ones_like(indices_SK, dtype=probs_SE.dtype).reshape(-1))
        local = torch.cat([counts_E, probs_SE.sum(0), lse_sq_S.sum()[None], counts_E.new_tensor([num_tokens])])
        total = sequence_reduce(local)
        counts_E, prob_sums_E, lse_sq, tokens = total[:num_experts], total[num_experts:-2], total[-2], total[-1]
        f_E = counts_E / tokens.clamp(min=1)
        whole_lb = num_experts * torch.sum(f_E * prob_sums_E) / tokens.clamp(min=1)
        whole_z = lse_sq / tokens.clamp(min=1)
    share_lb = num_experts * torch.sum(f_E * probs_SE.sum(0)) / tokens.clamp(min=1)
    share_z = lse_sq_S.sum() / tokens.clamp(min=1)
    return share_lb + (whole_lb - share_lb).detach(), share_z + (whole_z - share_z).detach()


def uniform_routing_indices(num_tokens: int, num_experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    """Forced uniform routing: token s takes experts ``(s*K + j) mod E`` for ``j < K``.

    Every expert receives ``S*K/E`` pairs (to within one when E does not divide S*K), in the same pattern on
    every step and rank, and no token picks an expert twice as long as K <= E.
    """
    s = torch.arange(num_tokens, device=device).unsqueeze(1)
    j = torch.arange(top_k, device=device).unsqueeze(0)
    return (s * top_k + j) % num_experts


@dataclass
class RoutingReplay:
    """The router decisions of one forward, in call order: recorded by its first run, replayed by recomputations."""

    decisions: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    replaying: bool = False
    position: int = 0
    #: the expert frequencies each router of the forward used at ``"global_batch"`` balance scope (recorded by the
    #: first run: a recomputation neither counts its tokens again nor communicates)
    frequencies: list[torch.Tensor] = field(default_factory=list)
    frequency_position: int = 0

    def take_frequencies(self) -> torch.Tensor:
        if self.frequency_position >= len(self.frequencies):
            raise RuntimeError("a recomputation asked for more balance frequencies than the forward it repeats used")
        self.frequency_position += 1
        return self.frequencies[self.frequency_position - 1]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= len(self.decisions):
            raise RuntimeError(
                f"a recomputation called the routers {self.position + 1} times, the forward it repeats "
                f"{len(self.decisions)} times: the recomputed code is not the code that ran"
            )
        self.position += 1
        return self.decisions[self.position - 1]


_ACTIVE = threading.local()
_COUNTING = threading.local()


@contextmanager
def paused_load_counting() -> Iterator[None]:
    """Forwards inside this context add nothing to the routers' :attr:`Router.pending_load` (a forward that is not
    a training step's: a pipeline schedule's shape inference, a probe)."""
    previous = getattr(_COUNTING, "paused", False)
    _COUNTING.paused = True
    try:
        yield
    finally:
        _COUNTING.paused = previous


@contextmanager
def routing_replay(replay: RoutingReplay) -> Iterator[RoutingReplay]:
    """Run a forward whose routers record into ``replay`` (first run) or take from it (every later run)."""
    previous = getattr(_ACTIVE, "replay", None)
    replay.position = replay.frequency_position = 0
    _ACTIVE.replay = replay
    try:
        yield replay
    finally:
        _ACTIVE.replay = previous
        replay.replaying = True  # whatever runs this forward again replays it


def limit_to_groups(scores_SE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``scores_SE`` with every expert outside each token's ``topk_group`` best groups set to -inf (the experts in
    ``n_group`` contiguous groups; a group's score is the sum of its two best expert scores, its best alone for
    groups of one)."""
    num_tokens, num_experts = scores_SE.shape
    grouped = scores_SE.reshape(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # (S, n_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(num_tokens, num_experts)


def apply_capacity(indices_SK: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Mark (token, k) pairs beyond an expert's capacity with -1, keeping the first ``cap`` in token order."""
    flat = indices_SK.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)  # (S*K, E)
    position = (torch.cumsum(one_hot, dim=0) * one_hot).sum(dim=-1) - 1  # arrival order within the expert
    keep = position < cap
    return torch.where(keep, flat, torch.full_like(flat, -1)).reshape(indices_SK.shape)


class Router(nn.Module):
    """Linear router ``H -> E`` with top-k selection (see the module docstring for the semantics).

    The weight is stored as ``weight`` of shape (E, H), like transformers' ``OlmoeTopKRouter`` /
    ``MixtralTopKRouter`` so checkpoints map one to one.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        router_kind: str = "softmax_topk",
        norm_topk_prob: bool = False,
        capacity_factor: float | None = None,
        forced_uniform_routing: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        score_function: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        expert_bias: bool = False,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if router_kind not in ROUTER_KINDS:
            raise ValueError(f"router_kind ({router_kind!r}) must be one of {ROUTER_KINDS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, num_experts ({num_experts})]")
        check_routing(
            num_experts, top_k, router_kind, score_function, n_group, topk_group, routed_scaling_factor,
            bias_update_rate, expert_bias,
        )  # fmt: skip
        self.score_function = score_function
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.router_kind = router_kind
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.forced_uniform_routing = forced_uniform_routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        with torch.no_grad():  # as nn.Linear draws its weight: a router built alone scores with numbers
            self.weight.uniform_(-(hidden_size**-0.5), hidden_size**-0.5)
        self.bias_update_rate = float(bias_update_rate)
        if expert_bias or self.bias_update_rate > 0:  # fp32 whatever the model's dtype (see ``_apply``)
            bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
            self.register_buffer("e_score_correction_bias", bias)
        #: compute the sequence-wise balance loss (the block weights it by ``seq_aux_loss_coef``)
        self.sequence_aux_loss = False
        #: choices of this rank's training forwards since the last bias update, (E,) float64 (None: none yet)
        self.pending_load: torch.Tensor | None = None
        # a sum over the ranks that hold the other parts of this rank's sequences (sequence parallelism), or None
        self.sequence_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: the tokens the load-balancing loss counts its frequencies over (:mod:`~mula_lightning.moe.balance_scope`)
        self.balance_scope = "micro_batch"
        #: at ``"global_batch"`` scope: the ranks holding the step's other tokens, and this step's counts so far
        self.balance_group: Any = None
        self.balance_window: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: MoEConfig, device: torch.device | str | None = None) -> Router:
        """The router an MoE block of ``config`` routes with."""
        router = cls(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            router_kind=config.router_kind,
            norm_topk_prob=config.norm_topk_prob,
            capacity_factor=config.capacity_factor,
            forced_uniform_routing=config.forced_uniform_routing,
            device=device,
            score_function=config.score_function,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            expert_bias=config.uses_expert_bias,
            bias_update_rate=config.bias_update_rate,
        )
        router.sequence_aux_loss = config.seq_aux_loss_coef > 0
        router.balance_scope = config.balance_scope
        return router

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"kind={self.router_kind}, norm_topk_prob={self.norm_topk_prob}, "
            f"capacity_factor={self.capacity_factor}, forced_uniform={self.forced_uniform_routing}"
            + (f", score_function={self.score_function}" if self.score_function != "softmax" else "")
            + (f", n_group={self.n_group}, topk_group={self.topk_group}" if self.n_group > 1 else "")
            + (f", routed_scaling_factor={self.routed_scaling_factor}" if self.routed_scaling_factor != 1.0 else "")
            + (f", bias_update_rate={self.bias_update_rate}" if self.has_expert_bias else "")
        )

    @property
    def has_expert_bias(self) -> bool:
        return "e_score_correction_bias" in self._buffers

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Router:
        """Module casts (``model.to(torch.bfloat16)``, ``.half()``) move the selection bias but keep it fp32: the
        per-step updates (1e-3 of a score) would round away in bf16."""
        bias = self._buffers.get("e_score_correction_bias")
        super()._apply(fn, recurse)
        if bias is not None:
            moved = self._buffers["e_score_correction_bias"]
            if moved.dtype != torch.float32:  # the values before the cast, where there were values
                source = moved if bias.is_meta or moved.is_meta else bias
                self._buffers["e_score_correction_bias"] = source.to(device=moved.device, dtype=torch.float32)
        return self

    def _choose(self, logits_SE: torch.Tensor, probs_SE: torch.Tensor) -> torch.Tensor:
        """The K experts of each token (the discrete decision a recomputation replays)."""
        if self.forced_uniform_routing:
            return uniform_routing_indices(logits_SE.shape[0], self.num_experts, self.top_k, logits_SE.device)
        scores = probs_SE if self.router_kind == "softmax_topk" else logits_SE
        if self.has_expert_bias:  # selection only: the weights are the unbiased scores
            scores = scores + self.e_score_correction_bias.to(scores.device)
        if self.n_group > 1:
            scores = limit_to_groups(scores, self.n_group, self.topk_group)
        return torch.topk(scores, self.top_k, dim=-1)[1]

    def _count_load(self, chosen_E: torch.Tensor) -> None:
        if getattr(_COUNTING, "paused", False):
            return
        load_E = chosen_E.to(torch.float64)
        self.pending_load = load_E if self.pending_load is None else self.pending_load + load_E

    def forward(self, x_SH: torch.Tensor, num_sequences: int = 1) -> RouterOutput:
        """Route the tokens ``x_SH`` (any leading shape, flattened), ``num_sequences`` sequences of equal length one
        after the other (for the sequence-wise loss)."""
        x_SH = x_SH.reshape(-1, self.hidden_size)
        logits_SE = F.linear(upcast(x_SH), upcast(self.weight))
        # the expert scores (softmax probabilities, or independent sigmoids); the losses' probabilities
        scores_SE = torch.softmax(logits_SE, dim=-1) if self.score_function == "softmax" else logits_SE.sigmoid()
        probs_SE = scores_SE if self.score_function == "softmax" else scores_SE / scores_SE.sum(-1, keepdim=True)
        num_tokens = logits_SE.shape[0]

        replay = getattr(_ACTIVE, "replay", None)
        counting = False
        if replay is not None and replay.replaying:
            indices_SK, final_SK = replay.take()
        else:
            counting = self.bias_update_rate > 0 and self.training and torch.is_grad_enabled()  # a training forward
            with torch.no_grad():  # a discrete choice: saves nothing for backward (nor does its replay)
                indices_SK = self._choose(logits_SE, scores_SE)
            final_SK = None
        with torch.no_grad():  # counted once: the balancing loss's f_e, the bias update's load, the dropless dispatch
            chosen_E = count_per_expert(indices_SK, self.num_experts)
            if counting:
                self._count_load(chosen_E)

        if self.router_kind == "softmax_topk":
            weights_SK = scores_SE.gather(1, indices_SK)
            if self.norm_topk_prob:
                weights_SK = weights_SK / weights_SK.sum(dim=-1, keepdim=True)
        else:
            weights_SK = torch.softmax(logits_SE.gather(1, indices_SK), dim=-1)
        if self.routed_scaling_factor != 1.0:
            weights_SK = weights_SK * self.routed_scaling_factor

        if self.sequence_reduce is not None:
            lb_loss, z_loss = sequence_parallel_router_losses(logits_SE, probs_SE, indices_SK, self.sequence_reduce)
        else:
            if self.balance_scope == "micro_batch":
                lb_loss = load_balancing_loss(probs_SE, indices_SK, chosen_E)
            else:
                training = self.training and torch.is_grad_enabled() and not getattr(_COUNTING, "paused", False)
                lb_loss = scoped_balance_loss(self, probs_SE, chosen_E, indices_SK, num_sequences, replay, training)
            z_loss = router_z_loss(logits_SE)
        seq_loss = None
        if self.sequence_aux_loss:
            seq_loss = sequence_balance_loss(probs_SE, indices_SK, num_sequences, self.sequence_reduce)

        with torch.no_grad():
            if final_SK is None:
                final_SK = indices_SK
                if self.capacity_factor is not None:
                    cap = capacity(self.capacity_factor, num_tokens, self.top_k, self.num_experts)
                    final_SK = apply_capacity(indices_SK, self.num_experts, cap)
                if replay is not None:
                    replay.decisions.append((indices_SK, final_SK))
            if final_SK is indices_SK:  # no capacity: every chosen pair is kept
                tokens_per_expert_E, num_dropped = chosen_E, indices_SK.new_zeros(())
            else:
                tokens_per_expert_E = count_per_expert(final_SK, self.num_experts)  # the kept pairs
                num_dropped = (final_SK < 0).sum()
            indices_SK = final_SK
        if self.capacity_factor is not None:
            weights_SK = weights_SK * (indices_SK >= 0).to(weights_SK.dtype)

        return RouterOutput(
            logits_SE=logits_SE,
            weights_SK=weights_SK,
            indices_SK=indices_SK,
            load_balance_loss=lb_loss,
            z_loss=z_loss,
            tokens_per_expert_E=tokens_per_expert_E,
            num_dropped=num_dropped,
            expert_bias_E=self.e_score_correction_bias if self.has_expert_bias else None,
            seq_balance_loss=seq_loss,
        )
