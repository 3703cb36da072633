"""``MulaForCausalLM``: the single-device Mula decoder (OLMo / OLMoE architecture).

Legend: B = batch, T = sequence length, H = hidden size, V = vocabulary, nh / nkv = query / key-value heads,
hd = head size.

Pre-norm decoder layers ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; attention is causal PyTorch SDPA with
RoPE (optionally Llama-3 scaled), grouped-query heads, OLMoE's optional q/k RMSNorm over the full projection
width or Qwen3's per head, and Qwen2's optional q/k/v biases; the FFN is a SwiGLU MLP (dense) or an MoE block (with
shared experts where configured). Module and parameter names follow
transformers' Llama / OLMoE / Mixtral models (5.x, fused experts) so checkpoints convert by renaming little.

The model stays plain: no process groups, no sharding. Parallelism is applied to it from the outside
(:mod:`mula_lightning.parallel`). It can be built on the meta device (``with torch.device("meta"):``) and
materialised later with ``model.to_empty(device=...)`` followed by :func:`init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.linear_cross_entropy import linear_cross_entropy, next_token_targets
from mula_lightning.models.rms_norm import rms_norm
from mula_lightning.models.rotary import apply_rotary
from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.reference import MoEAux, ReferenceMoEBlock
from mula_lightning.utils.precision import upcast

#: ``MulaConfig.moe_impl`` -> the MoE block class built from ``config.moe``.
MOE_IMPLS: dict[str, type[nn.Module]] = {"fast": FastSparseMoEBlock, "reference": ReferenceMoEBlock}


def build_moe_block(config: MulaConfig) -> nn.Module:
    """The MoE block of a decoder layer: ``MOE_IMPLS[config.moe_impl]`` built from the model's ``config.moe``."""
    if config.moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl {config.moe_impl!r} is not available; known: {sorted(MOE_IMPLS)}")
    return MOE_IMPLS[config.moe_impl](config.moe)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by a learned weight (T5 / Llama / OLMoE form)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one autograd node in fp32 / fp64 (models/rms_norm.py)


