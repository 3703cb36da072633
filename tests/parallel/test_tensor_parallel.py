"""Tensor parallelism of a Mula model against one process: the loss, every gradient and the weights after AdamW
steps, in float64, on dense and MoE models with GQA and the OLMoE q/k norm; local shapes are 1/tp of each weight;
the vocabulary-parallel loss equals the full cross-entropy; sizes tp does not divide are named."""

import pytest
import torch
import torch.nn.functional as F

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.transformer import causal_lm_loss
from mula_lightning.parallel.tensor_parallel import check_tensor_parallel
from mula_lightning.testing import assert_parity, run_pooled_test

DTYPE = torch.float64
H, SEQ, V, FF = 32, 12, 96, 16
# Rounded operations feeding one gradient element, forward and backward (x2): per layer, the dots of q / k / v and
# o (4 H), attention over SEQ, the MLP's gate / up (2 H) and down (FF); the vocabulary's softmax; the batch's tokens.
# Step s builds on s earlier updates, each within the bound: (s + 1) x GRAD_LEN at step s.
GRAD_LEN = 2 * (2 * (6 * H + SEQ + FF) + V + 2 * SEQ)


def _config(kind, sequence_parallel=False):
    common = dict(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=FF)
    if kind == "dense":
        return MulaConfig.from_name("mula-tiny-dense", **common)
    # a z-loss too: under sequence parallelism both router losses must be the whole sequence's
    return MulaConfig.from_name("mula-tiny-moe", **common, num_experts=4, top_k=2, moe_impl="fast", z_loss_coef=1e-3)


def _batch(step):
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(step))


