"""The ``MulaConfig`` fields of a transformers OLMoE / Mixtral / Llama / Qwen3-MoE / Qwen2-MoE config (read by
attribute, no transformers import), with a clear error for what Mula cannot compute (other activations, output or MLP
biases, sliding windows, qkv clipping).

A leaf of ``models/``: :meth:`MulaConfig.from_hf_config <mula_lightning.models.config.MulaConfig.from_hf_config>` and
:mod:`~mula_lightning.models.hf_convert` both build on it, so the config module needs no conversion code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_MODEL_TYPES", "mula_config_values"]

SUPPORTED_MODEL_TYPES = ("olmoe", "mixtral", "llama", "qwen3_moe", "qwen2_moe")


def _rope_from_hf(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} of this checkpoint is not supported (known: 'default', 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def mula_config_values(hf_config: Any) -> dict[str, Any]:
    """The ``MulaConfig`` fields computing the same function as a transformers OLMoE / Mixtral / Llama config."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (Mula uses SwiGLU with silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"{flag}=True is not supported (Mula has no biases)")
    if getattr(hf_config, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={hf_config.clip_qkv} is not supported")
    window = getattr(hf_config, "sliding_window", None)
    windowed = getattr(hf_config, "use_sliding_window", True)  # the Qwen configs carry a window they do not use
    if windowed and window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"sliding_window={window} is not supported (full causal attention only)")
    theta, scaling = _rope_from_hf(hf_config)
    values: dict[str, Any] = dict(
        name=getattr(hf_config, "_name_or_path", "") or f"hf-{model_type}",
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        intermediate_size=hf_config.intermediate_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
    )
    if model_type == "olmoe" and hf_config.num_experts == 1:
        # A one-expert OLMoE is a dense model (softmax over one logit is 1): how dense q/k-norm models export.
        values.update(num_experts=0, top_k=0, qk_norm=True)
    elif model_type == "olmoe":
        values.update(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            router_kind="softmax_topk",
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            aux_loss_coef=hf_config.router_aux_loss_coef,
            qk_norm=True,
        )
    elif model_type == "mixtral":
        values.update(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            router_kind="topk_softmax",
            aux_loss_coef=hf_config.router_aux_loss_coef,
            z_loss_coef=0.0,
            qk_norm=False,
        )
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        values.update(_qwen_moe_values(hf_config))
    else:
        values.update(num_experts=0, top_k=0, qk_norm=False)
    return values


def _qwen_moe_values(hf_config: Any) -> dict[str, Any]:
    """Qwen3-MoE (per-head q/k norm) and Qwen2-MoE (q/k/v biases, a gated shared expert): experts of
    ``moe_intermediate_size``, dense layers (``mlp_only_layers``, ``decoder_sparse_step``) of ``intermediate_size``."""
    layers, step = hf_config.num_hidden_layers, getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not moe_layers:
        raise ValueError(f"{hf_config.model_type} config without an MoE layer (mlp_only_layers {sorted(dense)})")
    values: dict[str, Any] = dict(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        router_kind="softmax_topk",
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        intermediate_size=hf_config.moe_intermediate_size,
        moe_layers=None if len(moe_layers) == layers else moe_layers,
        aux_loss_coef=hf_config.router_aux_loss_coef,
        z_loss_coef=0.0,
    )
    if hf_config.intermediate_size != hf_config.moe_intermediate_size:  # kept: the export writes it back
        values["dense_intermediate_size"] = hf_config.intermediate_size
    if hf_config.model_type == "qwen3_moe":
        values.update(qk_norm=True, qk_norm_per_head=True)
    else:
        values.update(
            qk_norm=False,
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
            shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
            shared_expert_gate=True,
        )
    return values
