"""The epso strategy with real processes: Fabric training parity with one process, initialisation, checkpoints.

Parity follows the semantics: every rank's loss is the mean over its own tokens (LM + weighted aux losses), and
every gradient is summed over the ranks holding the parameter and divided by DP*EP. The reference runs the
unsharded model on each rank's micro-batch separately, averages the losses, and steps torch.optim.AdamW with
torch's global-norm clipping (max_norm small enough that clipping fires on every step).
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import run_distributed_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 10


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=16,
        num_experts=8,
        top_k=2,
        moe_impl="fast",
    )


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, 12), generator=g)


def _fabric_train(rank, world_size, ep, modes, dispatcher="allgather"):
    import mula_lightning.strategies  # noqa: F401  (registers "epso")

    results = {}
    for mode in modes:
        strategy = FabricEPSOStrategy(ep_size=ep, sharded_optimizer=mode, dispatcher=dispatcher, bucket_numel=5000)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = MulaForCausalLM(_config())
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **HP))
        losses, first_grads = [], None
        for step in range(STEPS):
            x = _batch(step, rank)
            out = model(x, labels=x)
            loss = out.loss + out.aux_loss
            fabric.backward(loss)
            if step == 0:  # the reduced gradients themselves, before clipping and the update
                strategy.sharded_optimizer.finish_grad_sync()
                first_grads = strategy.sharded_optimizer.owned_gradient_segments()
            fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        full = gather_expert_parallel_state_dict(model.module, strategy.topology.ep_group)
        results[mode] = (losses, {k: v.clone() for k, v in full.items()}, first_grads)
    return results


def _reference(world_size):
    model = init_weights(MulaForCausalLM(_config()), seed=0)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses, first_grads = [], None
    for step in range(STEPS):
        per_rank = []
        for rank in range(world_size):
            x = _batch(step, rank)
            out = model(x, labels=x)
            per_rank.append(out.loss + out.aux_loss)
        total = torch.stack(per_rank).mean()
        total.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone().reshape(-1) for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append([p.item() for p in per_rank])
    return losses, model.state_dict(), first_grads


def _compare(results, ref, world_size):
    ref_losses, ref_state, ref_grads = ref
    for rank, per_mode in enumerate(results):
        for mode, (losses, state, grads) in per_mode.items():
            covered = 0
            for name, offset, values in grads:
                expected = ref_grads[name][offset : offset + values.numel()]
                scale = ref_grads[name].abs().max().item()
                torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6 * scale, msg=f"{mode} grad {name}")
                covered += values.numel()
            assert covered > 0
            got = torch.tensor(losses)
            expected = torch.tensor([step[rank] for step in ref_losses])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{mode} rank {rank} losses")
            for k, v in ref_state.items():
                atol = 1e-5 * v.abs().max().item()  # relative to the tensor's scale (Adam amplifies roundoff)
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=atol, msg=f"{mode} rank {rank} {k}")


@pytest.mark.distributed
def test_fabric_epso_matches_one_process_dp2_ep2_every_mode():
    """4 processes (DP=2 x EP=2), modes ep_aware / dp / none: the reduced gradients of the first step and 10 clipped
    AdamW steps (losses, final parameters) equal one process."""
    modes = ("ep_aware", "dp", "none")
    results = run_distributed_test(_fabric_train, 4, ep=2, modes=modes, timeout=300)
    _compare(results, _reference(4), 4)


@pytest.mark.distributed
def test_fabric_epso_matches_one_process_dp2_ep4_alltoall_every_mode():
    """8 processes (DP=2 x EP=4), every mode with the all-to-all dispatcher: 10 clipped AdamW steps and the reduced
    gradients of the first step equal one process."""
    modes = ("ep_aware", "dp", "none")
    results = run_distributed_test(_fabric_train, 8, ep=4, modes=modes, dispatcher="alltoall", timeout=400)
    _compare(results, _reference(8), 8)