def _train(model, steps, lr=1e-2, sum_plain_grads=False):
    """Loss (with the MoE aux loss) and gradients of each step, after which torch's AdamW steps. With
    ``sum_plain_grads`` the gradients of plain (not DTensor) parameters are summed over the ranks first: under
    sequence parallelism each tp rank's router and experts saw only its tokens."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, grads = [], []
    for step in range(steps):
        out = model(_batch(step), labels=_batch(step))
        (out.loss + out.aux_loss).backward()
        if sum_plain_grads:
            for p in model.parameters():
                if not hasattr(p, "full_tensor") and p.grad is not None:
                    dist.all_reduce(p.grad)
        losses.append(out.loss.item())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: _full(p.detach()) for n, p in model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _tp_rank(rank, world_size, kind, steps, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from mula_lightning.parallel.tensor_parallel import apply_tensor_parallel

    model = init_weights(MulaForCausalLM(_config(kind, sp)), seed=0).to(DTYPE)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, sequence_parallel=sp)
    residual = []
    model.model.layers[1].register_forward_pre_hook(lambda m, args: residual.append(tuple(args[0].shape)))
    attn = model.model.layers[0].self_attn
    local = {
        "q_proj": tuple(attn.q_proj.weight.to_local().shape),
        "k_proj": tuple(attn.k_proj.weight.to_local().shape),
        "o_proj": tuple(attn.o_proj.weight.to_local().shape),
        "q_norm": tuple(attn.q_norm.weight.to_local().shape),
        "embed": tuple(model.model.embed_tokens.weight.to_local().shape),
        "lm_head": tuple(model.lm_head.weight.to_local().shape),
    }
    trained = _train(model, steps, sum_plain_grads=sp)
    return trained, {**local, "residual": residual[0]}


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_parallel_matches_one_process_over_adamw_steps(kind, sp):
    """TP=2 (GQA 4 query / 2 key-value heads, q/k norm, untied vocabulary-parallel head), with and without sequence
    parallelism: every rank's loss and full gradients of 3 steps and the weights after 3 AdamW steps equal one
    process in float64 (under SP, router and expert gradients summed over tp first); each rank holds 1/tp of every
    sharded weight."""
    steps, tp = 3, 2
    reference = init_weights(MulaForCausalLM(_config(kind, sp)), seed=0).to(DTYPE)
    ref_losses, ref_grads, ref_params = _train(reference, steps)
    for (losses, grads, params), local in run_pooled_test(_tp_rank, tp, kind=kind, steps=steps, sp=sp, timeout=240):
        assert local == {
            "q_proj": (H // tp, H), "k_proj": (H // 2 // tp, H), "o_proj": (H, H // tp), "q_norm": (H // tp,),
            "embed": (V // tp, H), "lm_head": (V // tp, H), "residual": (2, SEQ // tp if sp else SEQ, H),
        }  # fmt: skip
        for step in range(steps):
            bound = (step + 1) * GRAD_LEN
            assert_parity(torch.tensor(losses[step]), torch.tensor(ref_losses[step]), reduction_len=bound)
            # rounding enters through the activations every gradient shares, so an element that is a small sum of
            # cancelling terms (an expert's gradient) carries errors of the step's largest gradient, not its own
            scale = max(g.abs().max().item() for g in ref_grads[step].values())
            for name, g in ref_grads[step].items():
                assert_parity(grads[step][name], g, reduction_len=bound, scale=scale, msg=f"step {step} grad {name}")
        for name, p in ref_params.items():
            assert_parity(params[name], p, reduction_len=steps * GRAD_LEN, scale=1.0, msg=f"param {name}")


def _loss_rank(rank, world_size, reduction, masked=False):
    from mula_lightning.parallel.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 12, generator=g, dtype=DTYPE)
    labels = torch.randint(0, 12, (3, 7), generator=g)
    labels[0, 2] = labels[2, 5] = -100
    if masked:
        labels.fill_(-100)
    part = 12 // world_size
    local = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, reduction, vocab_start=rank * part, group=None)
    weights = torch.randn(loss.shape, generator=g, dtype=DTYPE)
    (loss * weights).sum().backward()
    full = logits.clone().requires_grad_()
    expected = causal_lm_loss(full, labels, reduction)
    (expected * weights).sum().backward()
    return loss.detach(), expected.detach(), local.grad, full.grad[..., rank * part : (rank + 1) * part]


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocabulary_parallel_cross_entropy_equals_the_full_one(reduction):
    """3 ranks each holding a third of the vocabulary: the loss (ignored labels included) and each rank's slice of
    the logits' gradient equal the full cross-entropy's, without any rank seeing the other slices."""
    for loss, expected, grad, expected_grad in run_pooled_test(_loss_rank, 3, reduction=reduction):
        assert_parity(loss, expected, reduction_len=24)
        assert_parity(grad, expected_grad, reduction_len=24)


@pytest.mark.distributed
def test_vocabulary_parallel_cross_entropy_of_wholly_masked_labels_is_zero():
    """Every label ignored (-100): the vocabulary-parallel mean is 0 with zero gradients on every rank, as the full
    cross-entropy's; before, it was 0/0 and every gradient NaN."""
    for loss, expected, grad, expected_grad in run_pooled_test(_loss_rank, 2, reduction="mean", masked=True):
        assert loss.item() == 0.0 and expected.item() == 0.0
        assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(expected_grad, torch.zeros_like(grad))


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (
            dict(num_heads=6, num_kv_heads=6, head_dim=8),
            r"tp_size \(4\) must divide num_heads \(6\), num_kv_heads \(6\)",
        ),
        (dict(num_heads=8, num_kv_heads=2), r"must divide num_kv_heads \(2\)$"),
        (dict(vocab_size=90), r"must divide vocab_size \(90\)"),
        (dict(intermediate_size=18), r"must divide intermediate_size \(18\)"),
        (dict(tie_word_embeddings=True), r"tie_word_embeddings=True is not supported"),
    ],
)
def test_sizes_tensor_parallelism_does_not_divide_are_named(overrides, fragment):
    """Each bad size raises one ValueError naming tp and the value, before any process group exists."""
    sizes = dict(num_heads=8, num_kv_heads=4, hidden_size=64, vocab_size=96, intermediate_size=32)
    config = MulaConfig.from_name("mula-tiny-dense", **{**sizes, **overrides})
    with pytest.raises(ValueError, match=fragment):
        check_tensor_parallel(config, 4)


