"""Block-wise symmetric INT8 / INT4 quantization in plain torch (the ZeRO++ qwZ / qgZ number formats).

A flat tensor is cut into blocks of ``block_size`` consecutive elements; every block gets one fp32 scale
``absmax / qmax`` and its elements become integers ``round(x / scale)`` clamped to ``[-qmax, qmax]``:

=====  ======  ================================  =====================================================
bits   qmax    payload                           bytes for ``n`` elements (``n`` a block multiple)
=====  ======  ================================  =====================================================
8      127     ``int8``, one element per byte    ``n + 4 * n / block_size``
4      7       ``uint8``, two elements per byte  ``n / 2 + 4 * n / block_size``
=====  ======  ================================  =====================================================

INT4 packing: element ``2i`` goes to the low nibble and ``2i + 1`` to the high nibble of byte ``i``, each stored
as ``q + 8`` (so ``[-7, 7]`` becomes ``[1, 15]``). A block of zeros gets scale 0 and dequantizes to exact zeros.

Error bound (tested): for every element, ``|x - dequantize(quantize(x))| <= scale / 2 = absmax(block) / (2 qmax)``
(plus fp32 rounding), and the element of largest magnitude in a block is reproduced up to fp32 rounding.

For communication a quantized chunk travels as one ``uint8`` tensor, payload first and the scales' raw bytes
after (:func:`pack` / :func:`unpack`), so one collective moves both and the ledger counts both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QMAX", "Quantized", "dequantize", "pack", "packed_bytes", "quantize", "unpack"]

#: Largest magnitude of the symmetric integer range per bit width.
QMAX = {8: 127, 4: 7}


def _check(bits: int, block_size: int, numel: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits ({bits}) must be 8 or 4")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block_size ({block_size}) must be an even number >= 2")
    if numel % block_size:
        raise ValueError(f"numel ({numel}) must be a multiple of block_size ({block_size}); pad first")


@dataclass
class Quantized:
    """A block-quantized flat tensor.

    Attributes:
        payload: ``int8`` (8 bits) or packed ``uint8`` (4 bits) integers.
        scales: fp32, one per block.
        bits: 8 or 4.
        block_size: elements per block.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    bits: int
    block_size: int

    @property
    def numel(self) -> int:
        """Elements represented (a multiple of ``block_size``)."""
        return self.scales.numel() * self.block_size

    def nbytes(self) -> int:
        """Bytes held (payload and scales), from the tensors' storage sizes as seen by this view."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * 4


def packed_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of :func:`pack` for ``numel`` elements (``numel`` a multiple of ``block_size``)."""
    _check(bits, block_size, numel)
    return numel * bits // 8 + 4 * (numel // block_size)


@torch.no_grad()
def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize a flat tensor block-wise and symmetrically (see the module docstring).

    Args:
        x: 1-D floating tensor whose length is a multiple of ``block_size``.
        bits: 8 (INT8 in [-127, 127]) or 4 (INT4 in [-7, 7], two per byte).
        block_size: elements sharing one fp32 scale.
    """
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"quantize expects a 1-D floating tensor, got shape {tuple(x.shape)} and dtype {x.dtype}")
    _check(bits, block_size, x.numel())
    qmax = QMAX[bits]
    blocks = x.float().reshape(-1, block_size)
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    if bits == 8:
        return Quantized(q, scales, bits, block_size)
    nibbles = (q + 8).to(torch.uint8).reshape(-1, 2)
    payload = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized(payload, scales, bits, block_size)


@torch.no_grad()
def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values a :class:`Quantized` stands for, as ``dtype`` (written into ``out`` when given)."""
    if q.bits == 8:
        ints = q.payload.view(torch.int8).float()
    else:
        low = (q.payload & 0x0F).to(torch.int16) - 8
        high = (q.payload >> 4).to(torch.int16) - 8
        ints = torch.stack((low, high), dim=1).reshape(-1).float()
    values = (ints.reshape(-1, q.block_size) * q.scales[:, None]).reshape(-1)
    if out is None:
        return values.to(dtype)
    out.copy_(values)
    return out


def pack(q: Quantized) -> torch.Tensor:
    """One ``uint8`` tensor: the payload bytes, then the fp32 scales' bytes (what travels in a collective)."""
    return torch.cat((q.payload.view(torch.uint8), q.scales.contiguous().view(torch.uint8)))


def unpack(raw: torch.Tensor, numel: int, bits: int, block_size: int) -> Quantized:
    """Inverse of :func:`pack` for a chunk of ``numel`` elements."""
    expected = packed_bytes(numel, bits, block_size)
    if raw.numel() != expected or raw.dtype != torch.uint8:
        got = f"{raw.numel()} {raw.dtype}"
        raise ValueError(f"a packed chunk of {numel} elements has {expected} uint8 bytes, got {got}")
    payload_bytes = numel * bits // 8
    payload = raw[:payload_bytes]
    if bits == 8:
        payload = payload.view(torch.int8)
    scales = raw[payload_bytes:].clone().view(torch.float32)  # clone: the scales' offset may be misaligned
    return Quantized(payload, scales, bits, block_size)
