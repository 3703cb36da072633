"""Muon with its AdamW split on one device (:mod:`mula_lightning.optim.muon`) against ``torch.optim.Muon`` per
matrix (each expert's matrices as their own 2-D parameters) and ``torch.optim.AdamW`` for the rest."""

import pytest
import torch

from mula_lightning.models import PRESETS, MulaConfig, MulaForCausalLM
from mula_lightning.optim.muon import (
    MuonAdamW,
    adjusted_lr,
    muon_param_groups,
    newton_schulz,
    newton_schulz_flops,
)


def _tiny_model(dtype=torch.float64, seed=0, **overrides):
    config = {**PRESETS["mula-tiny-moe"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 24,
              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "num_experts": 4, **overrides}  # fmt: skip
    torch.manual_seed(seed)
    return MulaForCausalLM(MulaConfig(**config)).to(dtype)


def _float64_zeropower(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration as torch writes it, without its cast to bfloat16 (the oracle of
    the float64 parity checks)."""
    a, b, c = ns_coefficients
    x = grad.double()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class TorchReference:
    """``torch.optim.Muon`` on every Muon matrix (an expert tensor as one 2-D leaf per expert) and
    ``torch.optim.AdamW`` on the rest of ``model``, driven with the model's gradients."""

    def __init__(self, model, lr, weight_decay, betas, eps, **muon):
        groups = muon_param_groups(model)
        self.model = model
        self.pairs = []  # (model parameter, its 2-D leaves)
        for p in groups[0]["params"]:
            leaves = [torch.nn.Parameter(m.detach().clone()) for m in (p.unbind(0) if p.ndim == 3 else [p])]
            self.pairs.append((p, leaves))
        self.muon = torch.optim.Muon(
            [leaf for _, leaves in self.pairs for leaf in leaves], lr=lr, weight_decay=weight_decay, **muon
        )
        self.adamw = torch.optim.AdamW(groups[1]["params"], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    @torch.no_grad()
    def step(self):
        for p, leaves in self.pairs:
            grads = p.grad.unbind(0) if p.ndim == 3 else [p.grad]
            for leaf, g, value in zip(leaves, grads, p.unbind(0) if p.ndim == 3 else [p]):
                leaf.copy_(value)
                leaf.grad = g.clone()
        self.muon.step()
        self.adamw.step()
        for p, leaves in self.pairs:
            p.copy_(torch.stack(leaves) if p.ndim == 3 else leaves[0])


def _train(model, step, tokens):
    losses = []
    for batch in tokens:
        model.zero_grad(set_to_none=True)
        loss = model(batch, labels=batch).loss
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def test_the_split_puts_every_hidden_matrix_under_muon_and_the_rest_under_adamw():
    """Muon: attention projections, each expert tensor, shared experts and dense MLP matrices of the layers; AdamW:
    embeddings, LM head, norms, routers and the shared-expert gate vector (a 1 x H matrix)."""
    model = _tiny_model(shared_experts=1, shared_expert_gate=True, moe_layers=[1])
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = ([names[id(p)] for p in g["params"]] for g in muon_param_groups(model))
    assert set(muon) == {
        n
        for n in names.values()
        if any(k in n for k in ("_proj", "experts.")) and "shared_expert_gate" not in n and "norm" not in n
    }
    assert "model.layers.1.mlp.experts.gate_up_proj" in muon and "model.layers.0.mlp.gate_proj.weight" in muon
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.shared_expert_gate.weight", "model.norm.weight"} <= set(adamw)  # fmt: skip
    assert all("norm" in n or n in {"model.embed_tokens.weight", "lm_head.weight"} or "gate." in n for n in adamw)


def test_muon_adamw_equals_torch_muon_per_matrix_and_adamw_for_the_rest_in_float64():
    """Six steps of a tiny MoE (experts 3-D, shared experts, a dense layer) in float64: losses and every weight equal
    torch's Muon (its iteration without the bfloat16 cast) on each 2-D matrix and each expert's matrices, and torch's
    AdamW on the rest, to 1e-12; both adjust_lr_fn and Nesterov settings that change the update."""
    tokens = [torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s % 2)) for s in range(6)]
    hyper = dict(lr=2e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for muon in ({"adjust_lr_fn": "match_rms_adamw"}, {"adjust_lr_fn": "original", "nesterov": False}):
        ours = _tiny_model(shared_experts=1, moe_layers=[1])
        theirs = _tiny_model(shared_experts=1, moe_layers=[1])
        optimizer = MuonAdamW(muon_param_groups(ours), **hyper, **muon)
        reference = TorchReference(theirs, **hyper, **muon)
        original = torch.optim._muon._zeropower_via_newtonschulz
        torch.optim._muon._zeropower_via_newtonschulz = _float64_zeropower
        try:
            expected = _train(theirs, reference.step, tokens)
        finally:
            torch.optim._muon._zeropower_via_newtonschulz = original
        got = _train(ours, optimizer.step, tokens)
        assert got == pytest.approx(expected, rel=1e-12, abs=0)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            scale = q.abs().max().item()
            assert (p - q).abs().max().item() <= 1e-12 * scale, name
        assert expected[4] < expected[0] and expected[5] < expected[1]  # it learns the two batches


def test_the_bfloat16_iteration_follows_torch_muon():
    """With the default bfloat16 iteration (float32 weights), three steps of 2-D matrices of three orientations
    stay within bfloat16's rounding of torch.optim.Muon's update (the iterations round in another order)."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(48, 16), (16, 48), (32, 32)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    lr = 1e-2
    optimizer = MuonAdamW([{"params": ours, "use_muon": True}], lr=lr)
    reference = torch.optim.Muon(theirs, lr=lr, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    for p, q, shape in zip(ours, theirs, shapes):
        step = adjusted_lr(lr, "match_rms_adamw", shape)  # the size of one update element is about step / sqrt(n)
        assert (p - q).abs().max().item() <= 3 * 2**-7 * step, shape


def test_newton_schulz_batched_equals_one_matrix_at_a_time():
    """The batched iteration (experts: one bmm over E matrices, tall ones transposed) equals the iteration of each
    matrix alone, and orthogonalises: singular values of the result within torch's documented band (0.5, 1.5)."""
    gen = torch.Generator().manual_seed(5)
    batch = torch.randn(6, 40, 24, generator=gen, dtype=torch.float64)
    together = newton_schulz(batch)
    for e in range(6):
        alone = newton_schulz(batch[e])
        assert torch.allclose(together[e], alone, rtol=0, atol=1e-13)
    singular = torch.linalg.svdvals(together)
    assert singular.min().item() > 0.5 and singular.max().item() < 1.5
    assert newton_schulz_flops((6, 40, 24)) == 2 * 6 * 5 * (2 * 24 * 24 * 40 + 24**3)


def test_refusals_name_the_offending_values():
    """A vector in a Muon group, an unknown lr adjustment and a momentum of 1 are refused with the value named."""
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(8))], "use_muon": True}])
    with pytest.raises(ValueError, match="'rms'"):
        MuonAdamW([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="rms")
    with pytest.raises(ValueError, match=r"momentum \(1.0\)"):
        MuonAdamW([torch.nn.Parameter(torch.zeros(2, 2))], momentum=1.0)


def _sharded_matrix(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
    try:
        MuonAdamW([{"params": [weight], "use_muon": True}])
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_a_matrix_sharded_over_ranks_is_refused():
    """A DTensor matrix sharded over 2 ranks (what FSDP2 or tensor parallelism hand the optimizer) is refused in one
    line naming its shape and placement: Newton-Schulz of a shard is not the shard of Newton-Schulz."""
    from mula_lightning.testing import run_pooled_test

    for message in run_pooled_test(_sharded_matrix, 2):
        assert message is not None and "shape (4, 4) is sharded over ranks (placements (Shard(dim=0),)" in message
