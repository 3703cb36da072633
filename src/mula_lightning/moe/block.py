"""``FastSparseMoEBlock``: the five stages of Algorithm 1 composed into one MoE block, and the transformers drop-in.

Legend: B = batch, T = sequence, S = B*T tokens, H = hidden, E = experts, K = experts per token,
RT = routed rows (local (token, k) pairs, grouped by expert).

One forward, on one device and under expert parallelism alike; only the token dispatcher changes:

1. route: ``gate`` (fp32 router: top-k, capacity drops, forced uniform routing, auxiliary losses), always on the
   rank that holds the tokens;
2. + 3. ``dispatcher.dispatch`` moves the tokens to the ranks of their experts (nothing to move with the default
   :class:`~mula_lightning.moe.token_dispatcher.LocalDispatcher`) and
   :func:`~mula_lightning.moe.dispatch.build_dispatch_plan` counts tokens and generates the indices for the
   local experts ``[n_start, n_end]``;
4. :class:`~mula_lightning.moe.experts.GroupedExperts` gathers the routed rows and runs every local expert with
   three grouped GEMMs;
5. ``dispatcher.combine`` weights and sums each token's expert outputs
   (:func:`~mula_lightning.moe.combine.combine_expert_outputs`) and brings them back to the token's rank.

:func:`mula_lightning.parallel.apply_expert_parallel` makes a block (or every block of a model) expert parallel in
place: it cuts the expert tensors to the rank's slice and sets an all-gather or all-to-all dispatcher.

Shared experts (DeepSeek-V3's, Qwen2-MoE's gated one; :mod:`~mula_lightning.moe.shared_experts`) run on the token's
rank after step 5 and add to its output.

The parameters are ``gate.weight`` (E, H), ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj``
(E, H, I), exactly those of :class:`~mula_lightning.moe.reference.ReferenceMoEBlock` and of transformers 5.x's
``OlmoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``, so state dicts move between all of
them unchanged (with ``shared_experts.*`` and ``gate.e_score_correction_bias`` as DeepSeek-V3 names them).

:meth:`FastSparseMoEBlock.from_hf` wraps a transformers block: it keeps that block's own router module as
``.gate`` (so routing is bit-for-bit transformers', ``output_router_logits=True`` still records the logits through
the router's forward hook, and the parameters are the same objects) and shares its expert weights.
:func:`patch_hf_moe` swaps every such block of a model in place.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mula_lightning.moe.config import MoEConfig, as_moe_config
from mula_lightning.moe.experts import GroupedExperts, resolve_experts_backend
from mula_lightning.moe.reference import MoEAux
from mula_lightning.moe.router import Router, RouterOutput, count_per_expert, load_balancing_loss, router_z_loss
from mula_lightning.moe.shared_experts import add_shared_experts, build_shared_experts
from mula_lightning.moe.token_dispatcher import LocalDispatcher, TokenDispatcher
from mula_lightning.utils.precision import upcast


class FastSparseMoEBlock(nn.Module):
    """Router + dispatch plan + grouped experts + weighted combine (Algorithm 1), for an :class:`MoEConfig`.

    ``forward(x)`` returns the block output with the shape and dtype of ``x``; ``forward_with_aux(x)`` also
    returns the :class:`~mula_lightning.moe.reference.MoEAux` of the layer (auxiliary losses in the graph,
    tokens per expert, dropped pairs).

    Args:
        config: the layer's :class:`MoEConfig` (hidden and expert sizes, experts, top-k, router kind, capacity, loss
            coefficients), or a model config whose ``.moe`` is one.
        device: where to allocate the parameters.
        use_grouped_mm: use ``torch._grouped_mm`` where the operands allow it; ``False`` runs one GEMM per
            expert (same results, for checking and for devices without a grouped kernel).
        reuse_dead_activations: backward writes gradients into the storage of the block's internal activations
            once they are dead (less memory and, on CPU, fewer page faults); the block's graph can then be
            backpropagated only once (a second ``backward`` with ``retain_graph=True`` raises). ``False`` lifts that.
        experts_backend: ``"auto"``, ``"grouped_mm"`` or ``"triton"`` (default: the config's ``experts_backend``);
            see :func:`~mula_lightning.moe.experts.resolve_experts_backend`.
    """

    def __init__(
        self,
        config: MoEConfig | Any,
        device: torch.device | str | None = None,
        use_grouped_mm: bool = True,
        reuse_dead_activations: bool = True,
        experts_backend: str | None = None,
    ) -> None:
        super().__init__()
        config = as_moe_config(config)
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.jitter_noise = 0.0
        #: the token transport; :func:`~mula_lightning.parallel.apply_expert_parallel` swaps it in place
        self.dispatcher: TokenDispatcher = LocalDispatcher(config.num_experts)
        self.gate: nn.Module = Router.from_config(config, device=device)
        self.experts = GroupedExperts(
            config.num_experts,
            config.hidden_size,
            config.intermediate_size,
            device=device,
            use_grouped_mm=use_grouped_mm,
            reuse_dead_activations=reuse_dead_activations,
            experts_backend=experts_backend or config.experts_backend,
        )
        build_shared_experts(self, config, device)  # always-on experts (DeepSeek-V3, Qwen2-MoE), if any

    @property
    def n_start(self) -> int:
        """First expert (global id) held here: 0 unless the block is expert parallel."""
        return self.dispatcher.n_start

    @property
    def n_end(self) -> int:
        """Last expert (global id, inclusive) held here."""
        return self.dispatcher.n_end

    def extra_repr(self) -> str:
        return f"dispatcher={self.dispatcher!r}"

    @property
    def use_grouped_mm(self) -> bool:
        return self.experts.use_grouped_mm

    @use_grouped_mm.setter
    def use_grouped_mm(self, value: bool) -> None:
        self.experts.use_grouped_mm = value

    @property
    def experts_backend(self) -> str:
        return self.experts.experts_backend

    @experts_backend.setter
    def experts_backend(self, value: str) -> None:
        self.experts.experts_backend = value

    @property
    def reuse_dead_activations(self) -> bool:
        return self.experts.reuse_dead_activations

    @reuse_dead_activations.setter
    def reuse_dead_activations(self, value: bool) -> None:
        self.experts.reuse_dead_activations = value

    # ------------------------------------------------------------------ stages
    def route(self, x_SH: torch.Tensor, num_sequences: int = 1) -> RouterOutput:
        """Stage 1 on one rank: our :class:`Router`, or a transformers router returning (logits, scores, indices)."""
        if isinstance(self.gate, Router):
            return self.gate(x_SH, num_sequences)
        logits_SE, weights_SK, indices_SK = self.gate(x_SH)
        logits32_SE = upcast(logits_SE)
        if self.config.score_function == "sigmoid":  # DeepSeek-V3: the losses' probabilities, normalised sigmoids
            probs_SE = logits32_SE.sigmoid()
            probs_SE = probs_SE / probs_SE.sum(-1, keepdim=True)
        else:
            probs_SE = torch.softmax(logits32_SE, dim=-1)
        with torch.no_grad():
            tokens_per_expert_E = count_per_expert(indices_SK, self.num_experts)
        return RouterOutput(
            logits_SE=logits_SE,
            weights_SK=weights_SK,
            indices_SK=indices_SK,
            load_balance_loss=load_balancing_loss(probs_SE, indices_SK, tokens_per_expert_E),
            z_loss=router_z_loss(logits32_SE),
            tokens_per_expert_E=tokens_per_expert_E,
            num_dropped=indices_SK.new_zeros(()),
        )

    def _router_is_dropless(self) -> bool:
        return not isinstance(self.gate, Router) or self.gate.capacity_factor is None

    def forward_with_aux(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        shape = x_BTH.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative router jitter
            noise = torch.empty_like(x_BTH).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            x_BTH = x_BTH * noise
        x_SH = x_BTH.reshape(-1, shape[-1])
        routed = self.route(x_SH, shape[0] if len(shape) == 3 else 1)  # 1.
        tokens = self.dispatcher.dispatch(x_SH, routed, dropless=self._router_is_dropless())  # 2. + 3.
        triton = resolve_experts_backend(self.experts_backend, x_SH.device, self.experts.gate_up_proj.dtype) == "triton"
        if triton and tokens.weights_on_rows and tokens.weights_SK is not None:
            y_RH = self.experts(tokens.x_SH, tokens.plan, tokens.weights_SK)  # 4., each row weighted before down
            tokens = replace(tokens, weights_SK=None)  # the combine only sums
        else:
            y_RH = self.experts(tokens.x_SH, tokens.plan)  # 4.
        if triton:  # its combine too
            out_SH = self.dispatcher.combine(y_RH, tokens, self.reuse_dead_activations, backend="triton")  # 5.
        else:  # a dispatcher written before ``backend`` existed keeps working
            out_SH = self.dispatcher.combine(y_RH, tokens, self.reuse_dead_activations)  # 5.
        out_SH = add_shared_experts(self, x_SH, out_SH)  # every token's shared experts, on the token's rank
        c = self.config
        aux = MoEAux.from_router(routed, c.aux_loss_coef, c.z_loss_coef, c.seq_aux_loss_coef)
        return out_SH.to(x_BTH.dtype).reshape(shape), aux

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.forward_with_aux(x_BTH)[0]

    # ------------------------------------------------------------- transformers
    @classmethod
    def from_hf(
        cls, hf_block: nn.Module, use_grouped_mm: bool = True, experts_backend: str = "auto"
    ) -> FastSparseMoEBlock:
        """A fast block sharing the weights (and the router module) of a transformers sparse MoE block.

        Args:
            hf_block: a transformers 5.x sparse MoE block with fused experts (:data:`HF_BLOCKS`: OLMoE, Mixtral,
                Qwen3-MoE, Qwen2-MoE and DeepSeek-V3's ``DeepseekV3MoE``, whose shared experts and shared expert
                gate are kept as they are, like its router: DeepSeek-V3's selection bias routes, and stays where it
                was loaded, since transformers' router has no update).
            use_grouped_mm: see the class arguments.
            experts_backend: see the class arguments.

        Returns:
            A block whose ``forward(hidden_states)`` returns what ``hf_block(hidden_states)`` returns, with the
            same parameter objects.
        """
        _check_hf_block(hf_block)
        gate, experts = hf_block.gate, hf_block.experts
        config = moe_config_of_hf_block(hf_block)
        block = cls(config, device="meta", use_grouped_mm=use_grouped_mm, experts_backend=experts_backend)
        block.gate = gate  # the transformers router itself: same routing, same parameter, same output hooks
        block.experts.gate_up_proj = experts.gate_up_proj
        block.experts.down_proj = experts.down_proj
        for name in ("shared_experts", "shared_expert"):  # DeepSeek-V3's, Qwen2-MoE's: the same modules, same names
            if getattr(hf_block, name, None) is not None:
                del block.shared_experts  # the meta placeholder
                setattr(block, name, getattr(hf_block, name))
        if getattr(hf_block, "shared_expert_gate", None) is not None:
            block.shared_expert_gate = hf_block.shared_expert_gate
        block.jitter_noise = float(getattr(hf_block, "jitter_noise", 0.0) or 0.0)
        block.train(hf_block.training)
        return block


#: (transformers module, sparse MoE block class) of every family :meth:`FastSparseMoEBlock.from_hf` converts
HF_BLOCKS = (
    ("olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
    ("mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
)


def _hf_block_types() -> tuple[type, ...]:
    types: list[type] = []
    for module, name in HF_BLOCKS:
        with contextlib.suppress(ImportError, AttributeError):  # depends on the installed transformers
            types.append(getattr(importlib.import_module(f"transformers.models.{module}"), name))
    return tuple(types)


def moe_config_of_hf_block(hf_block: nn.Module) -> MoEConfig:
    """The :class:`MoEConfig` describing a transformers block (its routing, shared experts and loss weight)."""
    gate, experts = hf_block.gate, hf_block.experts
    hf_config = experts.config
    kind = type(hf_block).__name__
    values: dict[str, Any] = dict(
        hidden_size=experts.hidden_dim,
        intermediate_size=experts.intermediate_dim,
        num_experts=experts.num_experts,
        top_k=gate.top_k,
        router_kind="softmax_topk",
        norm_topk_prob=bool(getattr(gate, "norm_topk_prob", False)),
        aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        z_loss_coef=0.0,
    )
    if kind.startswith("Mixtral"):
        values.update(router_kind="topk_softmax", norm_topk_prob=True)
    elif kind.startswith("Deepseek"):  # sigmoid scores, groups, scaling, a selection bias, shared experts
        values.update(
            score_function="sigmoid", n_group=gate.num_group, topk_group=gate.topk_group,
            routed_scaling_factor=float(gate.routed_scaling_factor), expert_bias=True,
            shared_experts=int(hf_config.n_shared_experts), aux_loss_coef=0.0,
        )  # fmt: skip
    elif kind.startswith("Qwen2"):
        values.update(
            shared_expert_intermediate_size=int(hf_config.shared_expert_intermediate_size), shared_expert_gate=True
        )
    return MoEConfig(**values)


def _check_hf_block(hf_block: nn.Module) -> None:
    types = _hf_block_types()
    if not isinstance(hf_block, types):
        raise TypeError(f"from_hf expects one of {[t.__name__ for t in types]}, got {type(hf_block).__name__}")
    experts = hf_block.experts
    act = getattr(experts.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"FastSparseMoEBlock computes SwiGLU experts; {type(hf_block).__name__} uses {act!r}")
    for flag in ("has_bias", "is_transposed", "has_post_expert_norm"):
        if getattr(experts, flag, False):
            raise ValueError(f"{type(experts).__name__}.{flag}=True is not supported by FastSparseMoEBlock")
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError("the transformers block is already expert-parallel; patch before sharding experts")


def patch_hf_moe(model: nn.Module, use_grouped_mm: bool = True, experts_backend: str = "auto") -> Any:
    """Swap every sparse MoE block of a transformers model (OLMoE, Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3; see
    :data:`HF_BLOCKS`) for a fast block.

    The swap is in place and keeps the parameter objects (an optimizer built before the swap stays valid) and
    the router modules (``output_router_logits=True`` keeps working). Outputs, loss and gradients are those of
    the original model up to floating-point summation order.

    Args:
        model: a transformers model (or any module containing such blocks).
        use_grouped_mm: see :class:`FastSparseMoEBlock`.
        experts_backend: see :class:`FastSparseMoEBlock`.

    Returns:
        ``model``.

    Raises:
        ValueError: when the model contains no supported sparse MoE block.
    """
    types = _hf_block_types()
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, types)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no {' / '.join(t.__name__ for t in types)} to patch (already patched?)"
        )
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = FastSparseMoEBlock.from_hf(module, use_grouped_mm=use_grouped_mm, experts_backend=experts_backend)
        setattr(parent, child, block)
    return model
