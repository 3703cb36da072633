"""Model-state bytes per rank (weights, gradients, fp32 master, AdamW moments) of a Mula model at a layout.

The closed forms are those the optimizers document and allocate (padding aside; a flat buffer pads each bucket or
unit to a multiple of its shard group, at most a few blocks per unit):

``epso`` (:mod:`~mula_lightning.parallel.sharded_optimizer`), per pipeline stage, ``P_ne`` / ``P_e`` = non-expert /
expert elements of the stage's layers (the first stage adds the embedding, the last the final norm and the LM head),
``W = DP x EP`` the stage's ranks:

* weights: ``P_ne + P_e / EP`` elements in the parameters' dtype;
* gradients: the same elements in float32 (4 bytes; also for bf16 parameters, Megatron's main gradients);
* owned elements (what the moments, 8 bytes, and for non-fp32 parameters the master, 4 bytes, cover): ``none``
  ``P_ne + P_e / EP``; ``dp`` (SO) ``P_ne / DP + P_e / W``; ``ep_aware`` (EPSO) ``P_ne / W + P_e / W``.

``zero_topo`` (:mod:`~mula_lightning.parallel.zero.engine`), the dense family over every rank with the layout's
``w, s, g, o``, each expert slice (``P_e / EP``) over its edp ranks with :func:`~mula_lightning.parallel.zero.layout.
expert_layout`'s sizes: weights ``P / w`` (plus a secondary copy ``P / s``: INT8 with a float32 scale per block when
weights travel quantized, else in the weights' dtype where ``s != w``), gradients ``P / g`` in float32, moments (and
master) over ``P / o``.

With tensor parallelism (``tp``, MoE parallel folding, :mod:`~mula_lightning.parallel.topology`) ``P_ne`` splits
into ``P_tp``, the elements :mod:`~mula_lightning.parallel.tensor_parallel` shards over ``tp`` (attention projections
and biases, full-width q/k norms, dense MLPs, embedding, LM head) and ``P_rep``, the rest (norms, routers, shared
experts, per-head q/k norms); with expert tensor parallelism (``etp``) each expert slice is cut ``etp`` ways more.
``epso`` then holds ``P_rep + P_tp / tp + P_e / (EP x ETP)`` elements, and ``ep_aware`` owns ``1 / W`` of every
element (each family sharded over exactly its replicas: ``W``, ``W / tp``, ``W / (EP x ETP)`` ranks).
``zero_topo`` has no tensor parallelism.

Context parallelism (``cp``, ``epso``) changes no model state: the ``cp`` ranks of a sequence are replicas of every
dense parameter (``dense_dp`` counts them beside ``dp``), and each family stays sharded over the same ranks.

With ``optimizer="muon"`` (``epso`` without tensor parallelism) the decoder layers' matrices have one float32 state
(Muon's momentum: 4 bytes, not AdamW's 8) and are owned whole by one rank each (:mod:`~mula_lightning.plan.muon`): a
stage's ranks then differ, and a stage's row is its busiest rank's (the most Muon elements); the other elements keep
the closed forms above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mula_lightning.models.config import MulaConfig
from mula_lightning.optim import OPTIMIZERS
from mula_lightning.parallel.pipeline import stage_layer_ranges
from mula_lightning.parallel.tensor_parallel import check_tensor_parallel
from mula_lightning.parallel.zero.layout import ZeroTopoLayout, expert_layout

PRECISIONS = {"32-true": 4, "bf16-true": 2}
EPSO_MODES = ("none", "dp", "ep_aware")


@dataclass(frozen=True)
class Layout:
    """How the ranks are used.

    Attributes:
        world_size: ranks in the run.
        strategy: ``"epso"`` or ``"zero_topo"``.
        ep / pp: expert- and pipeline-parallel degrees (DP, the replicas of an expert slice as in the paper's DP x EP,
            is what is left: ``world / (pp x ep x etp)``).
        mode: ``epso``'s ``sharded_optimizer``.
        precision: ``"32-true"`` or ``"bf16-true"``.
        tp / etp: tensor- and expert-tensor-parallel degrees (MoE parallel folding: a stage is ``dense_dp x tp`` on
            the dense side, ``dp x ep x etp`` on the MoE side).
        sp: sequence parallelism over the ``tp`` ranks (Megatron's; needs ``tp > 1``).
        cp: context-parallel degree (``epso``): every sequence cut over ``cp`` ranks that read one batch, folded
            over the same ranks as EP (a stage is ``dp x cp x tp`` on the dense side).
        zero_sizes: ``zero_topo``'s ``weight_size``, ``grad_size``, ``optimizer_size``, ``secondary_size`` (0: its
            defaults from the node).
        ranks_per_node / ranks_per_gpu: the node's shape (``zero_topo``'s defaults, the EP group's node).
        optimizer: ``"adamw"`` or ``"muon"`` (:class:`~mula_lightning.optim.muon.MuonAdamW`: Muon on the layers'
            matrices, AdamW on the rest).
    """

    world_size: int
    strategy: str = "epso"
    ep: int = 1
    pp: int = 1
    mode: str = "ep_aware"
    precision: str = "bf16-true"
    zero_sizes: tuple[int, int, int, int] = (0, 0, 0, 0)
    ranks_per_node: int = 1
    ranks_per_gpu: int = 1
    tp: int = 1
    etp: int = 1
    sp: bool = False
    optimizer: str = "adamw"
    cp: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Replicas of an expert slice (the mesh's ``edp``; the paper's DP of DP x EP)."""
        return self.stage_size // (self.ep * self.etp)

    @property
    def dense_dp(self) -> int:
        """Replicas of a dense parameter's tensor-parallel shard (the ``dp x cp`` ranks its gradient is reduced
        over)."""
        return self.stage_size // self.tp

    @property
    def batches(self) -> int:
        """Distinct batches of a stage: the ``tp x cp`` ranks of a group read one."""
        return self.stage_size // (self.tp * self.cp)

    @property
    def sequence_split(self) -> int:
        """Ways the residual stream's tokens are split (``tp`` under sequence parallelism, else 1)."""
        return self.tp if self.sp else 1

    def check(self, config: MulaConfig) -> None:
        """Raise ``ValueError`` naming the values when this layout cannot run ``config``."""
        if self.strategy not in ("epso", "zero_topo"):
            raise ValueError(f"strategy ({self.strategy!r}) must be 'epso' or 'zero_topo'")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision ({self.precision!r}) must be one of {sorted(PRECISIONS)}")
        sizes = (("world size", self.world_size), ("ep", self.ep), ("pp", self.pp), ("tp", self.tp), ("etp", self.etp),
                 ("cp", self.cp))  # fmt: skip
        for name, size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} ({size!r}) must be a positive integer")
        if self.world_size % (self.pp * self.ep * self.etp):
            extra = f" x etp ({self.etp})" if self.etp > 1 else ""
            raise ValueError(f"pp ({self.pp}) x ep ({self.ep}){extra} must divide the world size ({self.world_size})")
        if self.world_size % (self.pp * self.cp * self.tp):
            extra = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise ValueError(f"pp ({self.pp}){extra} x tp ({self.tp}) must divide the world size ({self.world_size})")
        self._check_tensor_parallel(config)
        self._check_context_parallel()
        self._check_optimizer()
        if self.ep > 1 and not config.is_moe:
            raise ValueError(f"ep ({self.ep}) > 1 needs an MoE model; {config.name} is dense")
        if self.ep > 1 and config.num_experts % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide the experts of {config.name} ({config.num_experts})")
        if self.pp > 1:
            stage_layer_ranges(config.num_layers, self.pp)
        if self.strategy == "epso" and self.mode not in EPSO_MODES:
            raise ValueError(f"epso's sharded_optimizer ({self.mode!r}) must be one of {EPSO_MODES}")
        if self.strategy == "zero_topo":
            if self.tp > 1 or self.etp > 1:
                raise ValueError(f"zero_topo has no tensor or expert-tensor parallelism (tp {self.tp}, etp {self.etp})")
            if self.pp > 1:
                raise ValueError(f"zero_topo has no pipeline parallelism (pp {self.pp})")
            expert_layout(self.zero_layout(), self.ep)

    def _check_tensor_parallel(self, config: MulaConfig) -> None:
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism splits the sequence over tensor-parallel ranks: it needs tp > 1")
        if self.tp > 1:
            check_tensor_parallel(config, self.tp)
        if self.etp > 1:
            if not config.is_moe:
                raise ValueError(f"etp ({self.etp}) > 1 needs an MoE model; {config.name} is dense")
            if config.intermediate_size % self.etp:
                raise ValueError(
                    f"etp ({self.etp}) must divide the experts' intermediate_size ({config.intermediate_size})"
                )
        if self.strategy == "epso" and self.mode == "dp" and (self.tp > 1 or self.etp > 1):
            raise ValueError(
                f"epso's sharded_optimizer='dp' does not run with tp ({self.tp}) or etp ({self.etp}) > 1: use "
                "'ep_aware' or 'none'"
            )

    def _check_context_parallel(self) -> None:
        """What ``epso``'s context parallelism refuses (:class:`~mula_lightning.strategies.epso.EPSOSettings`)."""
        if self.cp == 1:
            return
        if self.strategy != "epso":
            raise ValueError(f"cp ({self.cp}) > 1 runs under epso, not {self.strategy}")
        if self.etp > 1:
            raise ValueError(
                f"cp ({self.cp}) > 1 with etp ({self.etp}) > 1 is not supported yet: context parallelism folds with "
                "data, expert, tensor and pipeline parallelism (ep, tp, pp)"
            )

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer ({self.optimizer!r}) must be one of {OPTIMIZERS}")
        if self.optimizer != "muon":
            return
        if self.strategy != "epso":
            raise ValueError(
                f"optimizer 'muon' runs under epso, not {self.strategy}: Newton-Schulz needs whole matrices and "
                "zero_topo shards every element"
            )
        if self.tp > 1 or self.etp > 1:
            raise ValueError(
                f"optimizer 'muon' with tp ({self.tp}) or etp ({self.etp}) > 1 is not supported: each rank holds a "
                "slice of a matrix and Newton-Schulz needs the whole one (torchtitan refuses it too)"
            )

    def zero_layout(self) -> ZeroTopoLayout:
        w, g, o, s = self.zero_sizes
        return ZeroTopoLayout(self.world_size, self.ranks_per_node, self.ranks_per_gpu, w, g, o, s)