def rope_inv_freq(config: MulaConfig, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies (hd/2,), with Llama 3.1's piecewise scaling when configured."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotary_cos_sin(
    config: MulaConfig, seq_len: int, device: torch.device, dtype: torch.dtype, positions: torch.Tensor | None = None
):
    """cos and sin tables of shape (T, hd) for positions ``0..T-1`` (or the given ``positions``, (T,): context
    parallelism's chunks), computed in fp32 then cast (as transformers does)."""
    inv_freq = rope_inv_freq(config, device=device)
    if positions is None:
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    else:
        pos = positions.to(device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MulaAttention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional q/k-norm."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_dim, h, bias=False)
        # heads this module computes: all of them, or this rank's share under tensor parallelism (set by the plan)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        #: ``(q, k, v, enable_gqa) -> out`` in place of causal SDPA when the sequence is cut over ranks (set by the
        #: context-parallel plan, :mod:`mula_lightning.parallel.context_parallel`); None: the whole sequence is here
        self.context_parallel: Any = None
        if config.qk_norm:  # over the full width (OLMoE) or each head on its own (Qwen3)
            per_head = config.qk_norm_per_head
            self.q_norm = RMSNorm(config.head_dim if per_head else config.q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim if per_head else config.kv_dim, config.rms_norm_eps)

    def forward(self, x_BTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, _ = x_BTH.shape
        q, k, v = self.q_proj(x_BTH), self.k_proj(x_BTH), self.v_proj(x_BTH)
        if c.qk_norm and not c.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.num_heads, c.head_dim)
        k = k.view(b, t, self.num_kv_heads, c.head_dim)
        if c.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = v.view(b, t, self.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = c.num_heads != c.num_kv_heads
        if self.context_parallel is not None:
            out = self.context_parallel(q, k, v, gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * c.head_dim))


class MulaMLP(nn.Module):
    """Dense SwiGLU feed-forward: ``down(silu(gate x) * up x)``."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        width = config.dense_width  # an MoE model's dense layers may have their own width
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MulaDecoderLayer(nn.Module):
    """One pre-norm decoder layer; its FFN is an MoE block when ``config.is_moe_layer(layer_idx)``."""

    def __init__(self, config: MulaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MulaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_moe_block(config) if config.is_moe_layer(layer_idx) else MulaMLP(config)

    def forward(self, x_BTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, MoEAux | None]:
        x_BTH = x_BTH + self.self_attn(self.input_layernorm(x_BTH), cos, sin)
        h = self.post_attention_layernorm(x_BTH)
        if hasattr(self.mlp, "forward_with_aux"):
            y, aux = self.mlp.forward_with_aux(h)
        else:
            y, aux = self.mlp(h), None
        return x_BTH + y, aux


class MulaModel(nn.Module):
    """Embedding, decoder layers and the final norm (no LM head)."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MulaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[MoEAux]]:
        x = self.embed_tokens(input_ids)  # (B, T, H)
        cos, sin = rotary_cos_sin(self.config, input_ids.shape[1], x.device, x.dtype, position_ids)
        moe_aux: list[MoEAux] = []
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            if aux is not None:
                moe_aux.append(aux)
        return self.norm(x), moe_aux


@dataclass
class MulaOutput:
    """Model output.

    Attributes:
        logits: (B, T, V) in the parameters' dtype; None when the model was asked for the loss only
            (``return_logits=False``: the LM head and the loss ran fused, chunk by chunk).
        loss: mean next-token cross-entropy over labels != -100 (None without labels); the LM loss only.
        aux_loss: MoE auxiliary losses summed over layers, already weighted by their coefficients
            (a zero scalar for dense models).
        moe_aux: per MoE layer side outputs (tokens per expert, drops, unweighted losses).
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    moe_aux: list[MoEAux] = field(default_factory=list)


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean", shifted: bool = False
) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts ``labels[t + 1]``; -100 is ignored (transformers' rule);
    ``shifted``: ``labels`` are the targets of the positions already (``shift_labels``).

    The mean is over the real tokens; when every label is ignored (a prompt-only sample, a padding row) it is 0 with
    zero gradients, where ``F.cross_entropy``'s mean gives NaN (0/0), as the fused and vocabulary-parallel losses do.
    """
    targets = labels if shifted else next_token_targets(labels)
    loss = F.cross_entropy(
        upcast(logits).reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum" if reduction == "mean" else reduction,
    )
    return loss / (targets != -100).sum().clamp(min=1) if reduction == "mean" else loss


class MulaForCausalLM(nn.Module):
    """A Mula decoder with its LM head.

    ``model(input_ids, labels=None)`` returns :class:`MulaOutput`. Build on the meta device for huge presets
    (``with torch.device("meta"): MulaForCausalLM(cfg)``); materialise with ``to_empty`` and
    :func:`init_weights`.
    """

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MulaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        #: ``(logits, labels, reduction) -> loss``; a vocabulary-parallel plan swaps in its own (logits are then this
        #: rank's slice of the vocabulary)
        self.loss_function = causal_lm_loss
        #: rows of logits alive at once when the LM head and the loss run fused (``return_logits=False``); None:
        #: :func:`~mula_lightning.models.linear_cross_entropy.default_chunk_tokens` (by the head's device)
        self.loss_chunk_tokens: int | None = None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self, seed=0)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_reduction: str = "mean",
        return_logits: bool = True,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
    ) -> MulaOutput:
        """Logits and, with ``labels``, the loss. ``return_logits=False`` (training and validation in
        :class:`~mula_lightning.lightning_module.MulaLM`) asks for the loss only: the LM head and the cross-entropy
        then run fused in chunks (:func:`~mula_lightning.models.linear_cross_entropy.linear_cross_entropy`), never
        holding the whole batch's logits, wherever the head is a plain linear layer under the plain loss (a
        vocabulary-parallel head keeps its own loss over its logits).

        ``position_ids`` (T,): the tokens' positions in their sequences (RoPE's), ``0..T-1`` when None;
        ``shift_labels`` (B, T): the targets of the positions, given in place of ``labels`` (transformers' name):
        context parallelism passes both for a rank's chunks of the sequences, whose last targets lie in other
        chunks (:mod:`mula_lightning.parallel.context_parallel`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if labels is not None and shift_labels is not None:
            raise ValueError("pass labels or shift_labels (the targets already shifted), not both")
        shifted = shift_labels is not None
        labels = shift_labels if shifted else labels
        hidden, moe_aux = self.model(input_ids, position_ids)
        if labels is not None and not return_logits and self._fused_loss_applies():
            logits = None
            loss = linear_cross_entropy(hidden, self.lm_head.weight, labels, loss_reduction, self.loss_chunk_tokens,
                                        self.config.loss_backend, shifted=shifted)  # fmt: skip
        elif labels is not None:
            logits = self.lm_head(hidden)
            loss = (self.loss_function(logits, labels, loss_reduction, shifted=True) if shifted
                    else self.loss_function(logits, labels, loss_reduction))  # fmt: skip
        else:
            logits, loss = self.lm_head(hidden), None
        if moe_aux:
            aux_loss = torch.stack([a.aux_loss for a in moe_aux]).sum()
        else:
            aux_loss = hidden.new_zeros((), dtype=torch.float32)
        return MulaOutput(logits=logits, loss=loss, aux_loss=aux_loss, moe_aux=moe_aux)

    def _fused_loss_applies(self) -> bool:
        """The plain loss over a plain ``nn.Linear`` head without bias (a tensor-parallel plan's head holds a DTensor
        and brings its own loss). The fused path reads the head's weight without calling the head: hooks on
        ``lm_head`` itself do not run there (hooks on the whole model do)."""
        head = self.lm_head
        return (
            self.loss_function is causal_lm_loss
            and type(head) is nn.Linear
            and head.bias is None
            and type(head.weight) is nn.Parameter
        )

    # Conversion with transformers (implemented in hf_convert).
    @classmethod
    def from_hf(cls, hf_model_or_path: Any, **config_overrides: Any) -> MulaForCausalLM:
        """Load a transformers ``OlmoeForCausalLM`` / ``MixtralForCausalLM`` / ``LlamaForCausalLM`` /
        ``Qwen3MoeForCausalLM`` / ``Qwen2MoeForCausalLM``.

        Args:
            hf_model_or_path: a model object, or a directory with ``config.json`` and single- or multi-file
                safetensors (fused 5.x expert keys or per-expert hub keys).
            config_overrides: MulaConfig fields to change (e.g. ``moe_impl``).
        """
        from mula_lightning.models.hf_convert import load_from_hf

        return load_from_hf(hf_model_or_path, cls, **config_overrides)

    def to_hf(self) -> Any:
        """The equivalent transformers model (OLMoE, Mixtral, Llama, Qwen3-MoE or Qwen2-MoE; see
        ``hf_convert.to_hf``)."""
        from mula_lightning.models.hf_convert import to_hf

        return to_hf(self)


def stable_seed(seed: int, name: str) -> int:
    """A seed derived from ``(seed, name)`` only (CRC32, not Python's salted ``hash``): the same on every rank and
    run, so a parameter initialised by name gets the same values whatever builds it (one process or a shard)."""
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


#: elements drawn per generator when a matrix is initialised: a parameter's values are a function of (seed, name) in
#: blocks of this many elements (block ``b`` of the flattened tensor from its own generator), so any element range
#: can be drawn without the rest (:func:`fill_initial_`); a tensor of at most one block is one draw, as before
INIT_BLOCK_NUMEL = 2**20


def _block_seed(seed: int, name: str, block: int) -> int:
    return stable_seed(seed, name if block == 0 else f"{name}#init-block-{block}")


def fill_initial_(
    out: torch.Tensor,
    name: str,
    shape: torch.Size | tuple[int, ...],
    config: MulaConfig,
    seed: int,
    start: int = 0,
    blocks: str = "all",
) -> torch.Tensor:
    """Write elements ``[start, start + out.numel())`` of the flattened initial value of parameter ``name`` (full
    shape ``shape``) into the contiguous tensor ``out``, drawing only the blocks that range touches.

    This is how a shard owner materialises its part of a parameter without the full tensor: the extra memory is at
    most one block (:data:`INIT_BLOCK_NUMEL` float32 elements), whatever the parameter's size. Every element equals
    the same element of :func:`init_parameter` (cast to ``out``'s dtype), bit for bit.

    ``blocks`` picks which blocks this call writes: ``"all"``; ``"staged"``, those drawn through a block-sized
    temporary (a block ``out`` holds only part of, or any block of a target that is not float32 on the CPU);
    ``"direct"``, the rest (whole float32 blocks, drawn in place, and constant fills). A caller filling fresh memory
    (:meth:`ParameterInitializer.fill_many_`) writes every request's staged blocks first: the temporary then comes
    before the pages the direct blocks touch, and the peak stays at what the caller keeps.
    """
    if blocks not in ("all", "staged", "direct"):
        raise ValueError(f"blocks must be 'all', 'staged' or 'direct', got {blocks!r}")
    numel = math.prod(shape)
    stop = start + out.numel()
    if start < 0 or stop > numel:
        raise ValueError(f"elements [{start}, {stop}) are outside {name!r}, of shape {tuple(shape)} ({numel} elements)")
    flat = out.view(-1)
    if flat.numel() == 0:
        return out
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return out if blocks == "staged" else flat.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    in_place = out.dtype == torch.float32 and out.device.type == "cpu"
    first, last = start // INIT_BLOCK_NUMEL, -(-stop // INIT_BLOCK_NUMEL)
    for block in range(first, last):
        lo = block * INIT_BLOCK_NUMEL
        hi = min(lo + INIT_BLOCK_NUMEL, numel)
        whole = lo >= start and hi <= stop and in_place
        if blocks != "all" and whole != (blocks == "direct"):
            continue
        gen = torch.Generator().manual_seed(_block_seed(seed, name, block))
        # a whole block of a float32 CPU target is drawn in place; any other is drawn into a block-sized temporary
        target = flat[lo - start : hi - start] if whole else torch.empty(hi - lo)
        target.normal_(0.0, config.init_std, generator=gen)
        if not whole:
            s, e = max(lo, start), min(hi, stop)
            flat[s - start : e - start].copy_(target[s - lo : e - lo])
            del target
    return out


def init_parameter(name: str, shape: torch.Size | tuple[int, ...], config: MulaConfig, seed: int) -> torch.Tensor:
    """The initial value of one full (unsharded) parameter, a function of (seed, name) alone.

    Norm weights start at one, biases at zero; every matrix is drawn from ``N(0, init_std^2)``, block by block
    (:func:`fill_initial_`) with generators seeded by ``(seed, name, block)``. One process, DDP and any sharded
    layout therefore start bit-identical: shard owners draw only the blocks their part touches.
    """
    return fill_initial_(torch.empty(shape), name, shape, config, seed)


#: the one buffer a Mula model holds: each router's selection bias (auxiliary-loss-free balancing)
BIAS_BUFFER = "e_score_correction_bias"


def init_buffer(name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The initial value of a model buffer: the routers' selection bias (:data:`BIAS_BUFFER`) starts at zero."""
    if not name.endswith(BIAS_BUFFER):
        raise ValueError(f"no initial value is known for the buffer {name!r}")
    return torch.zeros(shape, dtype=torch.float32)


@torch.no_grad()
def init_weights(model: MulaForCausalLM, seed: int = 0) -> MulaForCausalLM:
    """(Re)initialise every parameter of a materialised model from (seed, parameter name), and its buffers."""
    for name, param in model.named_parameters():
        param.copy_(init_parameter(name, param.shape, model.config, seed).to(param.dtype))
    for name, buffer in model.named_buffers():
        buffer.copy_(init_buffer(name, buffer.shape))
    return model
