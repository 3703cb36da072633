"""Conversion between Mula and transformers' ``OlmoeForCausalLM``, ``MixtralForCausalLM``, ``LlamaForCausalLM``,
``Qwen3MoeForCausalLM`` and ``Qwen2MoeForCausalLM``.

Mula keeps transformers 5.x names (``model.layers.N.self_attn.q_proj.weight``, fused experts
``mlp.experts.gate_up_proj`` (E, 2I, H) with gate rows first and ``mlp.experts.down_proj`` (E, H, I), router
``mlp.gate.weight`` (E, H)), so most keys map to themselves. Checkpoints on the Hub still use per-expert keys;
both are accepted when loading:

* OLMoE: ``mlp.experts.N.{gate,up,down}_proj.weight``;
* Mixtral: ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.N.{w1,w3,w2}.weight``
  (w1 = gate, w3 = up, w2 = down).

Exporting picks the HF family that computes the same function:

* dense without q/k-norm -> Llama;
* dense with q/k-norm (``mula-1b``) -> OLMoE with one expert (softmax over one logit is exactly 1);
* MoE with q/k-norm -> OLMoE (``topk_softmax`` becomes ``norm_topk_prob=True``, the same function);
* MoE without q/k-norm -> Mixtral (needs top-k-then-softmax semantics);
* MoE with a per-head q/k norm (``qk_norm_per_head``) -> Qwen3-MoE (dense layers ``mlp_only_layers``);
* MoE with a gated shared expert (``shared_expert_gate``) -> Qwen2-MoE (its ``mlp.shared_expert`` is Mula's
  ``mlp.shared_experts``; q/k/v biases as ``qkv_bias``).

DeepSeek-V3's attention (multi-head latent attention) is out of scope: its MoE blocks convert one by one
(:meth:`~mula_lightning.moe.block.FastSparseMoEBlock.from_hf`, ``patch_hf_moe``), its whole model does not.

Capacity factors and forced uniform routing have no transformers equivalent: exporting such a model warns
that the HF model routes dropless.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.hf_config import mula_config_values
from mula_lightning.models.hf_keys import MIXTRAL_EXPERT_KEY, MIXTRAL_NAMES, OLMOE_EXPERT_KEY, checked_expert_ids

if TYPE_CHECKING:  # the model class is handed in by MulaForCausalLM.from_hf: no import cycle with transformer.py
    from mula_lightning.models.transformer import MulaForCausalLM


#: the transformers model class of each family an export writes
HF_ARCHITECTURES = {
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


# ----------------------------------------------------------------------------------------------- configs
def config_from_hf(hf_config: Any, **overrides: Any) -> MulaConfig:
    """The ``MulaConfig`` computing the same function as a transformers config of a supported family."""
    return MulaConfig(**{**mula_config_values(hf_config), **overrides})


#: what Mula computes beyond OLMoE / Mixtral / Llama, with the value that computes nothing more
_BEYOND_OLMOE = {
    "score_function": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "expert_bias": False,
    "bias_update_rate": 0.0, "shared_experts": 0, "shared_expert_intermediate_size": None, "shared_expert_gate": False,
    "dense_intermediate_size": None, "qk_norm_per_head": False, "qkv_bias": False,
}  # fmt: skip
#: the part of it each Qwen family computes too
_QWEN_EXTRAS = {
    "qwen3_moe": {"qk_norm_per_head", "dense_intermediate_size"},
    "qwen2_moe": {"qkv_bias", "shared_expert_intermediate_size", "shared_expert_gate", "dense_intermediate_size"},
}


def _beyond(config: MulaConfig, family: str) -> dict[str, Any]:
    """The options of ``config`` the transformers ``family`` cannot compute (see :data:`_BEYOND_OLMOE`)."""
    other = {k: getattr(config, k) for k, v in _BEYOND_OLMOE.items() if getattr(config, k) != v}
    allowed = _QWEN_EXTRAS.get(family, set())
    if family == "qwen2_moe" and config.shared_experts and config.shared_expert_intermediate_size is None:
        allowed = allowed | {"shared_experts"}  # n experts of the routed width are one of n times the width
    if not config.is_moe:
        other = {k: v for k, v in other.items() if k in ("qk_norm_per_head", "qkv_bias", "dense_intermediate_size")}
    return {k: v for k, v in other.items() if k not in allowed}


def hf_family(config: MulaConfig) -> str:
    """Which transformers family exports ``config`` exactly (see the module docstring)."""
    if config.is_moe and config.qk_norm_per_head:
        return _qwen_family(config, "qwen3_moe")
    if config.is_moe and config.shared_expert_gate:
        return _qwen_family(config, "qwen2_moe")
    if config.is_moe and config.num_moe_layers < config.num_layers:
        raise ValueError(
            f"moe_layers ({config.moe_layers}) makes {config.num_layers - config.num_moe_layers} of "
            f"{config.num_layers} layers dense; transformers' OLMoE and Mixtral need every layer to be MoE, so this "
            "mixed dense/MoE model has no transformers equivalent"
        )
    if not config.is_moe:
        return "olmoe" if config.qk_norm else "llama"
    if config.qk_norm:
        if config.head_dim * config.num_heads != config.hidden_size:
            raise ValueError(
                f"OLMoE export needs head_dim * num_heads == hidden_size, got {config.head_dim} * "
                f"{config.num_heads} != {config.hidden_size}"
            )
        return "olmoe"
    if config.router_kind == "softmax_topk" and not config.norm_topk_prob:
        raise ValueError(
            "a MoE without q/k-norm and with softmax_topk routing without norm_topk_prob has no transformers "
            "equivalent (Mixtral renormalises the top-k weights)"
        )
    return "mixtral"


def _qwen_family(config: MulaConfig, family: str) -> str:
    """``family`` when it computes ``config`` (softmax scores, no groups, no selection bias; Qwen2-MoE: a gated shared
    expert and no q/k norm; Qwen3-MoE: no shared expert, no q/k/v biases), else ``ValueError`` naming the options."""
    other = _beyond(config, family)
    if family == "qwen2_moe" and config.qk_norm:
        other["qk_norm"] = True
    if other:
        raise ValueError(
            f"{config.name} uses {other}: transformers' {family} cannot compute them (it routes with softmax scores, "
            "no groups, no scaling and no selection bias"
            + ("; it has no shared expert and no q/k/v biases)" if family == "qwen3_moe" else "; it has no q/k norm)")
        )
    return family


def _hf_config(cls: Any, **kwargs: Any) -> Any:
    """``cls(**kwargs)`` with the class's default special-token ids that lie outside the vocabulary passed as None:
    transformers warns about them at construction (OLMoE's EOS 50279 in a 4096-token model), and an exported config
    must not name a token the model does not have."""
    params = inspect.signature(cls.__init__).parameters
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        default = params[name].default if name in params else None
        if name not in kwargs and isinstance(default, int) and not 0 <= default < kwargs["vocab_size"]:
            kwargs[name] = None
    return cls(**kwargs)


def hf_config_from_mula(config: MulaConfig) -> Any:
    """The transformers config of the family chosen by :func:`hf_family`."""
    import transformers

    family = hf_family(config)
    if family in _QWEN_EXTRAS:
        return _qwen_config(config, family)
    other = _beyond(config, family)
    if other:  # the OLMoE / Mixtral / Llama models cannot express them: an export would compute otherwise
        raise ValueError(
            f"{config.name} uses {other}: the transformers families this export writes (OLMoE, Mixtral, Llama) route "
            "with softmax scores, no groups, no scaling and no selection bias, have no shared experts, no dense "
            "layers of another width, no per-head q/k norm and no q/k/v biases"
        )
    rope = _export_rope(config)
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.init_std,
        rope_parameters=rope,
    )
    if family == "llama":
        return _hf_config(transformers.LlamaConfig, head_dim=config.head_dim, **common)
    if family == "mixtral":
        return _hf_config(
            transformers.MixtralConfig,
            head_dim=config.head_dim,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            router_aux_loss_coef=config.aux_loss_coef,
            **common,
        )
    moe = config.is_moe
    return _hf_config(
        transformers.OlmoeConfig,
        num_experts=config.num_experts if moe else 1,
        num_experts_per_tok=config.top_k if moe else 1,
        norm_topk_prob=config.norm_topk_prob or config.router_kind == "topk_softmax",
        router_aux_loss_coef=config.aux_loss_coef,
        **common,
    )


def _export_rope(config: MulaConfig) -> dict[str, Any]:
    """The exported config's ``rope_parameters``; warns when the model routes with drops transformers lacks."""
    if config.capacity_factor is not None or config.forced_uniform_routing:
        warnings.warn(
            "transformers has no capacity factor or forced uniform routing; the exported model routes dropless",
            stacklevel=4,
        )
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    return rope


def _qwen_config(config: MulaConfig, family: str) -> Any:
    """The ``Qwen3MoeConfig`` / ``Qwen2MoeConfig`` of ``config`` (dense layers as ``mlp_only_layers``)."""
    import transformers

    rope = _export_rope(config)
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.dense_width,
        moe_intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=config.tie_word_embeddings, initializer_range=config.init_std, rope_parameters=rope,
        num_experts=config.num_experts, num_experts_per_tok=config.top_k, decoder_sparse_step=1,
        mlp_only_layers=dense, norm_topk_prob=config.norm_topk_prob or config.router_kind == "topk_softmax",
        router_aux_loss_coef=config.aux_loss_coef, use_sliding_window=False,
    )  # fmt: skip
    if family == "qwen3_moe":
        return _hf_config(transformers.Qwen3MoeConfig, attention_bias=False, **common)
    return _hf_config(
        transformers.Qwen2MoeConfig,
        qkv_bias=config.qkv_bias,
        shared_expert_intermediate_size=config.moe.shared_width,
        **common,
    )


