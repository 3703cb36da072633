"""Activation bytes of a Mula model: what autograd keeps per micro-batch, and how many micro-batches a schedule keeps.

The closed forms count the tensors the model's own kernels save for backward (``S`` tokens of a micro-batch on this
rank, ``b`` bytes per element of the model's dtype, statistics in float32), measured against
:func:`saved_tensor_bytes` on fresh shapes in the tests:

* each RMSNorm: its input (``S H b``) and the inverse RMS (``4 S``);
* attention: its input, q and k after RoPE, v, the output and the log-sum-exp (``4 S n_heads``) of a flash kernel
  (torch's SDPA on CUDA, XPU and CPU saves no ``T x T`` matrix); with q/k norms, q and k before them and their
  statistics;
* a dense SwiGLU MLP: its input and four ``S F`` tensors (gate, silu(gate), up, their product);
* an MoE block (FastSparseMoE with the default ``grouped_mm`` experts): its input, the router's float32 logits and
  probabilities (``S E`` each), chosen experts (int64) and weights (float32), and per expert row (``R = S K`` rows at
  balanced routing, times the ``imbalance`` headroom on the busiest rank) the gate/up pre-activations (``2 F``) and the
  expert output (``H``); with expert parallelism the tokens the experts read: every EP rank's ``S`` tokens for the
  all-gather dispatcher, the ``R`` received rows for the all-to-all one; shared experts as a dense MLP;
* the embedding keeps the token ids; the final norm as above; the fused head and loss keep the input's gradient
  (``S H b``) and the head weight's (``V H``, float32 when the loss needs several chunks).

Tensor parallelism (``tp``) divides what attention keeps per head (q, k, v, output, statistics, per-head or
full-width q/k norms) and a dense MLP's four ``S F`` tensors by ``tp``; each keeps its whole ``S x H`` input (the
replicated, or under sequence parallelism all-gathered, residual stream). The vocabulary-parallel loss keeps its
float32 softmax slice (``S V / tp``), the LM head its input. Sequence parallelism divides the tokens of the norms,
the residual stream and the MoE blocks by ``tp`` (each rank routes its part of the sequence). Expert tensor
parallelism (``etp``) gathers over the ``EP x ETP`` ranks of a block: a rank's experts compute ``etp`` times the rows,
each ``F / etp`` wide.

Recomputation (``activation_checkpointing``): a recomputed region keeps its input only (``S H b``; ``"full"``: the
layer's input), and its backward holds the region's whole set again for a moment (the ``transient``).

Schedules (:func:`micro_batches_in_flight`): without pipelining one micro-batch's activations are alive at a time
(gradient accumulation frees each in its backward); ``gpipe`` keeps all ``m``; ``1f1b`` keeps ``min(m, pp - s)`` on
stage ``s``; ``interleaved_1f1b`` keeps Megatron's warm-up count of model chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.parallel.activation_checkpointing import parse_activation_checkpointing
from mula_lightning.parallel.pipeline import SCHEDULES, stage_layer_ranges
from mula_lightning.plan.states import layer_counts

#: elements of logits the fused loss computes at once on an accelerator (its ``ACCELERATOR_CHUNK_ELEMENTS``)
LOSS_CHUNK_ELEMENTS = 2**28


def _norm(s: int, width: int, b: int, decomposed: bool = False) -> int:
    """An RMSNorm over ``width``: its input in float32 (at least) and the inverse RMS; below float32, or
    ``decomposed`` (a DTensor weight, or the full-width q/k norm over tensor-parallel heads: not the fused kernel),
    also the normalised input in the model's dtype, which the weight's product keeps."""
    acc = max(b, 4)
    return s * width * acc + s * acc + (s * width * b if b < 4 or decomposed else 0)


def _attention(
    config: MulaConfig, s: int, b: int, norms_recomputed: bool = False, tp: int = 1, kv_tokens: int | None = None
) -> int:
    """``kv_tokens``: the keys and values kept (context parallelism's gathered sequence), ``s`` by default."""
    q, kv, heads, kv_heads = config.q_dim // tp, config.kv_dim // tp, config.num_heads // tp, config.num_kv_heads // tp
    kv_tokens = s if kv_tokens is None else kv_tokens
    out = s * config.hidden_size * b + 2 * s * q * b + 2 * kv_tokens * kv * b + 4 * s * heads  # in, q k v out, lse
    if config.qk_norm and norms_recomputed:  # each keeps its input only
        out += s * (q + kv) * b
    elif config.qk_norm and config.qk_norm_per_head:  # a norm per head: one statistic per head and token
        out += _norm(s * heads, config.head_dim, b) + _norm(s * kv_heads, config.head_dim, b)
    elif config.qk_norm:
        out += _norm(s, q, b, tp > 1) + _norm(s, kv, b, tp > 1)
    return out


def _mlp(s: int, h: int, width: int, b: int) -> int:
    return s * h * b + 4 * s * width * b


def _moe(config: MulaConfig, s: int, b: int, ep: int, dispatcher: str, imbalance: float, etp: int = 1,
         sequence_parallel: bool = False) -> int:  # fmt: skip
    h, e, k, f = config.hidden_size, config.num_experts, config.top_k, config.intermediate_size // etp
    group = ep * etp  # the ranks whose tokens a rank's experts read
    rows, pairs = round(s * k * etp * imbalance), s * k  # rows this rank's experts compute; pairs its tokens send
    acc = max(b, 4)  # the router computes in float32 at least: its input (and below float32 its weight) copied
    out = s * h * acc + (e * h * acc if b < 4 else 0) + 2 * s * e * acc + pairs * 8 + acc * (s + e)
    out += rows * 2 * f * b + 4 * (e // ep)  # the experts' gate / up pre-activations, their row offsets
    if group == 1 or dispatcher == "allgather":  # the experts read every rank's tokens (the router's own in float32)
        out += group * s * h * b if group > 1 or b < 4 else 0
        out += group * pairs * acc + rows * h * b  # the (gathered) routing weights, the expert outputs combined
    else:  # all-to-all: the rows received, the indices that route pairs and rows, the outputs back in float32
        out += rows * h * b + rows * 8 + 2 * pairs * 8 + pairs * acc + 2 * pairs * h * acc
    shared = layer_counts(config)[0].shared_width
    if shared:
        out += 4 * s * shared * b
    return out + (8 if sequence_parallel else 0)  # the sequence's token count, for the router's losses


def layer_activation_bytes(
    config: MulaConfig,
    layer: int,
    tokens: int,
    param_bytes: int,
    ep: int = 1,
    dispatcher: str = "allgather",
    checkpointing: Any = None,
    imbalance: float = 1.0,
    tp: int = 1,
    sequence_parallel: bool = False,
    etp: int = 1,
    cp: int = 1,
) -> tuple[int, int]:
    """``(stored, transient)``: bytes one decoder layer keeps for backward per micro-batch of ``tokens`` tokens
    (each ``tp`` rank's sequence, whole; ``cp``: this rank's ``tokens / cp`` of them, the keys and values of all),
    and the most its backward holds again at once (a recomputed region's whole set; 0 without recomputation)."""
    parts = parse_activation_checkpointing(checkpointing)
    s, h, b = tokens // cp, config.hidden_size, param_bytes
    local = s // tp if sequence_parallel else s  # the residual stream's tokens on this rank
    norm = _norm(local, h, b, sequence_parallel)
    moe = layer_counts(config)[layer].moe
    ffn = (_moe(config, local, b, ep, dispatcher, imbalance, etp, sequence_parallel or cp > 1) if moe
           else _mlp(s, h, config.dense_width // tp, b))  # fmt: skip
    parts = parts or ()
    attention = _attention(config, s, b, "norm" in parts, tp, kv_tokens=tokens)
    regions = {"norm": 2 * norm, "attention": attention, "ffn": ffn}
    if parts == "full":
        return local * h * b, sum(regions.values())
    recomputed = {"norm": "norm" in parts, "attention": "attention" in parts,
                  "ffn": ("moe" if moe else "mlp") in parts}  # fmt: skip
    inputs = {"norm": 2 * local * h * b, "attention": s * h * b,  # attention's input gathered before the region
              "ffn": (local if moe else s) * h * b}  # fmt: skip
    kept = {name: inputs[name] if recomputed[name] else size for name, size in regions.items()}
    transient = max((regions[name] for name in regions if recomputed[name]), default=0)
    return sum(kept.values()), transient


def head_activation_bytes(
    config: MulaConfig, tokens: int, param_bytes: int, checkpointing: Any = None, tp: int = 1,
    sequence_parallel: bool = False, cp: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """``(stored, transient)`` of the final norm, LM head and loss per micro-batch: the norm's as any, the gradients
    of the head's input and weight (the fused loss computes them in forward; the weight's in float32 when the
    micro-batch needs several chunks of logits); one chunk of float32 logits in flight. With tensor parallelism the
    vocabulary-parallel loss instead: the head's input, the float32 softmax of this rank's vocabulary slice, the
    targets' index (int64) and two masks, the count of tokens (not under context parallelism: the loss is a sum there);
    its backward's gradient of the logits twice over."""
    h, v = config.hidden_size, config.vocab_size
    tokens //= cp  # context parallelism: this rank's chunks
    parts = parse_activation_checkpointing(checkpointing) or ()
    local = tokens // tp if sequence_parallel else tokens
    norm = (local * h * param_bytes if parts != "full" and "norm" in parts
            else _norm(local, h, param_bytes, sequence_parallel))  # fmt: skip
    if tp > 1:
        softmax = tokens * v // tp * 4
        count = 8 if cp == 1 else 0  # under context parallelism the loss is summed and CP divides by its own count
        return norm + tokens * h * param_bytes + softmax + 10 * tokens + count, 2 * softmax
    chunk = max(1, LOSS_CHUNK_ELEMENTS // v)
    weight_grad = v * h * (param_bytes if tokens <= chunk else max(param_bytes, 4))
    stored = norm + tokens * h * param_bytes + weight_grad
    return stored, min(tokens, chunk) * v * 4


def micro_batches_in_flight(schedule: str, pp: int, stage: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations (of one model chunk) a rank holds at its peak.

    ``interleaved_1f1b``: Megatron's warm-up ``(pp - stage - 1) x 2 + (virtual - 1) x pp + 1`` chunk micro-batches
    (at most all ``micro_batches x virtual``), each of ``1 / virtual`` of the rank's layers.
    """
    if pp == 1:
        return 1
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule ({schedule!r}) must be one of {tuple(SCHEDULES)}")
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, pp - stage)
    return min(micro_batches * virtual, (pp - stage - 1) * 2 + (virtual - 1) * pp + 1)


def stage_activation_bytes(
    config: MulaConfig,
    pp: int,
    micro_batch_size: int,
    seq_len: int,
    micro_batches: int,
    param_bytes: int,
    ep: int = 1,
    dispatcher: str = "allgather",
    checkpointing: Any = None,
    imbalance: float = 1.0,
    schedule: str = "1f1b",
    virtual: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    etp: int = 1,
    cp: int = 1,
) -> list[dict[str, int]]:
    """Per pipeline stage: ``per_micro_batch`` (stored bytes of its layers, RoPE tables, embedding ids and head
    included), ``in_flight`` (micro-batches held, :func:`micro_batches_in_flight`), ``transient`` and their
    ``activations`` total (``per_micro_batch x in_flight + transient``)."""
    out = []
    tokens = micro_batch_size * seq_len
    for index in range(pp):
        stored = transient = 0
        for layer in rank_layers(config, pp, virtual, index):
            kept, again = layer_activation_bytes(config, layer, tokens, param_bytes, ep, dispatcher, checkpointing,
                                                 imbalance, tp, sequence_parallel, etp, cp)  # fmt: skip
            stored, transient = stored + kept, max(transient, again)
        stored += 2 * seq_len // cp * config.head_dim * param_bytes  # RoPE's cos and sin, once for all layers
        if cp > 1:  # the gathered keys' order (int64, shared by the layers that keep their attention's activations)
            parts = parse_activation_checkpointing(checkpointing) or ()
            stored += seq_len * 8 if parts != "full" and "attention" not in parts else 0
            stored += max(param_bytes, 4) if index == pp - 1 else 0  # the loss's count of real targets
        if index == 0:
            stored += tokens // cp * 8  # the token ids the embedding's backward reads
        if index == pp - 1:
            kept, again = head_activation_bytes(config, tokens, param_bytes, checkpointing, tp, sequence_parallel,
                                                cp)  # fmt: skip
            stored, transient = stored + kept, max(transient, again)
        per_chunk = stored // virtual
        held = micro_batches_in_flight(schedule, pp, index, micro_batches, virtual)
        out.append({"per_micro_batch": stored, "in_flight": held, "transient": transient,
                    "activations": per_chunk * held + transient})  # fmt: skip
    return out


def rank_layers(config: MulaConfig, pp: int, virtual: int, rank: int) -> list[int]:
    """The decoder layers pipeline rank ``rank`` holds: stage ``rank + v x pp`` for each of its ``virtual`` stages
    (the interleaved schedules' loop order)."""
    ranges = stage_layer_ranges(config.num_layers, pp * virtual)
    return [layer for v in range(virtual) for layer in ranges[rank + v * pp]]


@contextlib.contextmanager
def saved_tensor_bytes(params: Any = ()) -> Iterator[dict[str, int]]:
    """Count the bytes of the distinct storages autograd saves for backward while active: the measured side of this
    module's closed forms. A storage of one of ``params`` (an iterable, or a callable returning one, read at each
    save so that parameters gathered just before use are recognised) is not an activation and is not counted.

    Yields a dict whose ``"bytes"`` grows as tensors are saved (read it after the forward).
    """
    seen: set[int] = set()
    result = {"bytes": 0}

    def storage_of(t: torch.Tensor) -> Any:  # a DTensor's bytes are its local shard's; a functional collective's
        t = getattr(t, "_local_tensor", t)  # result not yet waited for (tensor parallelism's) wraps its buffer
        return getattr(t, "elem", t).untyped_storage()

    fixed = None if callable(params) else {storage_of(p).data_ptr() for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = storage_of(t)
        key = storage.data_ptr()
        excluded = fixed if fixed is not None else {storage_of(p).data_ptr() for p in params()}
        if key not in excluded and key not in seen and storage.nbytes():
            seen.add(key)
            result["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
