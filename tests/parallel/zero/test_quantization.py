"""Block-wise symmetric INT8 / INT4 quantization: error bounds, ranges, packing, byte counts, bad input."""

import pytest
import torch

from mula_lightning.parallel.zero.quantization import QMAX, dequantize, pack, packed_bytes, quantize, unpack


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes, so a per-tensor scale would fail the per-block bound
    mags = torch.logspace(-4, 2, n // 64).repeat_interleave(64)
    return torch.randn(n, generator=g) * mags


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [16, 64, 256])
def test_error_within_half_step_of_each_block(bits, block):
    """Every element is reproduced within scale/2 = absmax(block) / (2 qmax) of its block (up to fp32 rounding),
    and each block's element of largest magnitude is reproduced exactly up to fp32 rounding."""
    x = _data(4096, seed=bits + block)
    q = quantize(x, bits, block)
    y = dequantize(q)
    xb, yb = x.reshape(-1, block), y.reshape(-1, block)
    absmax = xb.abs().amax(dim=1, keepdim=True)
    bound = absmax / (2 * QMAX[bits])
    err = (xb - yb).abs()
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-30)
    idx = xb.abs().argmax(dim=1, keepdim=True)
    torch.testing.assert_close(yb.gather(1, idx), xb.gather(1, idx), rtol=1e-6, atol=0)
    # the bound is tight: a uniform spread of values uses the whole half step somewhere
    assert (err / bound).max() > 0.5


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_range_and_storage(bits):
    """INT8 payloads stay in [-127, 127] one per byte; INT4 in [-7, 7] two per byte (stored q + 8 in nibbles)."""
    x = torch.randn(1024) * 10
    q = quantize(x, bits, 32)
    if bits == 8:
        assert q.payload.dtype == torch.int8 and q.payload.numel() == 1024
        assert q.payload.min() >= -127 and q.payload.max() <= 127 and (q.payload.abs() == 127).any()
    else:
        assert q.payload.dtype == torch.uint8 and q.payload.numel() == 512
        low, high = (q.payload & 15).long() - 8, (q.payload >> 4).long() - 8
        ints = torch.stack((low, high), 1).reshape(-1)
        assert ints.min() >= -7 and ints.max() <= 7 and (ints.abs() == 7).any()
        # element 2i is the low nibble of byte i
        manual = torch.round(x.reshape(-1, 32) / q.scales[:, None]).clamp(-7, 7).reshape(-1)
        assert torch.equal(ints.float(), manual)
    assert q.scales.dtype == torch.float32 and q.scales.numel() == 1024 // 32


def test_zero_blocks_are_exact_and_bf16_inputs_work():
    """An all-zero block gets scale 0 and dequantizes to exact zeros; bf16 input is quantized from its values."""
    x = torch.zeros(128)
    x[64:] = torch.linspace(-1, 1, 64)
    for bits in (8, 4):
        y = dequantize(quantize(x, bits, 64))
        assert torch.equal(y[:64], torch.zeros(64))
        xb = x.bfloat16()
        yb = dequantize(quantize(xb, bits, 64), dtype=torch.bfloat16)
        assert yb.dtype == torch.bfloat16 and (yb.float() - xb.float()).abs().max() <= 1 / (2 * QMAX[bits]) + 1e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_roundtrip_and_byte_count(bits):
    """pack() holds payload then scales in n*bits/8 + 4*n/block bytes, and unpack() restores the same values."""
    x = _data(1024, seed=3)
    q = quantize(x, bits, 64)
    raw = pack(q)
    assert raw.dtype == torch.uint8 and raw.numel() == packed_bytes(1024, bits, 64) == 1024 * bits // 8 + 4 * 16
    # an odd offset (as inside a concatenated all-to-all buffer) must still decode
    shifted = torch.cat((torch.zeros(3, dtype=torch.uint8), raw))[3:]
    back = unpack(shifted, 1024, bits, 64)
    assert torch.equal(dequantize(back), dequantize(q))


def test_bad_arguments_name_the_values():
    """Wrong bit widths, block sizes, lengths and packed sizes are refused with the offending values."""
    with pytest.raises(ValueError, match=r"bits \(3\)"):
        quantize(torch.randn(64), 3, 32)
    with pytest.raises(ValueError, match=r"numel \(65\) must be a multiple of block_size \(32\)"):
        quantize(torch.randn(65), 8, 32)
    with pytest.raises(ValueError, match=r"block_size \(7\)"):
        quantize(torch.randn(70), 8, 7)
    with pytest.raises(ValueError, match="1-D floating"):
        quantize(torch.ones(64, dtype=torch.int32), 8, 32)
    with pytest.raises(ValueError, match="72 uint8 bytes"):
        unpack(torch.zeros(10, dtype=torch.uint8), 64, 8, 32)
