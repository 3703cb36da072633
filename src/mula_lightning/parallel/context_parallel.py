"""Context parallelism: every sequence of a batch cut over the ``cp`` ranks, keys and values all-gathered for attention.

Why: attention's activations grow with the sequence; at 32K-128K tokens one layer's no longer fit a rank. Context
parallelism (Megatron-Core's, torchtitan's, Llama 3's all-gather variant) gives each of ``cp`` ranks ``T / cp`` tokens
of every sequence: the projections, norms, MLPs, MoE blocks and the loss run on those tokens only, and attention
all-gathers the keys and values of the whole sequence (their gradients reduce-scattered back to their owners).

The causal load balance: a sequence is cut into ``2 cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r`` (:func:`chunk_positions`), so every rank's queries see ``2 cp + 1`` chunks of keys in all (one early
chunk and one late), the same work on every rank; a rank holding the last ``T / cp`` tokens alone would do almost
twice the average. Each query chunk ``j`` attends to the keys of chunks ``0..j`` with the causal mask aligned to its
last key (:func:`~mula_lightning.parallel.chunk_attention.chunks_attention`: on the CPU two flash-kernel calls merged by
their log-sum-exps, no ``T x T`` matrix held).

What the plan changes (:func:`apply_context_parallel`, from the outside: the model stays plain), on a
``MulaForCausalLM`` whose ranks all read the same batch (the strategy's sampler gives the ``cp`` ranks of a group one
data rank):

* a forward pre-hook cuts ``input_ids`` to this rank's chunks, passes their global positions (``position_ids``: RoPE
  rotates by them) and, for the loss, their next-token targets (``shift_labels``: a chunk's last target is the first
  token of the next chunk, on another rank), computed from the whole sequence's labels, -100 kept;
* every attention all-gathers K and V over ``cp`` (:class:`ContextParallelAttention`);
* the loss is the whole micro-batch's: this rank's sum of cross-entropies, summed over ``cp`` in value and divided by
  the micro-batch's real targets (counted from the whole labels before the cut), with the gradient of this rank's
  share alone (:func:`sum_keep_share`): the ``cp`` ranks' gradients add up to the whole sequence's, which the
  sharded optimizer sums over ``cp`` (every family is reduced over ranks that include them) and divides by the
  number of distinct batches;
* the routers' losses are the whole sequence's the same way (their ``sequence_reduce``, as under sequence
  parallelism): load balancing counts every token of the micro-batch.

Sequences must split into ``2 cp`` equal chunks: a length that does not is refused (padding would add tokens that the
routers count and the experts' capacity sees, so the run would no longer be the unsplit one's). Logits, where asked
for, are this rank's tokens'.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn

from mula_lightning.models.linear_cross_entropy import IGNORE_INDEX, next_token_targets
from mula_lightning.models.transformer import MulaAttention, MulaForCausalLM
from mula_lightning.moe.balance_scope import reduce_router_losses_over
from mula_lightning.parallel.chunk_attention import CHUNK_KERNELS, chunks_attention
from mula_lightning.parallel.collectives import all_reduce, forward_allgather_backward_reducescatter

__all__ = [
    "ContextParallelAttention",
    "apply_context_parallel",
    "check_sequence_length",
    "chunk_positions",
    "shard_for_context_parallel",
    "sum_keep_share",
]


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Raise a ``ValueError`` naming the sizes when ``seq_len`` does not split into ``2 cp`` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism over {cp} ranks cuts every sequence into 2 x cp = {2 * cp} equal chunks; the "
            f"sequence length {seq_len} does not divide (use a length that is a multiple of {2 * cp})"
        )


def chunk_positions(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds, in order: chunk ``rank`` then chunk ``2 cp - 1 - rank`` of
    the sequence's ``2 cp`` equal chunks (``seq_len / cp`` positions)."""
    check_sequence_length(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def _gathered_order(seq_len: int, cp: int, device: Any) -> torch.Tensor:
    """The rows of an all-gather of every rank's chunks (rank order) that put them in position order: the inverse of
    the ranks' positions laid end to end."""
    laid = torch.cat([chunk_positions(seq_len, cp, rank, device) for rank in range(cp)])
    return torch.argsort(laid)


class ContextParallelAttention:
    """The attention of one ``MulaAttention`` over a context-parallel group: queries of this rank's two chunks, keys
    and values of the whole sequence (one all-gather of K and V together, reduce-scattered in backward)."""

    def __init__(self, group: Any, cp: int, rank: int, kernel: str = "auto") -> None:
        if kernel not in CHUNK_KERNELS:
            raise ValueError(f"kernel ({kernel!r}) must be one of {CHUNK_KERNELS}")
        self.group, self.cp, self.rank, self.kernel = group, cp, rank, kernel
        self._orders: dict[tuple[int, torch.device], torch.Tensor] = {}  # one index for every layer's gather

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """``q`` (B, nh, L, hd), ``k`` and ``v`` (B, nkv, L, hd) of this rank's ``L = T / cp`` tokens (rotated by
        their global positions) -> (B, nh, L, hd)."""
        cp, local_len = self.cp, q.shape[2]
        rows = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # (L, 2, B, nkv, hd): one exchange
        gathered = forward_allgather_backward_reducescatter(rows, self.group, tag="cp.kv")
        key = (local_len, q.device)
        if key not in self._orders:
            self._orders = {key: _gathered_order(local_len * cp, cp, q.device)}
        whole = gathered.index_select(0, self._orders[key])  # (T, 2, B, nkv, hd), in position order
        k_all, v_all = whole[:, 0].permute(1, 2, 0, 3), whole[:, 1].permute(1, 2, 0, 3)  # (B, nkv, T, hd) views
        return chunks_attention(q, k_all, v_all, (self.rank, 2 * cp - 1 - self.rank), enable_gqa, self.kernel)


class _SumKeepShare(torch.autograd.Function):
    """Forward: the sum over the group; backward: the incoming gradient to this rank's share unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x, group=group, tag="cp.loss")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_keep_share(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group`` in value, its gradient that of this rank's ``x`` alone: the ranks' shares of a sum
    (a sequence's loss cut over ``cp``) each get the sum's gradient, and their gradients add up to the sum's."""
    return _SumKeepShare.apply(x, group)


def shard_for_context_parallel(
    input_ids: torch.Tensor, labels: torch.Tensor | None, cp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's ``(input_ids, position_ids, shift_labels, real_targets)`` of a whole micro-batch: the tokens of its
    two chunks, their positions, their next-token targets (None without labels) and the micro-batch's count of real
    targets (labels != -100 after the shift; None without labels)."""
    positions = chunk_positions(input_ids.shape[1], cp, rank, device=input_ids.device)
    local = input_ids.index_select(1, positions)
    if labels is None:
        return local, positions, None, None
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    targets = next_token_targets(labels)
    return local, positions, targets.index_select(1, positions), (targets != IGNORE_INDEX).sum()


class _ContextParallelForward:
    """The pre- and post-forward hooks of a context-parallel ``MulaForCausalLM`` (see the module docstring)."""

    def __init__(self, model: MulaForCausalLM, group: Any, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.signature = inspect.signature(type(model).forward)
        # (reduction asked, real targets) of the forward under way: one at a time (a forward that raised leaves its
        # entry to the next one's, which replaces it)
        self.pending: tuple[str, torch.Tensor | None] | None = None

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        bound = self.signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop("self")
        if call.get("position_ids") is not None or call.get("shift_labels") is not None:
            raise ValueError("under context parallelism the plan cuts the sequence: pass whole input_ids and labels")
        reduction = call["loss_reduction"]
        if call["labels"] is not None and reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction {reduction!r} under context parallelism: use 'mean' or 'sum'")
        ids, positions, targets, real = shard_for_context_parallel(call["input_ids"], call["labels"], self.cp,
                                                                   self.rank)  # fmt: skip
        call.update(input_ids=ids, labels=None, position_ids=positions, shift_labels=targets)
        if targets is not None:
            call["loss_reduction"] = "sum"
        self.pending = (reduction, real)
        return (), call

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        (reduction, real), self.pending = self.pending, None
        if output.loss is not None:
            whole = sum_keep_share(output.loss, self.group)
            output.loss = whole / real.clamp(min=1).to(whole.dtype) if reduction == "mean" else whole
        return output


def apply_context_parallel(model: nn.Module, group: Any, cp: int, rank: int, kernel: str = "auto") -> nn.Module:
    """Make every ``MulaForCausalLM`` inside ``model`` context parallel over ``group`` (``cp`` ranks, this one
    ``rank`` of them), in place; returns ``model``. ``kernel``: the chunks' attention
    (:data:`~mula_lightning.parallel.chunk_attention.CHUNK_KERNELS`).

    Raises:
        ValueError: when the module holds no Mula model, or a router counts its load-balancing loss at a scope
            other than ``"micro_batch"`` (its counts would be this rank's chunks only; named).
    """
    mulas = [m for m in model.modules() if isinstance(m, MulaForCausalLM)]
    if not mulas:
        raise ValueError(f"cp_size ({cp}) > 1 needs a MulaForCausalLM inside the module")
    attention = ContextParallelAttention(group, cp, rank, kernel)
    reduce = partial(all_reduce, group=group, tag="cp.router")
    for mula in mulas:
        reduce_router_losses_over(mula, reduce, "context parallelism")
        for module in mula.modules():
            if isinstance(module, MulaAttention):
                module.context_parallel = attention
        hooks = _ContextParallelForward(mula, group, cp, rank)
        mula.register_forward_pre_hook(hooks.before, with_kwargs=True)
        mula.register_forward_hook(hooks.after)
    return model