# ------------------------------------------------------------------------------------------ state dicts


def _fuse_per_expert(per_expert: dict[str, dict[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for prefix, experts in per_expert.items():
        ids = checked_expert_ids(prefix, experts)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in ids]
        )
        out[f"{prefix}.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


def normalize_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite Hub-style per-expert keys (OLMoE and Mixtral) into the fused 5.x / Mula layout."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        if m := OLMOE_EXPERT_KEY.match(key):
            prefix, e, name = m.group(1), int(m.group(2)), m.group(3)
        elif m := MIXTRAL_EXPERT_KEY.match(key):
            prefix, e, name = f"{m.group(1)}.mlp", int(m.group(2)), MIXTRAL_NAMES[m.group(3)]
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = value
            continue
        per_expert.setdefault(prefix, {}).setdefault(e, {})[name] = value
    out.update(_fuse_per_expert(per_expert))
    return out


def _check_keys(got: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise KeyError(
            f"{what}: {len(missing)} missing key(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"{len(unexpected)} unexpected key(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )


def hf_to_mula_state_dict(state_dict: dict[str, torch.Tensor], config: MulaConfig) -> dict[str, torch.Tensor]:
    """Map a transformers state dict (any accepted layout) to Mula keys, checking every key."""
    sd = {k.replace(".mlp.shared_expert.", ".mlp.shared_experts."): v for k, v in state_dict.items()}  # Qwen2-MoE
    sd = normalize_hf_state_dict(sd)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    if not config.is_moe:  # a dense model exported as single-expert OLMoE comes back dense
        for i in range(config.num_layers):
            p = f"model.layers.{i}.mlp"
            if f"{p}.experts.gate_up_proj" in sd:
                gate_up = sd.pop(f"{p}.experts.gate_up_proj")
                if gate_up.shape[0] != 1:
                    raise ValueError(f"{p}: a dense config cannot load {gate_up.shape[0]} experts")
                sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"] = gate_up[0].chunk(2, dim=0)
                sd[f"{p}.down_proj.weight"] = sd.pop(f"{p}.experts.down_proj")[0]
                sd.pop(f"{p}.gate.weight", None)
    return sd


def mula_to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: MulaConfig) -> dict[str, torch.Tensor]:
    """Mula keys to the transformers 5.x keys of the family chosen by :func:`hf_family`."""
    sd = dict(state_dict)
    if hf_family(config) == "olmoe" and not config.is_moe:
        for i in range(config.num_layers):
            p = f"model.layers.{i}.mlp"
            gate, up, down = (sd.pop(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down"))
            sd[f"{p}.experts.gate_up_proj"] = torch.cat([gate, up], dim=0).unsqueeze(0)
            sd[f"{p}.experts.down_proj"] = down.unsqueeze(0)
            sd[f"{p}.gate.weight"] = gate.new_zeros(1, config.hidden_size)
    if hf_family(config) == "qwen2_moe":
        sd = {k.replace(".mlp.shared_experts.", ".mlp.shared_expert."): v for k, v in sd.items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


# ----------------------------------------------------------------------------------------- directories
def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) from a HF directory's ``model.safetensors`` or sharded ``*.safetensors.index.json``."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    for name in files:
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"{file}: listed in the index but missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield key, f.get_tensor(key)
        except Exception as err:  # safetensors raises its own error types for truncated headers
            if isinstance(err, (FileNotFoundError, KeyError)):
                raise
            raise ValueError(f"{file}: cannot read safetensors file ({err})") from err


def load_hf_directory(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The transformers config and full state dict stored in a local HF model directory (no network)."""
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    return hf_config, dict(iter_safetensors(path))


# ---------------------------------------------------------------------------------------------- models
def load_from_hf(hf_model_or_path: Any, model_cls: type[MulaForCausalLM], **overrides: Any) -> MulaForCausalLM:
    """Build a ``model_cls`` (``MulaForCausalLM``) holding the weights of a transformers model or HF directory."""
    if isinstance(hf_model_or_path, (str, Path)):
        hf_config, state_dict = load_hf_directory(hf_model_or_path)
    else:  # copy, so that training one model never changes the other
        hf_config = hf_model_or_path.config
        state_dict = {k: v.detach().clone() for k, v in hf_model_or_path.state_dict().items()}
    config = config_from_hf(hf_config, **overrides)
    sd = hf_to_mula_state_dict(state_dict, config)
    with torch.device("meta"):
        model = model_cls(config)
    _check_keys(set(sd), set(model.state_dict()), f"loading a {hf_config.model_type} checkpoint into Mula")
    model.load_state_dict(sd, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def to_hf(model: MulaForCausalLM) -> Any:
    """The transformers model computing the same function as ``model`` (weights copied)."""
    import transformers

    config = model.config
    hf_config = hf_config_from_mula(config)
    cls = getattr(transformers, HF_ARCHITECTURES[hf_config.model_type])
    with torch.device("meta"):
        hf_model = cls(hf_config)
    sd = mula_to_hf_state_dict(model.state_dict(), config)
    expected = {k for k in hf_model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    _check_keys(set(sd), expected, f"exporting Mula to {cls.__name__}")
    hf_model.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        hf_model.tie_weights()
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config=hf_config)  # buffers off the meta device
    return hf_model.eval()


def hf_export_config(config: MulaConfig) -> Any:
    """The transformers config an export writes (special ids outside the vocabulary left out by
    :func:`hf_config_from_mula`), architectures named."""
    hf_config = hf_config_from_mula(config)
    hf_config.architectures = [HF_ARCHITECTURES[hf_config.model_type]]
    return hf_config


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, cut into files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' file names: ``model.safetensors`` alone, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shard_index(path: Path, shards: list[list[str]], total_bytes: int) -> None:
    """``model.safetensors.index.json`` when the weights span several files."""
    if len(shards) == 1:
        return
    weight_map = {key: name for keys, name in zip(shards, shard_names(len(shards))) for key in keys}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf(model: MulaForCausalLM, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``model`` as a transformers directory (config.json + safetensors) without building the HF model."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = hf_export_config(model.config)
    sd = {k: v.detach().contiguous().cpu() for k, v in mula_to_hf_state_dict(model.state_dict(), model.config).items()}
    shards = plan_shards([(k, v.numel() * v.element_size()) for k, v in sd.items()], max_shard_bytes)
    for keys, name in zip(shards, shard_names(len(shards))):
        save_file({k: sd[k] for k in keys}, str(path / name), metadata={"format": "pt"})
        os.chmod(path / name, 0o644)  # safetensors writes 0600: an export is for others to read
    write_shard_index(path, shards, sum(v.numel() * v.element_size() for v in sd.values()))
    hf_config.save_pretrained(str(path))
    return path