def _secondary_bytes(numel: float, lay: ZeroTopoLayout, layout: Layout, param_bytes: int) -> float:
    """The secondary weight copy of ``numel`` elements (kept from forward for backward): quantized (``bits`` per
    element and a float32 scale per block) when weights travel quantized over a group of several ranks, else a plain
    copy where the secondary group differs from the weight group, else none (the primary is gathered again)."""
    w, s = lay.weight_size, lay.secondary_size
    if layout.extra.get("quantize_weights") and s > 1 and w > 1:
        chunk = numel / s
        return chunk * layout.extra.get("weight_bits", 8) / 8 + 4 * chunk / layout.extra.get("block_size", 256)
    return numel / s * param_bytes if s != w else 0.0


@dataclass(frozen=True)
class LayerCounts:
    """One decoder layer's parameter elements (:meth:`MulaConfig.layer_params`), read once per config."""

    non_expert: int
    expert: int  # all its experts
    expert_active: int  # the top_k experts one token uses
    moe: bool
    shared_width: int  # the shared experts' intermediate width (0: none)
    tensor_parallel: int = 0  # of the non-expert ones, those tensor parallelism shards over tp


def _tensor_parallel_elements(config: MulaConfig, layer: int) -> int:
    """Elements of a layer that :func:`~mula_lightning.parallel.tensor_parallel.apply_tensor_parallel` shards:
    q / k / v / o (and their biases), full-width q/k norms, a dense layer's SwiGLU MLP."""
    h, q, kv = config.hidden_size, config.q_dim, config.kv_dim
    out = 2 * h * q + 2 * h * kv + (q + 2 * kv if config.qkv_bias else 0)
    out += q + kv if config.qk_norm and not config.qk_norm_per_head else 0
    return out + (0 if config.is_moe_layer(layer) else 3 * h * config.dense_width)


