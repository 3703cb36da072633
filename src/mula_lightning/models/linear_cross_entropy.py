"""Next-token cross-entropy fused with the LM head, in chunks of tokens: never the whole batch's logits at once.

Why: the plain path (``lm_head`` -> logits -> ``F.cross_entropy``) holds a (tokens, vocabulary) logits tensor, and
cross-entropy's saved log-probabilities of the same size, from the forward to the backward: at 8 x 4096 tokens and
a 50k vocabulary that is 13 GB in float32, more than a layer's activations. Here the head and the loss run one chunk
of ``chunk_tokens`` rows at a time; while a chunk's logits are at hand, their gradient (``softmax - one_hot``, scaled
by ``1 / tokens`` for the mean) goes straight through the head's two backward GEMMs, so the forward leaves the
gradients of the hidden states and of the head's weight instead of logits (Liger-Kernel's fused linear
cross-entropy; Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024, recompute instead). The
FLOPs are the plain path's (one forward GEMM, two backward GEMMs per chunk); what stays from the forward to the
backward is the head weight's gradient and the hidden states' gradient, whatever the batch. Measured on the head
alone (hidden 2048, vocabulary 50304, fp32, CPU), the peak rise of forward + backward at 512 / 1024 / 2048 / 4096
tokens: 515 / 683 / 807 / 823 MB, against 513 / 615 / 1196 / 2375 MB for the plain path (the weight's gradient,
393 MB, in both); time 0.99-1.07x the plain path's there, 1.2x at the demo model's (hidden 128, vocabulary 4096).

Precision is the plain path's: logits in the head's dtype, upcast to float32 for the softmax, the gradient cast
back to the head's dtype before its GEMMs (as autograd casts it), the weight's gradient accumulated in float32
when there is more than one chunk. Under ``no_grad`` (evaluation) or when neither input needs a gradient, only the
loss is computed, chunk by chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from mula_lightning.models.config import LOSS_BACKENDS
from mula_lightning.utils.precision import at_least_float32

__all__ = [
    "ACCELERATOR_CHUNK_ELEMENTS",
    "LOSS_BACKENDS",
    "CHUNK_ELEMENTS",
    "IGNORE_INDEX",
    "default_chunk_tokens",
    "linear_cross_entropy",
    "next_token_targets",
    "resolve_loss_backend",
]

#: logits alive at once by default on CPU: 2**25 float32 = 128 MiB (667 rows of a 50k vocabulary, 8192 of a 4k one);
#: fewer rows per chunk cost speed on CPU (256 rows of a 50k vocabulary: 0.92x the plain path), more cost memory
CHUNK_ELEMENTS = 2**25
#: the same on CUDA and XPU: 2**28 float32 = 1 GiB (5336 rows of a 50k vocabulary). A GPU runs a chunk's GEMMs and
#: elementwise passes in a fraction of a millisecond, so per-chunk launches and the float32 accumulation of the head's
#: gradient weigh more than on CPU: on one H200 (bf16, hidden 2048, 4096 tokens) a Mula-7B-A1B-like step took 0.033 s
#: with 667-row chunks, 0.030 s with 2048 and 0.029 s with 4096 (BENCHMARKS.md), and 1 GiB is little beside its memory
ACCELERATOR_CHUNK_ELEMENTS = 2**28
IGNORE_INDEX = -100
#: the ``record_function`` range around every call, for profiles (``benchmarks/step_profile.py`` reads it)
PROFILER_RANGE = "mula::linear_cross_entropy"


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position (``labels`` shifted left by one, the last position ignored): position t predicts
    ``labels[t + 1]``; :data:`IGNORE_INDEX` (-100) marks what no loss counts (transformers' rule)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def resolve_loss_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"torch"`` or ``"triton"`` (:mod:`~mula_lightning.models.cross_entropy_kernel`: a chunk's loss and gradient
    in one kernel, written over its logits in their dtype) for a head on ``device`` in ``dtype``.

    ``"auto"`` is ``"torch"`` until a GPU has measured the kernel against it (BENCHMARKS.md); ``"triton"`` asks for
    it, and is refused in one line where it cannot run (no Triton, float64, bf16 under the CPU interpreter, a device
    without a Triton backend).
    """
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"loss backend ({backend!r}) must be one of {LOSS_BACKENDS}")
    if backend != "triton":
        return "torch"
    from mula_lightning.moe.triton_experts import triton_unavailable_reason

    reason = triton_unavailable_reason(device, dtype)
    if reason is not None:
        raise ValueError(f"the Triton cross-entropy cannot compute this head's loss: {reason}")
    return "triton"


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_scale: torch.Tensor | None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row losses of one chunk (0 where ignored) and, with ``grad_scale``, ``grad_scale`` times d(sum of
    losses)/d(logits) in float32 (``softmax - one_hot`` on the rows that count, 0 on ignored ones).

    The logits are turned into log-probabilities by one fused ``log_softmax``, in place on the CPU (its kernel reads
    a row before it writes it; the results are bit-identical), then into probabilities by ``exp_``, and the rows'
    factors (ignored or not, the mean's scale) are applied in one pass: four passes over the chunk where a
    ``logsumexp``, a subtraction, ``exp_`` and two multiplications took eight and a second chunk-sized buffer
    (hidden 128, vocabulary 4096, 2048 rows, fp32, 2 threads: 24 ms against 41 ms, 16 ms of it the GEMM).

    With ``backend="triton"`` the logits stay in the head's dtype and one kernel gives the losses (float32) and writes
    the gradient over them.
    """
    if backend == "triton":
        from mula_lightning.models.cross_entropy_kernel import cross_entropy_rows_

        logits = hidden @ weight.t()
        losses = cross_entropy_rows_(logits, targets, IGNORE_INDEX, grad_scale)
        return losses, (logits if grad_scale is not None else None)
    logits = (hidden @ weight.t()).to(at_least_float32(hidden.dtype))
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    on_cpu = logits.device.type == "cpu"
    logp = torch.log_softmax(logits, dim=-1, out=logits) if on_cpu else torch.log_softmax(logits, dim=-1)
    losses = torch.where(valid, -logp.gather(1, safe).squeeze(1), 0.0)
    if grad_scale is None:
        return losses, None
    grad = logp.exp_()  # softmax, in place of the log-probabilities
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    grad.mul_((valid * grad_scale).unsqueeze(1))
    return losses, grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, reduction, chunk_tokens, backend):  # noqa: D102
        rows = hidden.shape[0]
        valid = (targets != IGNORE_INDEX).sum()
        # mean over the real tokens, folded into the gradients before they meet the head's GEMMs, as the plain path
        # scales its logits' gradient; no real token at all (a fully masked micro-batch) is a loss of 0 with zero
        # gradients, not 0/0 (which would make every gradient of the model NaN)
        acc = at_least_float32(hidden.dtype)
        if reduction == "mean":
            scale = 1.0 / valid.clamp(min=1).to(acc)
        else:
            scale = torch.ones((), dtype=acc, device=hidden.device)
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, rows, chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            wanted = scale if needs[0] or needs[1] else None
            losses, grad = _chunk_loss(h, weight, targets[start : start + chunk_tokens], wanted, backend)
            total += losses.sum()
            if grad is None:
                continue
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[start : start + chunk_tokens])
            if not needs[1]:
                continue
            if grad_weight is None:  # the first chunk; one chunk: exactly the plain path's GEMM
                grad_weight = grad.t() @ h
                if rows > chunk_tokens:
                    grad_weight = grad_weight.to(acc)  # later chunks add in float32 (bf16 weights)
            elif grad.dtype == acc:
                grad_weight.addmm_(grad.t(), h)
            else:
                grad_weight.add_(grad.t() @ h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        # the forward's gradients times the incoming one, in place: a second backward through the same graph
        # (retain_graph) finds them modified and raises rather than scaling twice
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def default_chunk_tokens(weight: torch.Tensor) -> int:
    """Rows of logits per chunk when the caller names none: :data:`ACCELERATOR_CHUNK_ELEMENTS` (CUDA, XPU) or
    :data:`CHUNK_ELEMENTS` (CPU and anything else) divided by the vocabulary (``weight``'s rows), at least one."""
    budget = ACCELERATOR_CHUNK_ELEMENTS if weight.device.type in ("cuda", "xpu") else CHUNK_ELEMENTS
    return max(1, budget // weight.shape[0])


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    backend: str = "auto",
    shifted: bool = False,
) -> torch.Tensor:
    """``causal_lm_loss(hidden @ weight.T, labels, reduction, shifted)`` without the whole logits tensor.

    Args:
        hidden: (..., T, H) final hidden states (after the last norm).
        weight: (V, H) the LM head's weight.
        labels: (..., T) token ids; position t predicts ``labels[t + 1]``; -100 is ignored.
        reduction: ``"mean"`` over the real tokens (0, with zero gradients, when every label is ignored) or ``"sum"``.
        chunk_tokens: rows of logits computed at once (default: :func:`default_chunk_tokens`).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:func:`resolve_loss_backend`).
        shifted: ``labels`` are the positions' targets already (context parallelism's ``shift_labels``).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    backend = resolve_loss_backend(backend, hidden.device, hidden.dtype)
    with record_function(PROFILER_RANGE):  # a profile can tell the fused head + loss (and its GEMMs) apart
        targets = (labels if shifted else next_token_targets(labels)).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
            with torch.no_grad():
                total = sum(
                    (_chunk_loss(flat[s : s + chunk_tokens], weight, targets[s : s + chunk_tokens], None, backend)[0]
                     .sum() for s in range(0, flat.shape[0], chunk_tokens)),
                    torch.zeros((), dtype=at_least_float32(flat.dtype), device=flat.device),
                )  # fmt: skip
            return total / (targets != IGNORE_INDEX).sum().clamp(min=1) if reduction == "mean" else total
        return _LinearCrossEntropy.apply(flat, weight, targets, reduction, chunk_tokens, backend)
