"""The Triton loss kernel of the fused LM head + cross-entropy (``linear_cross_entropy(..., backend="triton")``) against
the plain float64 path (head GEMM, ``F.cross_entropy``), on the CPU under Triton's interpreter: the loss and the
gradients of the hidden states and of the head's weight, float32 and float16, a vocabulary that is no multiple of the
kernel's column block and spans two of them, several chunks, ignored targets, a fully ignored batch and the ``"sum"``
reduction; the kernel compiled for an H100 without a GPU; what it cannot serve refused in one line."""

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.models.linear_cross_entropy import linear_cross_entropy, next_token_targets

pytest.importorskip("triton")

#: (rtol, atol as a fraction of the reference's largest magnitude): float16 rounds the logits and the gradient once
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2e-3)}


def _plain(hidden, weight, labels, reduction):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits, next_token_targets(labels).reshape(-1), reduction=reduction, ignore_index=-100)


def _compare(dtype, rows=2, tokens=9, hidden_size=24, vocab=1500, chunk=7, reduction="mean", ignore=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, tokens, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    labels = torch.randint(0, vocab, (rows, tokens), generator=g)
    if ignore is not None:
        labels[ignore] = -100
    h, w = hidden.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, reduction=reduction, chunk_tokens=chunk, backend="triton")
    loss.backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = _plain(h64, w64, labels, reduction)
    want.backward()
    rtol, atol = TOLERANCE[dtype]
    for got, ref, what in ((loss, want, "loss"), (h.grad, h64.grad, "hidden grad"), (w.grad, w64.grad, "weight grad")):
        scale = max(ref.abs().max().item(), 1e-6)
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * scale, msg=what)
    return loss, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_loss_and_gradients_match_the_plain_path(dtype):
    """Two batches of 9 positions in chunks of 7 rows, a 1500-token vocabulary (two column blocks, the second
    partial), some targets ignored: the loss and both gradients equal the plain float64 path's."""
    _compare(dtype, ignore=(0, slice(2, 5)))


def test_sum_reduction_one_chunk_and_a_fully_ignored_batch():
    """``"sum"`` over one chunk equals the plain path; a batch whose every target is ignored has loss 0 and zero
    gradients (no 0/0)."""
    _compare(torch.float32, reduction="sum", chunk=64, vocab=300)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((2, 5), -100), chunk_tokens=4, backend="triton")
    loss.backward()  # the plain path's mean over no token is NaN
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_evaluation_computes_the_loss_alone():
    """Under ``no_grad`` the kernel computes the losses without writing a gradient: the loss equals the plain path."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(1, 11, 16, generator=g), torch.randn(200, 16, generator=g)
    labels = torch.randint(0, 200, (1, 11), generator=g)
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, backend="triton")
    torch.testing.assert_close(got.double(), _plain(hidden.double(), weight.double(), labels, "mean"))


@pytest.mark.parametrize("bad", [-1, 300], ids=["padding -1", "the vocabulary size"])
def test_a_target_outside_the_vocabulary_never_gives_a_finite_loss(bad):
    """Review item (issue 71): a label outside [0, V) other than -100 (``-1`` padding, a token id of a larger
    tokenizer) made the kernel read another row's logit and give a finite wrong loss where the torch path raises.
    Now that row's loss is NaN (the mean, and its gradient, with it) under training and evaluation; the torch path
    raises on the same labels, and the kernel's other rows are unchanged (per-row losses against the plain path)."""
    from mula_lightning.models.cross_entropy_kernel import cross_entropy_rows_

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 6, 16, generator=g)
    weight = torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 300, (2, 6), generator=g)
    labels[1, 3] = bad
    with pytest.raises((IndexError, RuntimeError)):
        _plain(hidden, weight, labels, "mean")
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, chunk_tokens=4, backend="triton")
    loss.backward()
    assert loss.isnan() and h.grad.isnan().any()
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, backend="triton").isnan()
    logits = hidden.reshape(-1, 16) @ weight.t()
    targets = torch.tensor([5, bad, -100, 7])
    per_row = cross_entropy_rows_(logits[:4].contiguous(), targets, -100, None)
    want = F.cross_entropy(logits[[0, 3]].double(), targets[[0, 3]], reduction="none")
    assert per_row[1].isnan() and per_row[2] == 0.0
    torch.testing.assert_close(per_row[[0, 3]].double(), want, rtol=1e-5, atol=1e-6)


def test_kernel_compiles_for_an_h100_without_a_gpu():
    """The kernel builds for sm_90 with bf16 logits, with and without the gradient pass."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mula_lightning.models.cross_entropy_kernel import _kernel

    signature = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "losses_ptr": "*fp32", "scale_ptr": "*fp32",
                 "n_cols": "i32", "stride": "i32", "ignore_index": "i32", "WRITE_GRAD": "constexpr",
                 "BLOCK_COLS": "constexpr"}  # fmt: skip
    for write in (True, False):
        source = ASTSource(_kernel(False), signature, constexprs={"WRITE_GRAD": write, "BLOCK_COLS": 1024})
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def test_what_the_kernel_cannot_serve_is_refused_in_one_line():
    """float64, or bf16 under the CPU interpreter: one ``ValueError`` naming why; an unknown backend is named too;
    ``"auto"`` keeps the torch path (no GPU measurement of the kernel yet)."""
    from mula_lightning.models.linear_cross_entropy import resolve_loss_backend

    hidden, weight, labels = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64), None
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"Triton cross-entropy cannot .* float32 and float16 only, not torch\.f"):
        linear_cross_entropy(hidden, weight, labels, backend="triton")
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_loss_backend("triton", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"loss backend \('liger'\) must be one of"):
        linear_cross_entropy(hidden, weight, labels, backend="liger")
    assert resolve_loss_backend("auto", torch.device("cpu"), torch.float32) == "torch"


def test_a_mula_model_with_both_triton_backends_matches_the_default():
    """``MulaConfig(experts_backend="triton", loss_backend="triton")``: a tiny MoE's loss, auxiliary loss and every
    parameter's gradient equal the same model's with the default backends (float32, within its rounding)."""
    from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
    from mula_lightning.testing.fabric_run import tiny_moe_config

    config = tiny_moe_config()
    triton_config = MulaConfig(**{**config.to_dict(), "experts_backend": "triton", "loss_backend": "triton"})
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    results = []
    for cfg in (config, triton_config):
        model = init_weights(MulaForCausalLM(cfg), seed=0)
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        results.append((out.loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_t, grads_t) = results
    torch.testing.assert_close(loss_t, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_t[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)