def layer_counts(config: MulaConfig) -> tuple[LayerCounts, ...]:
    """Every layer's counts; cached on the config values they depend on (a search plans one config hundreds of
    times, and each :meth:`MulaConfig.layer_params` builds its MoE config anew)."""
    c = config
    key = (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.dense_intermediate_size,
        c.num_experts,
        c.top_k,
        None if c.moe_layers is None else tuple(c.moe_layers),
        c.shared_experts,
        c.shared_expert_intermediate_size,
        c.shared_expert_gate,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.qk_norm,
        c.qk_norm_per_head,
        c.qkv_bias,
        c.dense_intermediate_size,
    )
    if key not in _LAYER_COUNTS:
        if len(_LAYER_COUNTS) >= 32:
            _LAYER_COUNTS.pop(next(iter(_LAYER_COUNTS)))
        shared = config.moe.shared_width if config.is_moe else 0
        _LAYER_COUNTS[key] = tuple(
            LayerCounts(
                *config.layer_params(i),
                config.layer_params(i, active=True)[1],
                config.is_moe_layer(i),
                shared,
                _tensor_parallel_elements(config, i),
            )  # fmt: skip
            for i in range(config.num_layers)
        )
    return _LAYER_COUNTS[key]


_LAYER_COUNTS: dict[tuple[Any, ...], tuple[LayerCounts, ...]] = {}


