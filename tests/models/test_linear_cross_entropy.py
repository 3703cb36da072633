"""The LM head and the loss fused in chunks (``linear_cross_entropy``) against the plain path (``lm_head`` then
``causal_lm_loss``): loss, gradient of the hidden states and of the head's weight, on fresh random inputs with
ignored labels, any chunk size, both reductions; the whole model asked for the loss only against the model asked
for logits; evaluation without gradients; bad arguments named."""

from __future__ import annotations

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.models.linear_cross_entropy import (
    CHUNK_ELEMENTS,
    default_chunk_tokens,
    linear_cross_entropy,
)
from mula_lightning.models.transformer import causal_lm_loss
from mula_lightning.testing import assert_parity

B, T, H, V = 3, 7, 16, 50


def _inputs(dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, 2] = labels[1, :3] = -100  # ignored positions (padding, a masked prompt)
    grad_out = torch.rand((), generator=gen, dtype=torch.float64) + 0.5  # a loss scale, e.g. 1 / accumulation
    return hidden, weight, labels, grad_out


def _loss_and_grads(fn, hidden, weight, labels, grad_out):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    (loss * grad_out.to(loss.dtype)).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 4096])
def test_fused_loss_and_gradients_equal_the_plain_head_and_loss(dtype, reduction, chunk_tokens):
    """Chunks of 1, 5 (not dividing the 21 rows) and all rows at once give the plain path's loss and gradients: to
    rounding in float64 / float32 (the bound of the longest sum: a weight gradient sums over every row, a logit over
    the hidden size), and within bf16's rounding of the logits and gradients in bf16; ignored labels add nothing."""
    hidden, weight, labels, grad_out = _inputs(dtype, seed=chunk_tokens + 100 * (reduction == "sum"))
    plain = _loss_and_grads(lambda h, w, y: causal_lm_loss(h @ w.t(), y, reduction), hidden, weight, labels, grad_out)
    fused = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, reduction, chunk_tokens), hidden, weight, labels, grad_out
    )
    reduction_len = (B * T + H + V) * (4 if dtype == torch.bfloat16 else 1)
    for name, got, want in zip(("loss", "hidden grad", "weight grad"), fused, plain):
        if dtype == torch.bfloat16:  # logits and gradients round to bf16 on both sides, in another order
            scale = want.abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.02 * scale, msg=name)
        else:
            assert_parity(got, want, reduction_len=reduction_len, msg=name)


def test_default_chunk_follows_the_head_device_and_vocabulary():
    """Without ``chunk_tokens`` a chunk holds the CPU budget of logits on CPU (and on meta), at least one row even
    for a vocabulary beyond the budget."""
    assert default_chunk_tokens(torch.empty(50304, 8)) == CHUNK_ELEMENTS // 50304 == 667
    assert default_chunk_tokens(torch.empty(4096, 8, device="meta")) == CHUNK_ELEMENTS // 4096
    assert default_chunk_tokens(torch.empty(CHUNK_ELEMENTS + 1, 1, device="meta")) == 1


def test_without_gradients_only_the_loss_is_computed():
    """Under ``no_grad`` (validation) the chunked loss equals the plain one and builds no graph."""
    hidden, weight, labels, _ = _inputs(torch.float64, seed=3)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, "sum", chunk_tokens=4)
        expected = causal_lm_loss(hidden @ weight.t(), labels, "sum")
    assert loss.grad_fn is None
    assert_parity(loss, expected, reduction_len=B * T + H + V, msg="loss")


def test_a_second_backward_through_the_same_graph_raises():
    """The gradients computed in the forward are scaled in place by the incoming gradient; a second backward with
    ``retain_graph`` raises instead of scaling them twice."""
    hidden, weight, labels, _ = _inputs(torch.float32, seed=4)
    loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bad_arguments_are_named():
    hidden, weight, labels, _ = _inputs(torch.float32, seed=5)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied embeddings"])
def test_the_model_asked_for_the_loss_only_trains_like_the_model_asked_for_logits(tied):
    """``MulaForCausalLM(..., return_logits=False)`` (what MulaLM trains and validates with) returns no logits and
    the same loss, auxiliary loss and gradient of every parameter as the default call, in float64, in chunks of 8
    rows; with tied embeddings the shared matrix gets both the head's and the lookup's gradient."""
    config = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=32, num_experts=4, top_k=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.set_default_dtype(torch.float64)
    try:
        model = MulaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.loss_chunk_tokens = 8
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
    labels = ids.clone()
    labels[1, 5:] = -100
    results = []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, return_logits=return_logits)
        (out.loss + out.aux_loss).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert plain.logits is not None and fused.logits is None
    assert_parity(fused.loss, plain.loss, reduction_len=200, msg="loss")
    assert_parity(fused.aux_loss, plain.aux_loss, reduction_len=200, msg="aux loss")
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        assert_parity(fused_grads[name], grad, reduction_len=400, msg=name)


@pytest.mark.parametrize("chunk_tokens", [2, 4096])
def test_wholly_masked_labels_give_a_zero_loss_and_zero_gradients(chunk_tokens):
    """A micro-batch whose labels are all -100 (a prompt-only sample, a padding row): the fused head + loss and the
    plain one give a loss of 0 and finite, zero gradients for the hidden states and the head (with and without
    gradients asked for). Before, the mean over no real token was 0/0: the fused loss made every gradient NaN."""
    hidden, weight, labels, grad_out = _inputs(torch.float32, seed=5)
    labels = torch.full_like(labels, -100)
    for fn in (
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk_tokens),
        lambda h, w, y: causal_lm_loss(h @ w.t(), y),
    ):
        loss, grad_hidden, grad_weight = _loss_and_grads(fn, hidden, weight, labels, grad_out)
        assert loss.item() == 0.0
        assert torch.equal(grad_hidden, torch.zeros_like(hidden)) and torch.equal(grad_weight, torch.zeros_like(weight))
        with torch.no_grad():
            assert fn(hidden, weight, labels).item() == 0.0