def test_cross_entropy_reference_is_torchs():
    """The one-process loss the parity tests compare with is torch's cross-entropy of the shifted labels."""
    logits = torch.randn(2, 5, 7, dtype=DTYPE)
    labels = torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert torch.allclose(causal_lm_loss(logits, labels), expected)


def _ledger_rank(rank, world_size, kind, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from mula_lightning.parallel.ledger import CommLedger, record_functional_collectives
    from mula_lightning.parallel.tensor_parallel import apply_tensor_parallel

    model = init_weights(MulaForCausalLM(_config(kind, sp)), seed=0).to(DTYPE)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    apply_tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)), sequence_parallel=sp)
    with CommLedger() as ledger, record_functional_collectives():
        out = model(_batch(0), labels=_batch(0))
        out.loss.backward()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad or p.grad is None}
    return [(r.op, r.tag, r.bytes_in, r.bytes_sent, r.level) for r in ledger.records], frozen


#: norms the ledger test freezes before the plan: frozen after it too (torch's SequenceParallel re-registers them)
FROZEN = {"model.norm.weight", "model.layers.0.input_layernorm.weight",
          "model.layers.1.post_attention_layernorm.weight"}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_parallel_collectives_move_the_closed_form_bytes(kind, sp):
    """One forward + backward at TP=2, every collective recorded (DTensor's through the dispatch recorder): per
    tensor-parallel block (attention, dense MLP) one activation all-reduce forward and one backward (SP: a
    reduce-scatter and an all-gather each way), plus the embedding's and the LM head input's; the q/k norm's two
    sums of squares per layer each way and the loss's three per-token all-reduces; under SP one all-reduce of the
    router statistics per MoE layer; ring bytes as in the ledger. Norms frozen before the plan stay frozen (no
    gradient) with and without SP."""
    d, tokens, layers, s = 2, 2 * SEQ, 2, DTYPE.itemsize
    blocks = layers + (layers if kind == "dense" else 0)  # attention everywhere, MLP in dense layers
    activation = tokens * H * s
    expected = {}
    if sp:  # the residual stream is split: reduce-scatter out of row-wise, all-gather into column-wise
        expected[("reduce_scatter", "dtensor")] = (2 * (1 + blocks), (d - 1) * activation // d)
        expected[("all_gather", "dtensor")] = (2 * (1 + blocks), (d - 1) * activation // d)
    else:
        expected[("all_reduce", "dtensor")] = (2 * (1 + blocks), 2 * (d - 1) * activation // d)
    per_token = 2 * (d - 1) * tokens * s // d
    expected[("all_reduce", "tp.qk_norm")] = (2 * layers, per_token)
    expected[("all_reduce", "tp.qk_norm.backward")] = (2 * layers, per_token)
    for tag in ("tp.ce.max", "tp.ce.target", "tp.ce.sum_exp"):
        expected[("all_reduce", tag)] = (1, per_token)
    if sp and kind == "moe":  # each router's sequence statistics: counts, probability sums, lse^2, tokens (2E + 2)
        expected[("all_reduce", "tp.sp.router")] = (layers, 2 * (d - 1) * (2 * 4 + 2) * s // d)
    for records, frozen in run_pooled_test(_ledger_rank, d, kind=kind, sp=sp, timeout=240):
        assert frozen == FROZEN
        got = {}
        for op, tag, _, sent, level in records:
            count, sizes = got.get((op, tag), (0, set()))
            got[(op, tag)] = (count + 1, sizes | {sent})
            assert level != "tp" and level is not None  # hardware levels, as for every other group
        assert {k: (c, sizes) for k, (c, sizes) in got.items()} == {k: (c, {b}) for k, (c, b) in expected.items()}
