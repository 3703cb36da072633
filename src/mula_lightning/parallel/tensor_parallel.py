"""Tensor parallelism of a Mula model's dense parts with DTensor (Megatron's layout, torch's ``parallelize_module``).

Over the ``tp`` ranks of one :class:`~mula_lightning.parallel.mesh.ParallelMesh`:

* attention: ``q_proj`` / ``k_proj`` / ``v_proj`` column-wise (each rank computes ``num_heads / tp`` query heads and
  ``num_kv_heads / tp`` key/value heads; GQA keeps its ratio), ``o_proj`` row-wise (one all-reduce of the
  attention output). The OLMoE q/k norm spans every head, so it normalises by the sum of squares all-reduced over
  ``tp`` (:class:`HeadShardedRMSNorm`), its weight sharded like the heads;
* dense SwiGLU MLPs: ``gate_proj`` / ``up_proj`` column-wise, ``down_proj`` row-wise (one all-reduce);
* the embedding vocabulary-parallel (rows of the table sharded; the partial lookups all-reduced), the LM head
  column-wise over the vocabulary with the cross-entropy computed on each rank's slice of the logits
  (:func:`vocab_parallel_cross_entropy`: a max, a sum of exponentials and the target's logit all-reduced, never
  the logits themselves: ``tokens x vocab / tp`` per rank instead of ``tokens x vocab``);
* MoE blocks are left alone: their experts are expert parallelism's business (the folded ``ep`` / ``etp`` dims).

Sequence parallelism (``sequence_parallel=True``, Megatron's): between the tensor-parallel blocks the residual
stream stays split over ``tp`` along the sequence; row-wise outputs are reduce-scattered and column-wise inputs
all-gathered (the same bytes as one all-reduce), and the norms, the residual adds and the MoE blocks work on
``1/tp`` of the tokens, so their activations take ``1/tp`` of the memory. The routers' load-balancing and z losses
stay those of the whole sequence (:func:`~mula_lightning.moe.router.sequence_parallel_router_losses`: one
all-reduce of ``2E + 2`` statistics per MoE layer over ``tp``).

Every tensor-parallel weight is a DTensor sharded over the ``tp`` mesh, so DCP checkpoints keep logical
single-device keys and shapes. Norms, routers and experts stay plain tensors replicated over ``tp``; their gradients
come out equal on every ``tp`` rank (DTensor's backward all-reduces the gradient of each replicated input).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mula_lightning.models.linear_cross_entropy import next_token_targets
from mula_lightning.models.rms_norm import rms_norm
from mula_lightning.models.transformer import MulaAttention, MulaDecoderLayer, MulaForCausalLM, MulaMLP, RMSNorm
from mula_lightning.moe.balance_scope import reduce_router_losses_over
from mula_lightning.parallel.collectives import all_reduce
from mula_lightning.utils.precision import upcast

__all__ = [
    "HeadShardedRMSNorm",
    "PerHeadRMSNorm",
    "apply_tensor_parallel",
    "check_sequence_split",
    "check_tensor_parallel",
    "vocab_parallel_cross_entropy",
]


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Raise ``ValueError`` naming every size of ``config`` that ``tp`` does not divide (before any process starts).

    Attention heads, key/value heads (GQA: each rank keeps whole key/value heads), the dense MLP's intermediate
    size (when the model has dense layers) and the vocabulary are split over ``tp``.
    """
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "vocab_size": config.vocab_size}
    if any(not config.is_moe_layer(i) for i in range(config.num_layers)):
        dense = getattr(config, "dense_intermediate_size", None)  # the dense MLPs' width, when it is their own
        sizes["dense_intermediate_size" if dense else "intermediate_size"] = dense or config.intermediate_size
    bad = [f"{k} ({v})" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"tp_size ({tp}) must divide {', '.join(bad)}")
    if config.tie_word_embeddings and tp > 1:
        raise ValueError(f"tp_size ({tp}) > 1 with tie_word_embeddings=True is not supported (untie the LM head)")


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; each rank's input feeds every rank's output, so the gradient is summed too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return all_reduce(x, group, tag=tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce(grad.contiguous(), ctx.group, tag=ctx.tag + ".backward"), None, None


class HeadShardedRMSNorm(nn.Module):
    """:class:`RMSNorm` over a projection whose last dimension is sharded over ``tp`` (this rank's heads): the mean
    of squares is taken over the full width (local sums all-reduced), the weight is a ``Shard(0)`` DTensor.

    Built from the replicated norm it replaces (same key, same logical weight)."""

    def __init__(self, norm: RMSNorm, tp_mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.eps, self.full_dim, self.group = norm.eps, norm.weight.shape[0], tp_mesh.get_group()
        self.weight = nn.Parameter(
            distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)]), requires_grad=norm.weight.requires_grad
        )  # a frozen norm stays frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = upcast(x)
        sum_sq = _AllReduceSum.apply(x32.pow(2).sum(-1, keepdim=True), self.group, "tp.qk_norm")
        x32 = x32 * torch.rsqrt(sum_sq / self.full_dim + self.eps)
        return self.weight.to_local() * x32.to(dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (Megatron's ``vocab_parallel_cross_entropy``)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        logits = upcast(logits)
        local_max = logits.max(dim=-1).values
        logits = logits - all_reduce(local_max, group, dist.ReduceOp.MAX, tag="tp.ce.max")[:, None]
        vocab_local = logits.shape[-1]
        mine = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_index = torch.where(mine, target - vocab_start, torch.zeros_like(target))
        target_logit = logits.gather(1, local_index[:, None]).squeeze(1) * mine
        target_logit = all_reduce(target_logit, group, tag="tp.ce.target")
        exp = logits.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group, tag="tp.ce.sum_exp")
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), mine, local_index)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, mine, local_index = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(1, local_index[:, None], -mine.to(softmax.dtype)[:, None])
        return grad_logits * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean", shifted: bool = False, *, vocab_start: int,
    group: Any,
) -> torch.Tensor:  # fmt: skip
    """:func:`~mula_lightning.models.transformer.causal_lm_loss` of this rank's vocabulary slice of the logits
    (``[vocab_start, vocab_start + logits.shape[-1])``), equal on every rank of ``group``; -100 is ignored;
    ``shifted``: ``labels`` are the positions' targets already."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    shifted = (labels if shifted else next_token_targets(labels)).reshape(-1)
    valid = shifted != -100
    target = torch.where(valid, shifted, torch.zeros_like(shifted))
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target, vocab_start, group)
    per_token = per_token * valid
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum().clamp(min=1)  # no real token: 0 with zero gradients, not 0/0


class PerHeadRMSNorm(nn.Module):
    """A per-head :class:`RMSNorm` (Qwen3's q/k norm: one ``head_dim`` weight shared by every head) on this rank's
    heads: its weight is a replicated DTensor whose gradient is marked ``Partial`` over ``tp``.

    Why: each ``tp`` rank normalises only its own heads, so the weight's local gradient is a partial sum over heads
    (the full gradient is their sum over ``tp``), with or without sequence parallelism; as a plain parameter the
    sharded optimizer would take it for a full copy on every rank and scale it by ``1/tp`` (halving it at ``tp=2``:
    a wrong global norm, clipping and Adam moments). Built from the replicated norm it replaces (same key)."""

    def __init__(self, norm: RMSNorm, tp_mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.eps = norm.eps
        self.weight = nn.Parameter(
            distribute_tensor(norm.weight.detach(), tp_mesh, [Replicate()]), requires_grad=norm.weight.requires_grad
        )  # a frozen norm stays frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial

        return rms_norm(x, self.weight.to_local(grad_placements=[Partial()]), self.eps)


def _plan_attention(attn: MulaAttention, tp_mesh: Any, tp: int, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan["o_proj"] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    parallelize_module(attn, tp_mesh, plan)
    parallelize_module(attn, tp_mesh, _shared_input(sequence_parallel, extra=2))  # (x, cos, sin)
    attn.num_heads, attn.num_kv_heads = attn.config.num_heads // tp, attn.config.num_kv_heads // tp
    if attn.config.qk_norm:  # a per-head norm needs no other rank's heads, but its gradient is a partial sum
        norm = PerHeadRMSNorm if attn.config.qk_norm_per_head else HeadShardedRMSNorm
        attn.q_norm, attn.k_norm = norm(attn.q_norm, tp_mesh), norm(attn.k_norm, tp_mesh)


def _shared_input(sequence_parallel: bool, extra: int = 0) -> Any:
    """In front of a block whose first layers are column-wise (attention's q / k / v, the MLP's gate / up): its
    input as one DTensor for all of them (the sequence all-gathered under SP), so that backward sums their
    partial input gradients first and reduces them over ``tp`` once (one all-reduce, or one reduce-scatter),
    instead of once per projection. ``extra`` inputs after the first (attention's rotary tables) pass as they are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    given = Shard(1) if sequence_parallel else Replicate()
    return PrepareModuleInput(
        input_layouts=(given, *[None] * extra),
        desired_input_layouts=(Replicate(), *[None] * extra),
        use_local_output=False,
    )


def check_sequence_split(seq_len: int, tp: int) -> None:
    """Sequence parallelism cuts each sequence into ``tp`` equal parts: name a length that does not divide.

    Raises:
        ValueError: naming both values when ``tp`` does not divide ``seq_len``.
    """
    if seq_len % tp:
        raise ValueError(
            f"sequence parallelism splits each sequence over tp_size ({tp}) ranks: the sequence length ({seq_len}) "
            "must be divisible by it"
        )


def _check_sequence_split(module: nn.Module, args: tuple[Any, ...], tp: int) -> None:
    """The forward pre-hook of the model's decoder: :func:`check_sequence_split` of its input ids."""
    if args and args[0].dim() == 2:
        check_sequence_split(args[0].shape[1], tp)


def _held(model: nn.Module, path: str) -> bool:
    """Whether the submodule at ``path`` exists on this rank (pipeline parallelism removes other stages' parts)."""
    for name in path.split("."):
        model = getattr(model, name, None)
        if model is None:
            return False
    return True


def apply_tensor_parallel(model: MulaForCausalLM, tp_mesh: Any, sequence_parallel: bool = False) -> MulaForCausalLM:
    """Shard ``model``'s attention, dense MLPs, embedding and LM head over ``tp_mesh`` in place (see the module
    docstring); returns ``model``. Call before expert parallelism's dispatchers, on a materialised model or on the
    meta device (the strategies materialise each rank's shards afterwards).

    Args:
        sequence_parallel: keep the residual stream, the norms and the MoE blocks' tokens split over ``tp`` along
            the sequence (Megatron's sequence parallelism): row-wise outputs are reduce-scattered instead of
            all-reduced, column-wise inputs all-gathered; norm weights become replicated DTensors (their gradients
            summed over ``tp``). Each ``tp`` rank's MoE blocks then route their own tokens: router and expert
            gradients are partial sums to be summed over ``tp``; the routers' auxiliary losses are the sequence's
            (each rank's backward carries its tokens' share). The sequence length must be divisible by ``tp``.

    Raises:
        ValueError: naming the sizes ``tp_mesh.size()`` does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp, sp = tp_mesh.size(), sequence_parallel
    check_tensor_parallel(model.config, tp)
    # torch's SequenceParallel re-registers a norm's weight as a new Parameter, which requires grad: a norm the user
    # froze would train (restored below)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    rowwise_out = Shard(1) if sp else Replicate()
    for layer in model.model.layers:
        if not isinstance(layer, MulaDecoderLayer):  # a layer another pipeline stage holds
            continue
        _plan_attention(layer.self_attn, tp_mesh, tp, sp)
        if isinstance(layer.mlp, MulaMLP):
            plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel()}
            plan["down_proj"] = RowwiseParallel(output_layouts=rowwise_out)
            parallelize_module(layer.mlp, tp_mesh, plan)
            parallelize_module(layer.mlp, tp_mesh, _shared_input(sp))
        if sp:
            norms = {"input_layernorm": SequenceParallel(use_local_output=True)}
            norms["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
            parallelize_module(layer, tp_mesh, norms)
    plan = {  # under pipeline parallelism: the parts this rank's stages hold
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=rowwise_out),
        "lm_head": ColwiseParallel(input_layouts=rowwise_out, output_layouts=Shard(-1)),
    }
    if sp:
        plan["model.norm"] = SequenceParallel(use_local_output=True)
        reduce = partial(all_reduce, group=tp_mesh.get_group(), tag="tp.sp.router")
        reduce_router_losses_over(model, reduce, "sequence parallelism", instead=" or sequence_parallel=False")
    plan = {k: v for k, v in plan.items() if _held(model, k)}
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if sp:  # (pipeline stages bypass the decoder's forward: PipelineRunner checks its batches itself)
        model.model.register_forward_pre_hook(partial(_check_sequence_split, tp=tp))
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    vocab_start = tp_mesh.get_local_rank() * (model.config.vocab_size // tp)
    model.loss_function = partial(vocab_parallel_cross_entropy, vocab_start=vocab_start, group=tp_mesh.get_group())
    return model
