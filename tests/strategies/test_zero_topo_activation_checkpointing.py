"""Activation checkpointing inside ``zero_topo``: the same options as ``epso`` (``"full"`` or selective parts), with
losses, gradient norms and weights bit-identical to the run without it.

The engine frees a layer's full weights after its forward and gathers them again before its backward; a checkpointed
region recomputes its forward inside that backward, so it must find the weights gathered. 2 gloo ranks in the 3-level
layout (weights over the pair), a meta-built MoE model, 3 clipped AdamW steps in float64; CPU kernels are
deterministic, so the recomputation gives the very same numbers.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.testing import run_pooled_test

OPTIONS = {"none": False, "full": "full", "selective": ["norm", "attention", "moe"]}
STEPS, T, V = 3, 12, 128


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast", z_loss_coef=1e-3,
    )  # fmt: skip


def _train(rank, world_size, ep_size):
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict
    from mula_lightning.parallel.activation_checkpointing import checkpointed_parts
    from mula_lightning.strategies import FabricZeroTopoStrategy

    out = {}
    for name, option in OPTIONS.items():
        strategy = FabricZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, block_size=16, ep_size=ep_size,
                                          activation_checkpointing=option)  # fmt: skip
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = MulaForCausalLM(_config())
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
        losses, norms = [], []
        for step in range(STEPS):
            x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(100 * step + rank))
            out_ = model(x, labels=x)
            fabric.backward(out_.loss + out_.aux_loss)
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.05).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out_.loss.item())
        weights = {k: v.clone() for k, v in full_state_dict(model.module, strategy).items()}
        out[name] = (losses, norms, weights, checkpointed_parts(model.module))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("ep_size", [1, 2])
def test_activation_checkpointing_in_zero_topo_is_bit_identical_to_none(ep_size):
    """``activation_checkpointing="full"`` (every decoder layer) and the selective parts (norms, attention, MoE
    blocks) under ``zero_topo`` on 2 ranks, also with the experts split over them (EP=2: the recomputed MoE block
    dispatches its tokens again): every rank's losses, pre-clip gradient norms and trained weights equal the run
    without checkpointing bit for bit, and the options did checkpoint what they name."""
    for per_option in run_pooled_test(_train, 2, ep_size=ep_size, timeout=300):
        losses, norms, weights, parts = per_option["none"]
        assert parts["layer"] == parts["attention"] == parts["moe"] == 0
        assert per_option["full"][3]["layer"] == 2
        selective = per_option["selective"][3]
        assert selective["attention"] == 2 and selective["moe"] == 2 and selective["layer"] == 0
        for name in ("full", "selective"):
            got_losses, got_norms, got_weights, _ = per_option[name]
            assert got_losses == losses and got_norms == norms, name
            assert all(torch.equal(got_weights[k], v) for k, v in weights.items()), name
