"""Causal attention of one chunk of queries over every key up to its own: what context parallelism computes per chunk.

Query chunk ``j`` of a sequence cut into chunks of ``c`` tokens holds positions ``j c .. j c + c - 1``; it attends to
the keys of chunks ``0..j``, query ``i`` to keys ``0..j c + i``: the causal mask aligned to the *last* key (lower
right). SDPA's ``is_causal`` aligns it to the first (upper left), so a chunk past the first needs another way:

* ``"flash"`` (the CPU's, where the sequences are long on this project's machines): two calls of the CPU flash kernel,
  the keys of chunks ``0..j-1`` in full and chunk ``j`` causally, whose outputs are merged by their log-sum-exps
  (``lse = logaddexp(lse_1, lse_2)``, ``out = e^(lse_1 - lse) out_1 + e^(lse_2 - lse) out_2``): one softmax over both
  blocks, and no ``c x (j + 1) c`` matrix is ever held. Its backward runs each block's flash backward with the merged
  output and log-sum-exp (the rule of ring attention: with those, each block's probabilities and the row sums of
  ``dO * O`` are the whole softmax's), so forward and backward keep flash attention's memory: the queries, keys,
  values, output and log-sum-exp. The kernel reads grouped-query heads itself (query head ``h`` over key head
  ``h // (nh / nkv)``), forward and backward, so the keys are never repeated per query head.
* ``"sdpa"``: one SDPA call with the boolean mask of the chunk (``causal_chunk_mask``): any device, any dtype, the
  reference the flash path is tested against; on a GPU the mask takes the memory-efficient kernel with a bias.

``"auto"`` takes ``"flash"`` on the CPU and ``"sdpa"`` elsewhere (a GPU's lower-right flash call is not measured yet).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_KERNELS", "causal_chunk_mask", "chunks_attention"]

CHUNK_KERNELS = ("auto", "flash", "sdpa")


def causal_chunk_mask(chunk_len: int, chunk_index: int, device: Any = None) -> torch.Tensor:
    """``(c, (j + 1) c)`` boolean mask of query chunk ``j`` over the keys of chunks ``0..j``: query ``i`` (position
    ``j c + i``) sees keys ``0..j c + i`` (the causal mask aligned to the last key)."""
    keys = (chunk_index + 1) * chunk_len
    return torch.ones(chunk_len, keys, dtype=torch.bool, device=device).tril(diagonal=chunk_index * chunk_len)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


class _FlashChunks(torch.autograd.Function):
    """Query chunks ``chunks`` (``q``: their ``c`` rows each, in order) over the keys up to each: per chunk the CPU
    flash kernel on the keys before it (in full) and on its own (causally), merged by log-sum-exp. The output is laid
    out token-major, as SDPA's (the output projection reads it as a view), and saved with the queries, keys, values
    and log-sum-exps: nothing a chunk's backward needs is copied."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
        b, heads, length, dim = q.shape
        c = length // len(chunks)
        out = q.new_empty(b, length, heads, dim).transpose(1, 2)  # (B, nh, L, hd) over token-major storage
        lse = None
        for i, chunk in enumerate(chunks):
            rows, split = slice(i * c, (i + 1) * c), chunk * c
            o, o_lse = _flash(q[:, :, rows], k[:, :, split : split + c], v[:, :, split : split + c], True)
            if split:  # one softmax over the keys before the chunk and the chunk's own
                p, p_lse = _flash(q[:, :, rows], k[:, :, :split], v[:, :, :split], False)
                merged = torch.logaddexp(p_lse, o_lse)
                acc = torch.promote_types(o.dtype, torch.float32)
                o = p.to(acc) * (p_lse - merged).exp().unsqueeze(-1) + o.to(acc) * (o_lse - merged).exp().unsqueeze(-1)
                o_lse = merged
            if lse is None:
                lse = o_lse.new_empty(b, heads, length)
            out[:, :, rows] = o
            lse[:, :, rows] = o_lse
        ctx.chunks = chunks
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // len(ctx.chunks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, chunk in enumerate(ctx.chunks):
            rows, split = slice(i * c, (i + 1) * c), chunk * c
            g, o, o_lse, query = grad[:, :, rows], out[:, :, rows], lse[:, :, rows], q[:, :, rows]
            blocks = [(slice(split, split + c), True)] + ([(slice(0, split), False)] if split else [])
            for keys, causal in blocks:  # each block's gradients from the merged output and log-sum-exp
                d_q, d_k, d_v = _flash_backward(g, query, k[:, :, keys], v[:, :, keys], o, o_lse, causal)
                dq[:, :, rows] += d_q
                dk[:, :, keys] += d_k
                dv[:, :, keys] += d_v
        return dq, dk, dv, None


def chunks_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, ...], enable_gqa: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """Attention of query chunks ``chunks`` (``q``: (B, nh, n c, hd), the ``c`` queries of each in order) over the
    keys and values of a sequence (``k``, ``v``: (B, nkv, T, hd), in position order, ``T >= (max(chunks) + 1) c``),
    each chunk causal at its last key; grouped-query heads with ``enable_gqa`` (query head ``h`` reads key head
    ``h // (nh / nkv)``)."""
    if kernel not in CHUNK_KERNELS:
        raise ValueError(f"kernel ({kernel!r}) must be one of {CHUNK_KERNELS}")
    if not chunks or q.shape[2] % len(chunks):
        raise ValueError(f"{q.shape[2]} queries do not split into the {len(chunks)} chunks {chunks}")
    c = q.shape[2] // len(chunks)
    if k.shape[2] < (max(chunks) + 1) * c:
        raise ValueError(f"chunk {max(chunks)} of {c} queries needs {(max(chunks) + 1) * c} keys, got {k.shape[2]}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"{q.shape[1]} query heads over {k.shape[1]} key heads need enable_gqa=True")
    if kernel == "auto":
        kernel = "flash" if q.device.type == "cpu" else "sdpa"
    if kernel == "flash":
        return _FlashChunks.apply(q, k, v, tuple(chunks))
    outs = []
    for i, chunk in enumerate(chunks):
        keys = (chunk + 1) * c
        mask = None if chunk == 0 else causal_chunk_mask(c, chunk, q.device)
        out = F.scaled_dot_product_attention(q[:, :, i * c : (i + 1) * c], k[:, :, :keys], v[:, :, :keys],
                                             attn_mask=mask, is_causal=chunk == 0, enable_gqa=enable_gqa)  # fmt: skip
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1).transpose(1, 2)  # token-major, as SDPA's: the output projection reads a view
