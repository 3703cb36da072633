"""DeepSeek-V3's complementary sequence-wise balance loss against a slow, sequence-by-sequence rule on fresh random
inputs: its value and the router-weight gradient (float64), with softmax scores and with sigmoid scores, groups and a
selection bias; the block adds it to its auxiliary loss with its coefficient; sequences that do not split evenly are
named. (Under sequence parallelism, where each rank holds part of every sequence, it is checked by the tensor-parallel
parity run of ``tests/strategies/test_epso_tensor_parallel.py``.)"""

import pytest
import torch

from mula_lightning.moe import MoEConfig
from mula_lightning.moe.block import FastSparseMoEBlock
from mula_lightning.moe.router import Router, sequence_balance_loss
from mula_lightning.testing import assert_parity

H, E, K = 16, 8, 2

OPTIONS = {
    "softmax": dict(seq_aux_loss_coef=1.0),
    "sigmoid, groups, bias": dict(seq_aux_loss_coef=1.0, score_function="sigmoid", n_group=4, topk_group=2,
                                  expert_bias=True),
}  # fmt: skip


def _slow_rule(probs_SE, indices_SK, num_sequences):
    """Per sequence: f_e = E / (K T) x (pairs of the sequence routed to e), P_e = mean probability of e over the
    sequence's tokens; the mean over sequences of sum_e f_e P_e."""
    length = probs_SE.shape[0] // num_sequences
    losses = []
    for b in range(num_sequences):
        tokens = range(b * length, (b + 1) * length)
        total = 0.0
        for e in range(E):
            count = sum(int(indices_SK[t, k] == e) for t in tokens for k in range(K))
            mean_prob = sum(probs_SE[t, e] for t in tokens) / length
            total = total + E / (K * length) * count * mean_prob
        losses.append(total)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("num_sequences", [1, 3])
def test_loss_matches_the_sequence_by_sequence_rule(name, num_sequences):
    """The router's sequence-wise loss equals the slow rule (value and router-weight gradient), the probabilities
    being the scores normalised to sum to one, the choices the router's (bias included)."""
    config = MoEConfig(hidden_size=H, intermediate_size=8, num_experts=E, top_k=K, **OPTIONS[name])
    g = torch.Generator().manual_seed(num_sequences)
    router = Router.from_config(config).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g, dtype=torch.float64))
        if router.has_expert_bias:
            router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    x = torch.randn(num_sequences * 7, H, generator=g, dtype=torch.float64)
    out = router(x, num_sequences)
    (grad,) = torch.autograd.grad(out.seq_balance_loss, router.weight)
    weight = router.weight.detach().clone().requires_grad_(True)
    logits = x @ weight.T
    scores = torch.softmax(logits, -1) if config.score_function == "softmax" else logits.sigmoid()
    expected = _slow_rule(scores / scores.sum(-1, keepdim=True), out.indices_SK, num_sequences)
    (expected_grad,) = torch.autograd.grad(expected, weight)
    assert_parity(out.seq_balance_loss.detach(), expected.detach(), reduction_len=7 * E, msg=f"{name} loss")
    assert_parity(grad, expected_grad, reduction_len=7 * num_sequences * (H + E), msg=f"{name} grad")


def test_block_weighs_it_into_the_auxiliary_loss():
    """``aux_loss = aux_loss_coef x load_balance + z_loss_coef x z + seq_aux_loss_coef x sequence-wise``, with one
    sequence per batch row; off (``seq_aux_loss_coef`` 0) it is not computed at all."""
    config = MoEConfig(hidden_size=H, intermediate_size=8, num_experts=E, top_k=K, seq_aux_loss_coef=0.25)
    torch.manual_seed(0)
    block = FastSparseMoEBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    x = torch.randn(4, 5, H)
    _, aux = block.forward_with_aux(x)
    logits = x.reshape(-1, H) @ block.gate.weight.T
    probs = torch.softmax(logits, -1)
    seq = sequence_balance_loss(probs, torch.topk(probs, K)[1], 4)
    torch.testing.assert_close(aux.seq_balance_loss, seq)
    expected = 0.01 * aux.load_balance_loss + 0.001 * aux.z_loss + 0.25 * seq
    torch.testing.assert_close(aux.aux_loss, expected)
    plain = FastSparseMoEBlock(MoEConfig(hidden_size=H, intermediate_size=8, num_experts=E, top_k=K))
    assert plain.forward_with_aux(x)[1].seq_balance_loss is None


def test_uneven_sequences_and_bad_coefficients_are_named():
    """Tokens that do not split into the given sequences, and a negative coefficient, raise naming the values."""
    with pytest.raises(ValueError, match=r"10 tokens do not split into 3 sequences"):
        sequence_balance_loss(torch.rand(10, E), torch.zeros(10, K, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"seq_aux_loss_coef \(-0.1\) must be a finite number >= 0"):
        MoEConfig(hidden_size=H, intermediate_size=8, num_experts=E, top_k=K, seq_aux_loss_coef=-0.1)
