"""``MulaConfig``: one dataclass for every Mula model, with named presets.

The architecture is OLMo / OLMoE (pre-norm decoder, RMSNorm, q/k-norm, RoPE, SwiGLU, untied embeddings,
vocabulary 50304). A config with ``num_experts == 0`` is dense; otherwise every decoder layer's feed-forward
(or only those listed in ``moe_layers``) is a sparse MoE block of ``num_experts`` SwiGLU experts of width
``intermediate_size``, ``top_k`` chosen per token. The MoE blocks are built from ``config.moe``, the
:class:`~mula_lightning.moe.config.MoEConfig` these fields describe (``moe/`` never sees the model config).

Presets (``MulaConfig.from_name``) reproduce Table 1 of "Scalable Pretraining of Large Mixture of Experts
Language Models on Aurora Super Computer" (layers, hidden size, heads, head size 128, intermediate size,
experts, chosen experts); the remaining settings follow OLMoE-1B-7B (rope_theta 1e4, rms_norm_eps 1e-5,
aux loss 0.01, z loss 0.001, no top-k renormalisation). Context length 2048 as in the paper's Section 2.1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mula_lightning.moe.config import EXPERTS_BACKENDS, MoEConfig, RouterKind

#: what computes the fused LM head's loss (:func:`~mula_lightning.models.linear_cross_entropy.resolve_loss_backend`)
LOSS_BACKENDS = ("auto", "torch", "triton")


@dataclass
class MulaConfig:
    """Shape and behaviour of a Mula decoder.

    Args:
        name: preset name (informational).
        vocab_size: embedding rows (padded vocabulary, 50304 for the OLMo tokenizer).
        hidden_size: model width H.
        num_layers: decoder layers L.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); ``None`` means ``num_heads``.
        head_dim: width of one head; ``None`` means ``hidden_size // num_heads``.
        intermediate_size: SwiGLU width of the dense FFN, or of one expert in an MoE layer.
        num_experts: experts per MoE layer; 0 makes a dense model.
        moe_layers: indices of the decoder layers whose FFN is an MoE block; the others keep a dense SwiGLU
            FFN of width ``intermediate_size`` (partially upcycled models). ``None`` means every layer.
            Stored sorted; needs ``num_experts > 0``.
        top_k: experts chosen per token.
        router_kind: ``"softmax_topk"`` (OLMoE, "ST": softmax over all experts, then top-k) or
            ``"topk_softmax"`` (Mixtral: top-k logits, then softmax over those k).
        norm_topk_prob: renormalise the k chosen probabilities to sum to one (``softmax_topk`` only;
            ``topk_softmax`` is normalised by construction).
        capacity_factor: tokens an expert may take, as a multiple of its fair share
            ``S * top_k / num_experts``; ``None`` is dropless.
        aux_loss_coef: weight of the Switch/OLMoE load-balancing loss.
        z_loss_coef: weight of the router z-loss.
        seq_aux_loss_coef: weight of DeepSeek-V3's sequence-wise balance loss (0: not computed).
        balance_scope: the tokens the load-balancing loss counts expert frequencies over, ``"micro_batch"``,
            ``"sequence"`` or ``"global_batch"`` (see :class:`~mula_lightning.moe.config.MoEConfig`).
        forced_uniform_routing: route tokens to experts in a fixed uniform pattern (benchmarks and
            scaling studies; the router stays in the graph).
        score_function, n_group, topk_group, routed_scaling_factor: the router's scores (``"softmax"`` or
            ``"sigmoid"``), group-limited routing and the weights' scale (see
            :class:`~mula_lightning.moe.config.MoEConfig`).
        expert_bias, bias_update_rate: auxiliary-loss-free balancing, a per-expert selection bias and how far it moves
            per optimizer step (see :class:`~mula_lightning.moe.config.MoEConfig`).
        shared_experts, shared_expert_intermediate_size, shared_expert_gate: always-on experts of every MoE layer
            (DeepSeek-V3's, Qwen2-MoE's gated one; see :class:`~mula_lightning.moe.config.MoEConfig`).
        dense_intermediate_size: SwiGLU width of the dense layers of an MoE model (the layers outside
            ``moe_layers``: DeepSeek-V3's first dense layers, Qwen's ``mlp_only_layers``); None: ``intermediate_size``.
        qk_norm: RMSNorm over the projected queries and keys (OLMoE), over the full projection width.
        qk_norm_per_head: with ``qk_norm``, normalise each head's query and key on its own (Qwen3: a weight of
            ``head_dim``) instead of the full width.
        qkv_bias: the query, key and value projections have biases (Qwen2).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: optional RoPE scaling, e.g. Llama 3.1's
            ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}``.
        max_seq_len: longest sequence the model is trained on (context size).
        tie_word_embeddings: share the input embedding with the LM head (Mula: untied).
        init_std: standard deviation of the normal initialisation of every weight matrix.
        moe_impl: which MoE block computes the sparse layers: ``"fast"`` (default, FastSparseMoE: grouped GEMMs)
            or ``"reference"`` (the plain per-expert loop every fast path is tested against); see
            :func:`mula_lightning.models.transformer.build_moe_block`. Both share one parameter layout.
        experts_backend: what computes FastSparseMoE's experts: ``"auto"`` (default), ``"grouped_mm"`` or
            ``"triton"`` (:class:`~mula_lightning.moe.config.MoEConfig`).
        loss_backend: what computes the fused LM head's loss and its gradient: ``"auto"`` (default), ``"torch"`` or
            ``"triton"`` (:func:`~mula_lightning.models.linear_cross_entropy.resolve_loss_backend`).
        extra: free-form metadata carried along (not used by the model).
    """

    name: str = "custom"
    vocab_size: int = 50304
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 1024
    num_experts: int = 0
    moe_layers: list[int] | None = None
    top_k: int = 0
    router_kind: RouterKind = "softmax_topk"
    norm_topk_prob: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    forced_uniform_routing: bool = False
    seq_aux_loss_coef: float = 0.0
    balance_scope: str = "micro_batch"
    score_function: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False
    bias_update_rate: float = 0.0
    shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    dense_intermediate_size: int | None = None
    qk_norm: bool = True
    qk_norm_per_head: bool = False
    qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    moe_impl: str = "fast"
    experts_backend: str = "auto"
    loss_backend: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.num_heads <= 0 or self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                    "when head_dim is not given"
                )
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values when the shape is inconsistent."""
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_seq_len": self.max_seq_len,
        }
        bad = {k: v for k, v in positive.items() if not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"these config values must be positive integers: {bad}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_experts < 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be >= 0 (0 = dense)")
        if self.experts_backend not in EXPERTS_BACKENDS:
            raise ValueError(f"experts_backend ({self.experts_backend!r}) must be one of {EXPERTS_BACKENDS}")
        if self.loss_backend not in LOSS_BACKENDS:
            raise ValueError(f"loss_backend ({self.loss_backend!r}) must be one of {LOSS_BACKENDS}")
        if self.moe_layers is not None:
            layers = list(self.moe_layers)
            if self.num_experts == 0:
                raise ValueError(f"moe_layers ({layers}) needs num_experts > 0 (the config is dense)")
            bad_layers = [i for i in layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
            if not layers or bad_layers or len(set(layers)) != len(layers):
                raise ValueError(
                    f"moe_layers ({layers}) must be distinct, non-empty layer indices in [0, num_layers "
                    f"({self.num_layers})); offending: {bad_layers or 'duplicates or empty'}"
                )
            self.moe_layers = sorted(layers)
        width = self.dense_intermediate_size
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
            raise ValueError(f"dense_intermediate_size ({width!r}) must be a positive integer or None")
        if self.qk_norm_per_head and not self.qk_norm:
            raise ValueError("qk_norm_per_head=True normalises queries and keys per head: it needs qk_norm=True")
        if not self.is_moe and (self.shared_experts or self.shared_expert_intermediate_size or self.shared_expert_gate):
            raise ValueError(
                f"shared experts (shared_experts {self.shared_experts}, shared_expert_intermediate_size "
                f"{self.shared_expert_intermediate_size}) belong to MoE layers: the config is dense (num_experts 0)"
            )
        if self.num_experts > 0:
            self.moe  # noqa: B018 - MoEConfig checks top_k, router_kind and capacity_factor, naming the values
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (known: 'llama3', 'default')")

    # ------------------------------------------------------------- properties
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE part of the config, what the MoE blocks are built from (``None`` for a dense model)."""
        if not self.is_moe:
            return None
        return MoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            router_kind=self.router_kind,
            norm_topk_prob=self.norm_topk_prob,
            capacity_factor=self.capacity_factor,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
            forced_uniform_routing=self.forced_uniform_routing,
            seq_aux_loss_coef=self.seq_aux_loss_coef,
            balance_scope=self.balance_scope,
            score_function=self.score_function,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            expert_bias=self.expert_bias,
            bias_update_rate=self.bias_update_rate,
            shared_experts=self.shared_experts,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            shared_expert_gate=self.shared_expert_gate,
            experts_backend=self.experts_backend,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has an MoE FFN (``moe_layers``; all layers when it is None)."""
        return self.is_moe and (self.moe_layers is None or layer_idx in self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return self.num_layers if self.moe_layers is None else len(self.moe_layers)

    @property
    def dense_width(self) -> int:
        """SwiGLU width of a dense layer (``dense_intermediate_size``, else ``intermediate_size``)."""
        return self.dense_intermediate_size or self.intermediate_size

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---------------------------------------------------------- constructors
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> MulaConfig:
        """A preset by name, with fields overridden by keyword (``from_name("mula-tiny-moe", top_k=1)``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
        values = dict(PRESETS[name])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown MulaConfig fields {sorted(unknown)} in overrides for {name!r}")
        values.update(overrides)
        return cls(name=name, **values)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MulaConfig:
        """Build the config of a transformers ``OlmoeConfig``, ``MixtralConfig``, ``LlamaConfig``, ``Qwen3MoeConfig``
        or ``Qwen2MoeConfig``."""
        from mula_lightning.models.hf_config import mula_config_values

        return cls(**mula_config_values(hf_config))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------ accounting
    def layer_params(self, layer: int, active: bool = False) -> tuple[int, int]:
        """(non-expert, expert) parameter elements of decoder layer ``layer`` (its attention, norms, router, shared
        experts and dense MLP are non-expert; ``active``: the ``top_k`` experts one token uses, not all of them)."""
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qk_norm:
            attn += 2 * self.head_dim if self.qk_norm_per_head else self.q_dim + self.kv_dim
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        non_expert = attn + 2 * h
        if not self.is_moe_layer(layer):
            return non_expert + 3 * h * self.dense_width, 0
        non_expert += self.num_experts * h  # the router
        non_expert += 3 * h * self.moe.shared_width + (h if self.shared_expert_gate else 0)  # every token uses them
        used = self.top_k if active else self.num_experts
        return non_expert, used * 3 * h * self.intermediate_size

    def num_params(self, active: bool = False) -> int:
        """Parameter count computed from the shape alone.

        Args:
            active: count only what one token uses: the router and ``top_k`` experts per MoE layer
                instead of all ``num_experts``.
        """
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + h + sum(sum(self.layer_params(i, active)) for i in range(self.num_layers))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 * active non-embedding-input params + attention.

        The attention term is 12 * L * q_dim * T (scores and weighted values, forward and backward; the
        causal mask halves the useful work but not what dense kernels compute), as in the PaLM appendix.
        """
        t = seq_len or self.max_seq_len
        dense = self.num_params(active=True) - self.vocab_size * self.hidden_size  # input embedding is a lookup
        return 6.0 * dense + 12.0 * self.num_layers * self.q_dim * t


def _mula(layers: int, hidden: int, heads: int, inter: int, experts: int, k: int) -> dict[str, Any]:
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=128,
        intermediate_size=inter,
        num_experts=experts,
        top_k=k,
    )


#: Table 1 of the Aurora paper; tiny presets for CPU tests and the demo.
PRESETS: dict[str, dict[str, Any]] = {
    "mula-1b": _mula(16, 2048, 16, 8192, 0, 0),
    "mula-7b-a1b": _mula(16, 2048, 16, 1024, 64, 8),
    "mula-20b-a2b": _mula(32, 2048, 16, 1024, 96, 8),
    "mula-100b-a7b": _mula(48, 3072, 24, 1536, 144, 8),
    "mula-220b-a10b": _mula(64, 3072, 24, 1536, 240, 8),
    # Mula-7B-A1B with today's recipe (DeepSeek-V3's): 64 fine-grained experts of which 7 routed per token plus one
    # always-on shared expert (8 active, as in mula-7b-a1b), sigmoid scores in 8 groups of which a token uses 4,
    # auxiliary-loss-free balancing instead of the load-balancing loss, a small sequence-wise loss
    "mula-7b-a1b-shared": dict(
        _mula(16, 2048, 16, 1024, 64, 7),
        shared_experts=1,
        score_function="sigmoid",
        norm_topk_prob=True,
        n_group=8,
        topk_group=4,
        bias_update_rate=1e-3,
        aux_loss_coef=0.0,
        seq_aux_loss_coef=1e-4,
    ),  # fmt: skip
    "mula-tiny-moe": dict(
        vocab_size=4096,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        num_experts=8,
        top_k=2,
        max_seq_len=256,
    ),
    "mula-tiny-dense": dict(
        vocab_size=4096,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=512,
        num_experts=0,
        top_k=0,
        max_seq_len=256,
    ),
}

#: Totals and active counts printed in Table 1 (billions), used by tests and `mula models`.
TABLE1_BILLIONS: dict[str, tuple[float, float]] = {
    "mula-1b": (1.3, 1.3),
    "mula-7b-a1b": (6.9, 1.3),
    "mula-20b-a2b": (20.0, 2.4),
    "mula-100b-a7b": (100.0, 7.6),
    "mula-220b-a10b": (220.0, 10.0),
}
