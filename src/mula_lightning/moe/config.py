"""``MoEConfig``: what an MoE layer needs to know, and nothing about the model around it.

A leaf: it imports nothing from the package, so ``moe/`` depends on no model code. The model config
(:class:`~mula_lightning.models.config.MulaConfig`) hands its MoE part over as ``config.moe``; a transformers block
converted by :meth:`~mula_lightning.moe.block.FastSparseMoEBlock.from_hf` builds one directly, with no made-up model
(vocabulary, layers, heads) around it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "EXPERTS_BACKENDS",
    "ROUTER_KINDS",
    "SCORE_FUNCTIONS",
    "MoEConfig",
    "ExpertsBackend",
    "RouterKind",
    "ScoreFunction",
    "as_moe_config",
    "capacity",
    "check_shared_experts",
]

RouterKind = Literal["softmax_topk", "topk_softmax"]
ROUTER_KINDS = ("softmax_topk", "topk_softmax")
ScoreFunction = Literal["softmax", "sigmoid"]
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ExpertsBackend = Literal["auto", "grouped_mm", "triton"]
EXPERTS_BACKENDS = ("auto", "grouped_mm", "triton")
#: the tokens the load-balancing loss counts expert frequencies over (:mod:`~mula_lightning.moe.balance_scope`)
BALANCE_SCOPES = ("micro_batch", "sequence", "global_batch")


def capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens one expert may take: ``ceil(capacity_factor * S * K / E)`` for S source tokens."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one sparse MoE layer.

    Args:
        hidden_size: token width H (the layer's input and output).
        intermediate_size: SwiGLU width of one expert.
        num_experts: experts of the layer (E >= 1).
        top_k: experts chosen per token (1 <= K <= E).
        router_kind: ``"softmax_topk"`` (OLMoE, "ST": softmax over all experts, then top-k) or ``"topk_softmax"``
            (Mixtral: top-k logits, then softmax over those k).
        norm_topk_prob: renormalise the k chosen probabilities to sum to one (``softmax_topk`` only).
        capacity_factor: tokens an expert may take, as a multiple of its fair share ``S * K / E``; ``None`` is
            dropless.
        aux_loss_coef: weight of the Switch / OLMoE load-balancing loss.
        z_loss_coef: weight of the router z-loss.
        balance_scope: the tokens the load-balancing loss counts expert frequencies over: ``"micro_batch"`` (this
            rank's micro-batch), ``"sequence"`` (each sequence alone, averaged) or ``"global_batch"`` (every rank's
            tokens of the step's micro-batches so far, Qwen's global-batch balancing;
            :mod:`~mula_lightning.moe.balance_scope`).
        seq_aux_loss_coef: weight of DeepSeek-V3's sequence-wise balance loss (per sequence ``sum_e f_e P_e``,
            averaged over the sequences; :func:`~mula_lightning.moe.router.sequence_balance_loss`); 0 skips it.
        forced_uniform_routing: route tokens to experts in a fixed uniform pattern (benchmarks, scaling studies).
        score_function: how ``softmax_topk`` scores the experts: ``"softmax"`` over all of them (OLMoE) or
            ``"sigmoid"`` of each logit on its own (DeepSeek-V3); the chosen experts' scores are the weights.
        n_group: experts form ``n_group`` contiguous groups (DeepSeek's group-limited routing; 1: no groups).
        topk_group: groups a token may choose from: the ``topk_group`` groups of largest score, a group's score
            being the sum of its two largest expert scores.
        routed_scaling_factor: multiplies the chosen experts' weights (after ``norm_topk_prob``).
        expert_bias: the router holds a per-expert selection bias (``gate.e_score_correction_bias``, an fp32 buffer,
            DeepSeek-V3's auxiliary-loss-free balancing): added to the scores to choose the experts, never to the
            weights. Implied by ``bias_update_rate > 0``; alone (rate 0) the bias is kept fixed (a loaded model).
        shared_experts: always-on SwiGLU experts of ``intermediate_size`` each (DeepSeek-V3's ``n_shared_experts``),
            added unweighted to every token's routed output (:mod:`~mula_lightning.moe.shared_experts`).
        shared_expert_intermediate_size: the shared experts' total width, when it is not ``shared_experts x
            intermediate_size`` (Qwen2-MoE's one shared expert of its own width); alone it means one shared expert.
        shared_expert_gate: scale the shared experts' output per token by ``sigmoid(w . x)`` (Qwen2-MoE).
        bias_update_rate: how far the bias moves per optimizer step: ``b_e += rate * sign(mean load - load_e)`` over
            the step's global batch (:func:`~mula_lightning.moe.balancing.update_expert_bias`; DeepSeek-V3 used
            0.001); 0 leaves it fixed.
        experts_backend: what computes the experts: ``"grouped_mm"`` (``torch._grouped_mm`` and its fallbacks),
            ``"triton"`` (the fused Triton kernels of :mod:`~mula_lightning.moe.triton_experts`; a device or dtype
            they cannot serve is refused in one line) or ``"auto"`` (see
            :func:`~mula_lightning.moe.experts.resolve_experts_backend`).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    router_kind: RouterKind = "softmax_topk"
    norm_topk_prob: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    forced_uniform_routing: bool = False
    seq_aux_loss_coef: float = 0.0
    balance_scope: str = "micro_batch"
    score_function: ScoreFunction = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False
    bias_update_rate: float = 0.0
    shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    experts_backend: ExpertsBackend = "auto"

    @property
    def shared_width(self) -> int:
        """Width of the shared experts side by side (0: none)."""
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.shared_experts * self.intermediate_size

    @property
    def uses_expert_bias(self) -> bool:
        """Whether the router holds a selection bias (``expert_bias`` or a positive ``bias_update_rate``)."""
        return bool(self.expert_bias) or self.bias_update_rate > 0

    def __post_init__(self) -> None:
        sizes = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"these MoE config values must be positive integers: {bad}")
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts ({self.num_experts}) must be >= 1 for an MoE layer")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts ({self.num_experts})]")
        if self.experts_backend not in EXPERTS_BACKENDS:
            raise ValueError(f"experts_backend ({self.experts_backend!r}) must be one of {EXPERTS_BACKENDS}")
        if self.router_kind not in ROUTER_KINDS:
            raise ValueError(f"router_kind ({self.router_kind!r}) must be one of {ROUTER_KINDS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor ({self.capacity_factor}) must be > 0 or None (dropless)")
        coef = self.seq_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
            raise ValueError(f"seq_aux_loss_coef ({coef!r}) must be a finite number >= 0 (0 skips the loss)")
        if self.balance_scope not in BALANCE_SCOPES:
            raise ValueError(f"balance_scope ({self.balance_scope!r}) must be one of {BALANCE_SCOPES}")
        check_shared_experts(self.shared_experts, self.shared_expert_intermediate_size, self.shared_expert_gate)
        check_routing(
            self.num_experts, self.top_k, self.router_kind, self.score_function, self.n_group, self.topk_group,
            self.routed_scaling_factor, self.bias_update_rate, self.expert_bias,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_routing(
    num_experts: int,
    top_k: int,
    router_kind: str,
    score_function: str,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    bias_update_rate: float = 0.0,
    expert_bias: bool = False,
) -> None:
    """Raise ``ValueError`` naming the values when the score function, the group-limited routing or the selection
    bias cannot work."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function ({score_function!r}) must be one of {SCORE_FUNCTIONS}")
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
    if num_experts % n_group:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by n_group ({n_group})")
    if topk_group > n_group:
        raise ValueError(f"topk_group ({topk_group}) must be at most n_group ({n_group})")
    left = topk_group * (num_experts // n_group)
    if n_group > 1 and top_k > left:
        raise ValueError(
            f"top_k ({top_k}) must be at most the experts of the topk_group ({topk_group}) groups a token keeps "
            f"({left} = {topk_group} x {num_experts} / n_group {n_group})"
        )
    if (score_function != "softmax" or n_group > 1) and router_kind != "softmax_topk":
        raise ValueError(
            f"score_function {score_function!r} and n_group {n_group} score the experts, then choose: they need "
            f"router_kind='softmax_topk', not {router_kind!r}"
        )
    if not routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor ({routed_scaling_factor}) must be > 0")
    if isinstance(bias_update_rate, bool) or not (0 <= bias_update_rate < math.inf):
        raise ValueError(f"bias_update_rate ({bias_update_rate!r}) must be a finite number >= 0 (0 disables)")
    if (expert_bias or bias_update_rate > 0) and router_kind != "softmax_topk":
        raise ValueError(
            f"an expert selection bias (expert_bias {expert_bias}, bias_update_rate {bias_update_rate}) is added to "
            f"the scores before top-k: it needs router_kind='softmax_topk', not {router_kind!r}"
        )


def check_shared_experts(count: int, width: int | None, gate: bool) -> None:
    """Raise ``ValueError`` naming the values when the shared experts asked for cannot be built."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"shared_experts ({count!r}) must be an integer >= 0")
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
        raise ValueError(f"shared_expert_intermediate_size ({width!r}) must be a positive integer or None")
    if gate and not (count or width):
        raise ValueError(
            f"shared_expert_gate=True gates the shared experts, but there are none (shared_experts {count}, "
            f"shared_expert_intermediate_size {width})"
        )


def as_moe_config(config: Any) -> MoEConfig:
    """``config`` itself when it is a :class:`MoEConfig`, else its ``.moe`` (a model config holding one).

    Raises:
        ValueError: for a model config without MoE layers (``num_experts == 0``).
        TypeError: for anything else.
    """
    if isinstance(config, MoEConfig):
        return config
    if hasattr(config, "moe"):
        moe = config.moe
        if moe is None:
            raise ValueError(f"an MoE layer needs num_experts > 0, got {getattr(config, 'num_experts', 0)}")
        return moe
    raise TypeError(f"expected an MoEConfig or a model config with .moe, got {type(config).__name__}")
