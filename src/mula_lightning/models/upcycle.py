"""Upcycling a dense Mula / Llama checkpoint into a Mixture-of-Experts model, offline or per expert-parallel rank.

Legend: L = layers, H = hidden size, I = dense FFN width, E = experts per MoE layer, K = experts per token,
G = granularity, R = E / G copies of the dense FFN, I_e = I / G width of one expert, EP = expert-parallel size.

Construction (Komatsuzaki et al.; "Llama 3 Meets MoE", ``llama3-moe-upcycling``; Megatron-LM's
``upcycling_utils.py`` for granularity, arXiv 2410.07524):

* Everything but the FFNs of the upcycled layers (embeddings, attention, norms, LM head, dense layers) is copied.
* Granularity G splits the dense SwiGLU FFN into G slices along the intermediate dimension: slice g keeps gate
  and up rows and down columns ``[g * I_e, (g + 1) * I_e)``, and ``FFN(x) = sum_g FFN_g(x)`` exactly. Expert
  ``j`` is slice ``j % G`` of copy ``j // G`` (copy-major, Megatron's order); with G = 1 every expert is a copy
  of the whole FFN.
* The router is drawn from ``N(0, init_std^2)`` with a generator seeded by (seed, ``model.layers.N.mlp.gate.weight``)
  as an (R, H) matrix whose row c is repeated for the G experts of copy c (a "virtual group": the G slices of
  one copy always get the same logit). When K is a multiple of G, top-K therefore picks K / G whole copies.
* Scaling. With a normalised router (``topk_softmax``, or ``softmax_topk`` with ``norm_topk_prob``) the weights
  of the K chosen experts sum to one and each of the G experts of a chosen copy gets ``w_c / G``, so the layer
  computes ``sum_c w_c * FFN(x) / G = FFN(x) / G``; multiplying the experts by ``s = G`` restores ``FFN(x)``
  exactly (for K % G == 0, dropless). With ``softmax_topk`` without renormalisation the chosen weights sum to a
  token-dependent ``P(x) < 1``; Megatron's ``s = E * G / K`` makes the *expected* output right at a random
  router (each expert probability ~ 1 / E), but the function is not preserved: the layer computes
  ``s * P(x) * FFN(x)``. ``s`` is applied as ``sqrt(s)`` to ``up`` and to ``down``, the two factors SwiGLU is
  linear in (Megatron spreads ``s^(1/3)`` over gate, up and down, which is not exact because SiLU is not
  homogeneous); ``gate`` is left untouched.
* Shared experts (DeepSeek-V3's ``shared_experts``, Qwen2-MoE's gated one, through ``overrides``) start as the whole
  dense FFN, so their width must be the dense width ``I``. The layer then computes ``routed + shared``: both halves
  are halved (the routed experts' ``s`` becomes ``s / 2``; an ungated shared expert gets ``sqrt(1/2)`` on ``up`` and
  ``down``; a gated one gets a zero gate, ``sigmoid(0) = 1/2``), so the upcycled layer still computes ``FFN(x)``.
  A ``routed_scaling_factor`` r divides ``s`` by r; a selection bias starts at zero.
* Noise (Drop-Upcycling, arXiv 2502.19261; OLMoE's upcycling script re-initialises random weights instead):
  for ``noise = r``, each expert re-initialises ``round(r * I_e)`` of its intermediate neurons (their gate
  and up rows and down columns) from a normal with the mean and std of the expert's own (scaled) matrix. The
  neurons and values come from a generator seeded by (seed, layer, global expert index), and the statistics are
  taken in fp64 and rounded to 6 significant digits (a reduction's last bits depend on thread count and device),
  so every expert-parallel rank draws bit-identical values offline and online.

Online mode (``ep_size > 1``): rank r builds only experts ``[r * E / EP, (r + 1) * E / EP)``. From a
safetensors directory it reads each non-FFN tensor, and of each FFN only the slices its experts use, with
``pread`` per key (:class:`~mula_lightning.models.safetensors_file.SafetensorsFile`, the slice's bytes only), so
the full MoE is never materialised: per rank the expert tensors take
``1 / EP`` of the full MoE's, plus at most one dense FFN being read at a time. The returned model's config
describes the global MoE (``num_experts = E``); its ``experts`` modules hold the local slice
(``experts.num_experts = E / EP``, ``experts.expert_range = (start, stop)``) and
``config.extra["upcycle"]`` records ``ep_rank``, ``ep_size`` and ``local_experts``. Such a model computes
correctly only once expert parallelism routes tokens across ranks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.transformer import MulaForCausalLM, init_parameter, stable_seed
from mula_lightning.models.upcycle_source import DenseSource, open_dense_source
from mula_lightning.moe.config import ROUTER_KINDS


@dataclass
class UpcycledState:
    """What :func:`upcycle_state_dict` builds.

    Attributes:
        config: the MoE config (global: ``num_experts`` is E even on one expert-parallel rank).
        state_dict: Mula names to tensors; expert tensors hold only ``expert_range``.
        expert_range: the global expert indices ``[start, stop)`` held here.
        expert_bytes: bytes of the expert tensors (router excluded) built here.
        full_expert_bytes: bytes the expert tensors of the full MoE would take.
        bytes_read: bytes of tensor data read from the dense source.
        keys_read: source keys read (each once).
    """

    config: MulaConfig
    state_dict: dict[str, torch.Tensor]
    expert_range: tuple[int, int]
    expert_bytes: int = 0
    full_expert_bytes: int = 0
    bytes_read: int = 0
    keys_read: list[str] = field(default_factory=list)


@dataclass
class UpcycleSpec:
    """Which MoE to make of a dense model: the choices of the construction in the module docstring.

    Attributes:
        num_experts, top_k, router, granularity, noise, layers, seed, norm_topk_prob, capacity_factor: the
            :class:`UpcycleSpec` (which MoE to build; its attributes document each).
        overrides: other MulaConfig fields of the MoE (``aux_loss_coef``, ``moe_impl``, ...).
    """

    num_experts: int
    top_k: int
    router: str = "topk_softmax"
    granularity: int = 1
    noise: float = 0.0
    layers: str | Sequence[int] | None = "all"
    seed: int = 0
    norm_topk_prob: bool = False
    capacity_factor: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    #: the choices a training job may make when upcycling into a model whose MoE shape its config already fixes
    TRAINING_OPTIONS = ("granularity", "noise", "seed", "layers")

    def __post_init__(self) -> None:
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise ({self.noise}) must be a fraction in [0, 1]")

    #: the MoE fields beyond the spec's own that a target config fixes (carried as ``overrides``)
    MOE_FIELDS = (
        "aux_loss_coef", "z_loss_coef", "seq_aux_loss_coef", "score_function", "n_group", "topk_group",
        "routed_scaling_factor", "expert_bias", "bias_update_rate", "shared_experts", "shared_expert_intermediate_size",
        "shared_expert_gate", "moe_impl",
    )  # fmt: skip

    @classmethod
    def for_model(cls, config: MulaConfig, **options: Any) -> UpcycleSpec:
        """The spec that upcycles into the MoE shape of ``config`` (experts, top-k, router, renormalisation,
        capacity factor, and the :attr:`MOE_FIELDS`: scores, groups, bias, shared experts, loss weights);
        ``options`` are the :attr:`TRAINING_OPTIONS`."""
        unknown = set(options) - set(cls.TRAINING_OPTIONS)
        if unknown:
            raise ValueError(f"unknown upcycle options {sorted(unknown)}; known: {', '.join(cls.TRAINING_OPTIONS)}")
        if not config.is_moe:
            raise ValueError(f"upcycling builds an MoE; the model config ({config.name}) has no experts")
        return cls(
            num_experts=config.num_experts,
            top_k=config.top_k,
            router=config.router_kind,
            norm_topk_prob=config.norm_topk_prob,
            capacity_factor=config.capacity_factor,
            overrides={k: getattr(config, k) for k in cls.MOE_FIELDS},
            **options,
        )


def expert_scale(config: MulaConfig, granularity: int) -> float:
    """The factor ``s`` the experts are multiplied by (see the module docstring): halved beside shared experts,
    divided by the routed scaling factor."""
    normalised = config.router_kind == "topk_softmax" or config.norm_topk_prob
    scale = float(granularity) if normalised else config.num_experts * granularity / config.top_k
    if config.moe.shared_width:
        scale /= 2
    return scale / config.routed_scaling_factor


def upcycled_config(dense: MulaConfig, spec: UpcycleSpec) -> MulaConfig:
    """The MoE config derived from a dense one, with errors that name the values that do not fit."""
    num_experts, top_k, router, granularity, layers = (
        spec.num_experts, spec.top_k, spec.router, spec.granularity, spec.layers
    )  # fmt: skip
    if dense.is_moe:
        raise ValueError(
            f"upcycling needs a dense model, but {dense.name!r} is already a MoE (num_experts={dense.num_experts}, "
            f"top_k={dense.top_k})"
        )
    if router not in ROUTER_KINDS:
        raise ValueError(f"router ({router!r}) must be one of {ROUTER_KINDS}")
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"granularity ({granularity}) must be a positive integer")
    inter = dense.intermediate_size
    if inter % granularity:
        raise ValueError(f"granularity ({granularity}) must divide the dense FFN size intermediate_size ({inter})")
    if num_experts < 1 or num_experts % granularity:
        raise ValueError(
            f"num_experts ({num_experts}) must be a positive multiple of granularity ({granularity}): the FFN is "
            f"copied num_experts / granularity times and each copy split into granularity experts"
        )
    if isinstance(layers, str) and layers != "all":
        raise ValueError(f'layers ({layers!r}) must be "all" or a list of layer indices')
    moe_layers = None if layers in (None, "all") else sorted(int(i) for i in layers)
    if granularity > 1 and top_k % granularity:
        warnings.warn(
            f"top_k ({top_k}) is not a multiple of granularity ({granularity}): top-k splits virtual groups and the "
            "upcycled model does not compute the dense function at initialisation",
            stacklevel=2,
        )
    values = dense.to_dict()
    values.update(
        name=f"{dense.name}-upcycled-e{num_experts}k{top_k}" + (f"g{granularity}" if granularity > 1 else ""),
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=moe_layers,
        router_kind=router,
        norm_topk_prob=spec.norm_topk_prob,
        capacity_factor=spec.capacity_factor,
        intermediate_size=inter // granularity,
        dense_intermediate_size=inter if granularity > 1 and moe_layers is not None else None,  # the kept layers
    )
    values.update(spec.overrides)
    moe = MulaConfig(**values)
    if moe.moe.shared_width not in (0, inter):
        raise ValueError(
            f"shared experts of width {moe.moe.shared_width} (shared_experts {moe.shared_experts}, "
            f"shared_expert_intermediate_size {moe.shared_expert_intermediate_size}): upcycling starts them as the "
            f"whole dense FFN, so their width must be its intermediate_size ({inter}), e.g. shared_experts="
            f"{granularity} or shared_expert_intermediate_size={inter}"
        )
    return moe


def _resolve_ep(ep_rank: int, ep_size: int, ep_group: Any, num_experts: int) -> tuple[int, int]:
    if ep_group is not None:
        import torch.distributed as dist

        rank, size = dist.get_rank(ep_group), dist.get_world_size(ep_group)
        if (ep_rank, ep_size) not in ((0, 1), (rank, size)):
            raise ValueError(f"ep_rank/ep_size ({ep_rank}/{ep_size}) disagree with ep_group ({rank}/{size})")
        ep_rank, ep_size = rank, size
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank ({ep_rank}) must be in [0, ep_size ({ep_size}))")
    if num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
    return ep_rank, ep_size


def _drop_neurons(
    gate_NH: torch.Tensor, up_NH: torch.Tensor, down_HN: torch.Tensor, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-Upcycling: re-initialise ``round(noise * N)`` neurons of one expert from its own weight statistics."""
    n = gate_NH.shape[0]
    count = round(noise * n)
    if count == 0:
        return gate_NH, up_NH, down_HN
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=gen)[:count]

    def fresh_like(w: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        # Drop-Upcycling: the mean and std of the matrix being re-initialised. A reduction's rounding depends on the
        # thread count and device, so the statistics are taken in fp64 and rounded to 6 significant digits:
        # every rank, offline or online, then draws bit-identical values.
        w64 = w.double()
        mean, std = (float(f"{v:.6g}") for v in (w64.mean().item(), w64.std(correction=0).item()))
        return torch.empty(shape).normal_(mean, std, generator=gen).to(dtype=w.dtype, device=w.device)

    gate, up, down = gate_NH.clone(), up_NH.clone(), down_HN.clone()
    gate[idx] = fresh_like(gate_NH, (count, gate_NH.shape[1]))
    up[idx] = fresh_like(up_NH, (count, up_NH.shape[1]))
    down[:, idx] = fresh_like(down_HN, (down_HN.shape[0], count))
    return gate, up, down


def _upcycle_layer(
    src: DenseSource, config: MulaConfig, layer: int, granularity: int, scale: float, noise: float, seed: int,
    expert_range: tuple[int, int], dtype: torch.dtype | None, device: torch.device | str | None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The router and the local experts of one MoE layer, reading only the FFN slices they use."""
    prefix = f"model.layers.{layer}.mlp"
    width = config.intermediate_size  # I_e
    slices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for g in sorted({j % granularity for j in range(*expert_range)}):
        gate, up, down = src.read_ffn(layer, g * width, (g + 1) * width)
        gate, up, down = (t.to(dtype=dtype or t.dtype, device=device) for t in (gate, up, down))
        root = math.sqrt(scale)
        slices[g] = (gate, (up.float() * root).to(up.dtype), (down.float() * root).to(down.dtype))
    _, _, first_down = next(iter(slices.values()))
    n_local, hidden = expert_range[1] - expert_range[0], config.hidden_size
    ffn_dtype, ffn_device = first_down.dtype, first_down.device
    # Filled in place, so that a layer never holds more than its local experts plus the slices read.
    gate_up_EIH = torch.empty((n_local, 2 * width, hidden), dtype=ffn_dtype, device=ffn_device)
    down_EHI = torch.empty((n_local, hidden, width), dtype=ffn_dtype, device=ffn_device)
    for local, j in enumerate(range(*expert_range)):
        gate, up, down = slices[j % granularity]
        if noise > 0:
            gate, up, down = _drop_neurons(gate, up, down, noise, stable_seed(seed, f"{prefix}.experts.{j}.noise"))
        gate_up_EIH[local, :width], gate_up_EIH[local, width:], down_EHI[local] = gate, up, down
    copies = config.num_experts // granularity
    router_RH = init_parameter(f"{prefix}.gate.weight", (copies, config.hidden_size), config, seed)
    out = {
        f"{prefix}.gate.weight": router_RH.repeat_interleave(granularity, dim=0).to(dtype=ffn_dtype, device=ffn_device),
        f"{prefix}.experts.gate_up_proj": gate_up_EIH,  # (E_local, 2 I_e, H)
        f"{prefix}.experts.down_proj": down_EHI,  # (E_local, H, I_e)
    }
    if config.moe.uses_expert_bias:
        out[f"{prefix}.gate.e_score_correction_bias"] = torch.zeros(config.num_experts, device=ffn_device)
    if config.moe.shared_width:  # the whole dense FFN: halved, by its gate (sigmoid(0)) or by sqrt(1/2) twice
        out.update(_shared_from_dense(src, config, layer, ffn_dtype, ffn_device))
    return out


def _shared_from_dense(
    src: DenseSource, config: MulaConfig, layer: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp"
    gate, up, down = (t.to(dtype=dtype, device=device) for t in src.read_ffn(layer, 0, src.config.intermediate_size))
    out = {f"{prefix}.shared_experts.gate_proj.weight": gate}
    if config.shared_expert_gate:
        out[f"{prefix}.shared_experts.up_proj.weight"], out[f"{prefix}.shared_experts.down_proj.weight"] = up, down
        out[f"{prefix}.shared_expert_gate.weight"] = torch.zeros(1, config.hidden_size, dtype=dtype, device=device)
    else:
        root = math.sqrt(0.5)
        out[f"{prefix}.shared_experts.up_proj.weight"] = (up.float() * root).to(dtype)
        out[f"{prefix}.shared_experts.down_proj.weight"] = (down.float() * root).to(dtype)
    return out


def upcycle_state_dict(
    dense_model_or_state: Any,
    spec: UpcycleSpec,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    ep_group: Any = None,
    config: MulaConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> UpcycledState:
    """The MoE config and (local) state dict; :func:`upcycle` documents the arguments."""
    num_experts, granularity, noise, seed = spec.num_experts, spec.granularity, spec.noise, spec.seed
    src = open_dense_source(dense_model_or_state, config)
    moe = upcycled_config(src.config, spec)
    ep_rank, ep_size = _resolve_ep(ep_rank, ep_size, ep_group, num_experts)
    per_rank = num_experts // ep_size
    expert_range = (ep_rank * per_rank, (ep_rank + 1) * per_rank)
    scale = expert_scale(moe, granularity)
    moe.extra = {
        **moe.extra,
        "upcycle": dict(
            source=src.origin, granularity=granularity, noise=noise, seed=seed, expert_scale=scale,
            ep_rank=ep_rank, ep_size=ep_size, local_experts=list(expert_range),
        ),
    }  # fmt: skip
    with torch.device("meta"):
        target_keys = list(MulaForCausalLM(moe).state_dict())
    sd: dict[str, torch.Tensor] = {}
    expert_bytes = full_bytes = 0
    for i in range(moe.num_layers):
        if moe.is_moe_layer(i):
            built = _upcycle_layer(src, moe, i, granularity, scale, noise, seed, expert_range, dtype, device)
            experts = [v for k, v in built.items() if ".mlp.experts." in k]
            expert_bytes += sum(t.numel() * t.element_size() for t in experts)
            full_bytes += sum(t.numel() // per_rank * num_experts * t.element_size() for t in experts)
            sd.update(built)
        else:
            gate, up, down = src.read_ffn(i, 0, src.config.intermediate_size)
            for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                sd[f"model.layers.{i}.mlp.{name}.weight"] = t.to(dtype=dtype or t.dtype, device=device)
    for key in target_keys:
        if ".mlp." in key:
            continue
        if key == "lm_head.weight" and moe.tie_word_embeddings:
            sd[key] = sd["model.embed_tokens.weight"]
            continue
        t = src.read(key)
        sd[key] = t.to(dtype=dtype or t.dtype, device=device)
    missing = sorted(set(target_keys) - set(sd))
    if missing:  # every target key is built above; this guards the construction itself
        raise KeyError(f"upcycling left target keys unset: {missing[:8]}")
    return UpcycledState(
        config=moe,
        state_dict=sd,
        expert_range=expert_range,
        expert_bytes=expert_bytes,
        full_expert_bytes=full_bytes,
        bytes_read=src.store.bytes_read,
        keys_read=list(src.store.keys_read),
    )


def upcycle(
    dense_model_or_state: Any,
    num_experts: int,
    top_k: int,
    router: str = "topk_softmax",
    granularity: int = 1,
    noise: float = 0.0,
    layers: str | Sequence[int] | None = "all",
    seed: int = 0,
    norm_topk_prob: bool = False,
    capacity_factor: float | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    ep_group: Any = None,
    config: MulaConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> MulaForCausalLM:
    """Turn a dense model into an E-expert top-K MoE (see the module docstring for the exact construction).

    Args:
        dense_model_or_state: a dense ``MulaForCausalLM``; a Mula state dict (with ``config=``); a transformers
            Llama directory (``config.json`` + single or sharded safetensors; a dense Mula model exported as a
            one-expert OLMoE also works); or a Mula model-only checkpoint directory
            (:mod:`mula_lightning.models.checkpoint_io`). Directories are read lazily, tensor by tensor.
        num_experts: E, experts per upcycled layer.
        top_k: K, experts per token.
        router: ``"topk_softmax"`` (Mixtral; preserves the dense function) or ``"softmax_topk"`` (OLMoE / ST).
        granularity: G, experts per copy of the FFN (each of width ``I / G``); must divide E and I.
        noise: fraction of each expert's intermediate neurons to re-initialise (Drop-Upcycling); 0 keeps exact
            copies.
        layers: ``"all"`` or the indices of the layers to upcycle; the others stay dense.
        seed: seeds the router (by parameter name) and the noise (by layer and expert).
        norm_topk_prob: renormalise the top-K weights of a ``softmax_topk`` router (then it preserves the dense
            function like ``topk_softmax``).
        capacity_factor: the MoE's capacity factor (None = dropless; function preservation needs dropless).
        ep_rank: this rank's index in the expert-parallel group.
        ep_size: expert-parallel size EP; the model keeps experts ``[ep_rank * E / EP, (ep_rank + 1) * E / EP)``.
        ep_group: a ``torch.distributed`` process group to read ``ep_rank`` / ``ep_size`` from instead.
        config: the dense config of a state dict (ignored for models and directories).
        dtype: cast every tensor to this dtype (default: keep the checkpoint's).
        device: build the tensors on this device (default: CPU).
        overrides: ``UpcycleSpec.overrides``, other MulaConfig fields of the MoE (``aux_loss_coef``, ...).

    Returns:
        The MoE model; with ``ep_size > 1`` its expert tensors hold only the local experts.
    """
    spec = UpcycleSpec(
        num_experts, top_k, router, granularity, noise, layers, seed, norm_topk_prob, capacity_factor, overrides
    )
    return build_upcycled(
        dense_model_or_state, spec, ep_rank=ep_rank, ep_size=ep_size, ep_group=ep_group, config=config, dtype=dtype,
        device=device,
    )  # fmt: skip


def build_upcycled(dense_model_or_state: Any, spec: UpcycleSpec, **placement: Any) -> MulaForCausalLM:
    """The upcycled model for an :class:`UpcycleSpec`.

    Args:
        dense_model_or_state: the dense source (see :func:`upcycle`).
        spec: which MoE to build.
        placement: :func:`upcycle_state_dict`'s keywords (``ep_rank``, ``ep_size``, ``ep_group``, ``config``,
            ``dtype``, ``device``).
    """
    state = upcycle_state_dict(dense_model_or_state, spec, **placement)
    with torch.device("meta"):
        model = MulaForCausalLM(state.config)
    start, stop = state.expert_range
    for i, layer in enumerate(model.model.layers):
        if state.config.is_moe_layer(i):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):  # local shapes, so that load_state_dict accepts the slice
                shape = state.state_dict[f"model.layers.{i}.mlp.experts.{name}"].shape
                setattr(experts, name, nn.Parameter(torch.empty(shape, device="meta")))
            experts.num_experts = stop - start
            experts.expert_range = (start, stop)
    model.load_state_dict(state.state_dict, assign=True)
    if state.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