@dataclass(frozen=True)
class StageParams:
    """Parameter elements of one pipeline stage (the whole model without pipeline parallelism)."""

    non_expert: int
    expert: int  # all experts of the stage's MoE layers (the whole layer, before EP cuts it)
    tensor_parallel: int = 0  # of the non-expert ones, those tensor parallelism shards (embedding and head included)


def stage_params(config: MulaConfig, pp: int = 1) -> list[StageParams]:
    """The elements of each pipeline stage: its layers, the embedding on the first, final norm and head on the last."""
    h = config.hidden_size
    out = []
    for index, layers in enumerate(stage_layer_ranges(config.num_layers, pp)):
        non_expert = expert = tensor_parallel = 0
        for layer in layers:
            counts = layer_counts(config)[layer]
            non_expert, expert = non_expert + counts.non_expert, expert + counts.expert
            tensor_parallel += counts.tensor_parallel
        if index == 0:
            non_expert += config.vocab_size * h
            tensor_parallel += config.vocab_size * h
        if index == pp - 1:
            head = 0 if config.tie_word_embeddings and pp == 1 else config.vocab_size * h
            non_expert, tensor_parallel = non_expert + h + head, tensor_parallel + head
        out.append(StageParams(non_expert, expert, tensor_parallel))
    return out


def epso_families(stage: StageParams, layout: Layout) -> dict[str, float]:
    """Elements one rank holds per ``epso`` family: ``non_expert`` (replicated over the stage), ``tensor_parallel``
    (this rank's ``1 / tp`` shard; 0 without tensor parallelism, where those elements are non-expert ones) and
    ``expert`` (this rank's ``1 / (EP x ETP)`` of the experts)."""
    tensor_parallel = stage.tensor_parallel if layout.tp > 1 else 0
    return {
        "non_expert": stage.non_expert - tensor_parallel,
        "tensor_parallel": tensor_parallel / layout.tp,
        "expert": stage.expert / (layout.ep * layout.etp),
    }


def state_bytes(config: MulaConfig, layout: Layout, rank: int | None = None) -> list[dict[str, int]]:
    """Per pipeline stage, one rank's bytes of ``weights``, ``gradients``, ``master``, ``moments`` and their
    ``total`` (model states only: no activations or buffers yet): of stage rank ``rank`` (its index in the stage),
    or of the rank with the most (None; every rank holds the same but Muon's owners)."""
    layout.check(config)
    param_bytes = PRECISIONS[layout.precision]
    master_bytes = 4 if param_bytes != 4 else 0
    muon = None
    if layout.optimizer == "muon":
        from mula_lightning.plan.muon import stage_muon

        muon = stage_muon(config, layout.pp, layout.stage_size, layout.ep, layout.mode)
    out = []
    for index, stage in enumerate(stage_params(config, layout.pp)):
        moment_bytes = 0.0
        if layout.strategy == "epso":
            local = sum(epso_families(stage, layout).values())
            weights, gradients = local * param_bytes, local * 4
            muon_owned = 0
            if muon is not None:  # AdamW's closed forms over the other elements; Muon's by owner
                share = muon[index]
                local -= share.non_expert + share.expert / layout.ep
                stage = StageParams(stage.non_expert - share.non_expert, stage.expert - share.expert)
                muon_owned = share.worst(layout.stage_size)[0] if rank is None else share.rank_elements(rank)
            ranks = layout.stage_size
            owned = {
                "none": local,
                "dp": stage.non_expert / layout.dp + stage.expert / ranks,
                "ep_aware": (stage.non_expert + stage.expert) / ranks,
            }[layout.mode]
            moment_bytes = owned * 8 + muon_owned * 4
            owned += muon_owned
        else:
            dense, experts = layout.zero_layout(), expert_layout(layout.zero_layout(), layout.ep)
            slices = ((stage.non_expert, dense), (stage.expert / layout.ep, experts))
            weights = sum(n / lay.weight_size * param_bytes for n, lay in slices)
            weights += sum(_secondary_bytes(n, lay, layout, param_bytes) for n, lay in slices)
            gradients = sum(n / lay.grad_size * 4 for n, lay in slices)
            owned = sum(n / lay.optimizer_size for n, lay in slices)
            moment_bytes = owned * 8
        row = {
            "weights": round(weights),
            "gradients": round(gradients),
            "master": round(owned * master_bytes),
            "moments": round(moment_bytes),
        }
        row["total"] = sum(row.values())
        out.append(row)
    return out
