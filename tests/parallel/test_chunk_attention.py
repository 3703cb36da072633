"""The attention of one query chunk over the keys up to its own (:mod:`mula_lightning.parallel.chunk_attention`)
against the rows of the whole sequence's causal attention, forward and every gradient, on fresh random inputs."""

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.parallel.chunk_attention import causal_chunk_mask, chunks_attention


def test_the_chunk_mask_is_the_causal_mask_of_its_rows():
    """Query chunk j's mask over chunks 0..j is the rows of the whole sequence's causal mask at its positions."""
    c, j = 3, 2
    whole = torch.ones(4 * c, 4 * c, dtype=torch.bool).tril()
    assert torch.equal(causal_chunk_mask(c, j), whole[j * c : (j + 1) * c, : (j + 1) * c])


def _case(dtype, heads, kv_heads, seq, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((2, heads, seq, 8), generator=g, dtype=dtype)
    k = torch.randn((2, kv_heads, seq, 8), generator=g, dtype=dtype)
    v = torch.randn((2, kv_heads, seq, 8), generator=g, dtype=dtype)
    return q, k, v


def _run(fn, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kernel", ["flash", "sdpa"])
@pytest.mark.parametrize("chunks", [(0,), (1,), (3,), (0, 3), (1, 2), (2, 0)], ids=str)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_chunks_equal_their_rows_of_the_whole_causal_attention(kernel, chunks, dtype, tol, heads, kv_heads):
    """The chunks' output and the gradients of their queries and of every key and value equal those of the whole
    sequence's causal SDPA restricted to the chunks' rows (the other queries' rows given no gradient), for the merged
    flash kernel and the masked SDPA, grouped-query heads included; the output is laid out token-major, as SDPA's."""
    c, seq = 5, 20
    q, k, v = _case(dtype, heads, kv_heads, seq, seed=sum(chunks) + heads + kv_heads)
    rows = torch.cat([torch.arange(j * c, (j + 1) * c) for j in chunks])
    grad = torch.randn((2, heads, len(rows), 8), generator=torch.Generator().manual_seed(5), dtype=dtype)
    gqa = heads != kv_heads

    def whole(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)[:, :, rows]

    def split(q, k, v):
        out = chunks_attention(q[:, :, rows], k, v, chunks, enable_gqa=gqa, kernel=kernel)
        assert out.transpose(1, 2).is_contiguous()
        return out

    for got, expected in zip(_run(split, q, k, v, grad), _run(whole, q, k, v, grad)):
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_without_gradients_and_bad_shapes():
    """Under no_grad the flash path gives the masked SDPA's output; too few keys for a chunk, queries that do not
    split into the chunks, query heads over fewer key heads without enable_gqa and an unknown kernel are refused,
    naming them."""
    q, k, v = _case(torch.float64, 2, 2, 12, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(chunks_attention(q[:, :, 8:], k, v, (2,)), chunks_attention(q[:, :, 8:], k, v,
                                   (2,), kernel="sdpa"))  # fmt: skip
    with pytest.raises(ValueError, match="chunk 3 of 4 queries needs 16 keys, got 12"):
        chunks_attention(q[:, :, 8:], k, v, (3,))
    with pytest.raises(ValueError, match="4 queries do not split into the 3 chunks"):
        chunks_attention(q[:, :, 8:], k, v, (0, 1, 2))
    with pytest.raises(ValueError, match="need enable_gqa=True"):
        chunks_attention(q[:, :, 8:], k[:, :1], v[:, :1], (2,))
    with pytest.raises(ValueError, match="kernel"):
        chunks_attention(q[:, :, 8:], k, v, (2,), kernel="ring")
