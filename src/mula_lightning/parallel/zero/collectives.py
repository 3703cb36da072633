"""The collectives of hierarchical ZeRO, plain and block-quantized (ZeRO++ qwZ / qgZ), with ledger records.

Chunk order: a group's ranks are its sorted global ranks (``torch.distributed.new_group`` order); the rank at
group index ``k`` holds (or receives) chunk ``positions[k]`` of the buffer, so a nested layout
(:mod:`~mula_lightning.parallel.zero.layout`) maps onto ordinary collectives by reordering chunks.

* :class:`WeightGather` (qwZ-like): each rank sends its chunk of ``n`` elements; all ranks receive every chunk into
  the full buffer. Quantized, a chunk travels as ``pack(quantize(chunk, bits, block))``; every rank, the owner
  included, writes the *dequantized* values, so all ranks compute with identical weights. Bytes sent per rank:
  ``(d - 1) * n * elem`` plain, ``(d - 1) * (n * bits / 8 + 4 n / block)`` quantized. Asynchronous: ``wait()``
  finishes the dequantization (the prefetch of the next layer overlaps compute on real backends).
* :func:`reduce_scatter_chunks` (qgZ-like): plain, one reduce-scatter of the reordered chunks (fp32); quantized,
  every destination chunk is quantized (INT4 by default), one ``all_to_all`` moves payload and scales, and the
  receiver dequantizes and sums the ``d`` contributions in fp32 in source-rank order. Bytes sent per rank:
  ``(d - 1) / d * N * 4`` plain, ``(d - 1) / d * (N * bits / 8 + 4 N / block)`` quantized.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.parallel.collectives import all_gather_single, reduce_scatter_single
from mula_lightning.parallel.ledger import is_recording, record_collective, ring_bytes_sent
from mula_lightning.parallel.zero.quantization import Quantized, dequantize, pack, packed_bytes, quantize, unpack


def _record(op: str, group: Any, size: int, tin: torch.Tensor, tout: torch.Tensor, phase: str | None, tag: str):
    if is_recording():
        sent = ring_bytes_sent(op, size, tin.numel() * tin.element_size())
        if op == "all_to_all":  # the split kept for itself never leaves the rank
            sent = tin.numel() * tin.element_size() * (size - 1) // size
        record_collective(op, group, tin, tout, sent, phase=phase, tag=tag)


class WeightGather:
    """An all-gather of equal weight chunks into ``full`` (see the module docstring); call :meth:`wait`.

    Args:
        chunk: this rank's chunk (``n`` elements).
        full: the destination, ``d * n`` elements.
        group / size: the process group and its size (``size == 1``: a local copy, nothing is sent).
        positions: chunk position of each group index.
        quant: ``(bits, block_size)`` to send quantized, or ``None``.
        phase / tag: ledger labels.
        prequantized: this rank's chunk already quantized (the secondary partition), sent as it is.
    """

    def __init__(
        self,
        chunk: torch.Tensor | None,
        full: torch.Tensor,
        group: Any,
        size: int,
        positions: list[int],
        quant: tuple[int, int] | None,
        phase: str,
        tag: str,
        prequantized: Quantized | None = None,
    ) -> None:
        self.full, self.size, self.positions, self.quant = full, size, positions, quant
        self.n = full.numel() // size
        self.work = None
        self.chunks: list[Quantized] | None = None
        if quant is None or size == 1:
            self.send = chunk if size > 1 else None
            if size == 1:
                full.copy_(chunk if chunk is not None else dequantize(prequantized, full.dtype))
                return
            self.recv = torch.empty(size * self.n, dtype=full.dtype, device=full.device)
        else:
            q = prequantized if prequantized is not None else quantize(chunk, *quant)
            self.send = pack(q)
            self.recv = torch.empty(size * self.send.numel(), dtype=torch.uint8, device=full.device)
        self.work = all_gather_single(self.recv, self.send, group=group, async_op=True)
        _record("all_gather", group, size, self.send, self.recv, phase, tag)

    def wait(self) -> list[Quantized] | None:
        """Finish: write every chunk (dequantized when quantized) in place; return the quantized chunks by position."""
        if self.work is None:
            return self.chunks
        self.work.wait()
        self.work = None
        n = self.n
        if self.quant is None:
            for k, pos in enumerate(self.positions):
                self.full[pos * n : (pos + 1) * n].copy_(self.recv[k * n : (k + 1) * n])
            return None
        per = self.send.numel()
        chunks: list[Quantized | None] = [None] * self.size
        for k, pos in enumerate(self.positions):
            q = unpack(self.recv[k * per : (k + 1) * per], n, *self.quant)
            dequantize(q, out=self.full[pos * n : (pos + 1) * n])
            chunks[pos] = q
        self.chunks = chunks
        return chunks


def slice_quantized(chunks: list[Quantized], chunk_numel: int, lo: int, hi: int) -> Quantized:
    """Elements ``[lo, hi)`` of a buffer held as consecutive quantized chunks (block-aligned bounds), copied."""
    first = chunks[0]
    bits, block = first.bits, first.block_size
    payloads, scales = [], []
    for i, q in enumerate(chunks):
        s, e = max(lo, i * chunk_numel), min(hi, (i + 1) * chunk_numel)
        if s >= e:
            continue
        a, b = s - i * chunk_numel, e - i * chunk_numel
        payloads.append(q.payload[a * bits // 8 : b * bits // 8])
        scales.append(q.scales[a // block : b // block])
    return Quantized(torch.cat(payloads).clone(), torch.cat(scales).clone(), bits, block)


def reduce_scatter_chunks(
    full: torch.Tensor,
    group: Any,
    size: int,
    positions: list[int],
    quant: tuple[int, int] | None,
    tag: str,
) -> torch.Tensor:
    """Sum ``full`` (fp32, ``d * n``) over the group; return this rank's chunk ``positions[index]`` (fp32, ``n``)."""
    n = full.numel() // size
    if size == 1:
        return full.clone()
    ordered = [full[p * n : (p + 1) * n] for p in positions]  # group index k receives chunk positions[k]
    if quant is None:
        send = torch.cat(ordered)
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
        _record("reduce_scatter", group, size, send, out, "backward", tag)
        return out
    bits, block = quant
    send = torch.cat([pack(quantize(c, bits, block)) for c in ordered])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    _record("all_to_all", group, size, send, recv, "backward", tag)
    per = packed_bytes(n, bits, block)
    out = torch.zeros(n, dtype=torch.float32, device=full.device)
    for src in range(size):  # fixed source-rank order: the sum is the same on every run
        out += dequantize(unpack(recv[src * per : (src + 1) * per], n, bits, block))
    return out


def all_reduce_(x: torch.Tensor, group: Any, size: int, tag: str) -> None:
    """In-place SUM all-reduce of ``x`` (unquantized) over ``group``; nothing when ``size == 1``."""
    if size > 1:
        dist.all_reduce(x, group=group)
        _record("all_reduce", group, size, x, x, None, tag)


def all_gather_chunks(chunk: torch.Tensor, full: torch.Tensor, group: Any, size: int, positions: list[int], tag: str):
    """Blocking plain all-gather of ``chunk`` into ``full`` in chunk-position order (the post-step gather)."""
    WeightGather(chunk, full, group, size, positions, None, "step", tag).wait()
