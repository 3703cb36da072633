"""The epso strategy with real processes: Fabric training parity with one process, initialisation, checkpoints.

Parity follows the semantics: every rank's loss is the mean over its own tokens (LM + weighted aux losses), and
every gradient is summed over the ranks holding the parameter and divided by DP*EP. The reference runs the
unsharded model on each rank's micro-batch separately, averages the losses, and steps torch.optim.AdamW with
torch's global-norm clipping (max_norm small enough that clipping fires on every step).

Both sides run in float64 (``Fabric(precision="64-true")``; the experts take the per-expert ``torch.mm`` path),
so the rule of :func:`mula_lightning.testing.assert_parity` is tight (~1e-12 relative) even on parameters after
ten Adam steps. One float32 run exercises the grouped GEMM kernels: its losses and first-step reduced gradients are
checked with float32's epsilon; its parameters are not compared element by element, because Adam turns the rounding
of an element whose gradient is near zero into a difference of order lr on any CPU. Injected bugs (a gradient
reduced over the world instead of its DP group, a missing 1/DP scale) must fail the float64 check.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import adamw_parameter_scale, assert_parity, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 10
H, FF, V, T = 32, 16, 128, 12  # hidden, expert intermediate, vocabulary, sequence
# Rounded operations feeding one element of the loss or of a gradient: per layer, dots over H (attention and
# router inputs), T (attention), 2FF (experts), the router's softmax over 8 experts, then the vocabulary's softmax;
# a weight gradient adds a sum over the tokens of every rank (at most 8 ranks x 2 x T). Each AdamW step builds on
# the previous ones, so N steps allow N times one step's rounding.
MODEL_LEN = 2 * (3 * H + T + 2 * FF + 8) + V
GRAD_LEN = MODEL_LEN + 8 * 2 * T
ADAM_SCALE = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"])  # Adam's 1/eps amplification


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


def _inject(bug):
    """Break the sharded optimizer on purpose (in the rank process): the parity check must then fail. Returns what
    puts it back (a pooled rank runs the next test unbroken)."""
    import mula_lightning.parallel.sharded_optimizer as so

    is_expert, init = so.is_expert_param, so.ShardedAdamW.__init__

    def undo():
        so.is_expert_param, so.ShardedAdamW.__init__ = is_expert, init

    if bug == "world_group":  # expert gradients treated as replicated: reduced over the world, not their DP group
        so.is_expert_param = lambda name: False
    elif bug == "missing_dp_scale":  # gradients divided by EP only

        def init_without_dp(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.grad_divisor = self.topology.ep_size

        so.ShardedAdamW.__init__ = init_without_dp
    return undo


def _fabric_train(rank, world_size, ep, modes, dispatcher="allgather", precision="64-true", bug=None):
    import mula_lightning.strategies  # noqa: F401  (registers "epso")

    undo = _inject(bug)
    try:
        return _fabric_train_modes(rank, world_size, ep, modes, dispatcher, precision)
    finally:
        undo()


def _fabric_train_modes(rank, world_size, ep, modes, dispatcher, precision):
    results = {}
    for mode in modes:
        strategy = FabricEPSOStrategy(ep_size=ep, sharded_optimizer=mode, dispatcher=dispatcher, bucket_numel=5000)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
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


def _reference(world_size, dtype=torch.float64):
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(dtype)
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


def _compare(results, ref, world_size, dtype=torch.float64):
    ref_losses, ref_state, ref_grads = ref
    for rank, per_mode in enumerate(results):
        for mode, (losses, state, grads) in per_mode.items():
            covered = 0
            for name, offset, values in grads:
                expected = ref_grads[name][offset : offset + values.numel()]
                scale = ref_grads[name].abs().max().item()
                assert_parity(values, expected, reduction_len=GRAD_LEN, scale=scale, msg=f"{mode} grad {name}")
                covered += values.numel()
            assert covered > 0
            got = torch.tensor(losses, dtype=dtype)
            expected = torch.tensor([step[rank] for step in ref_losses], dtype=dtype)
            if dtype == torch.float64:
                # Fabric's 64-true hands outputs back in the default dtype (float32): the loss and the aux loss are
                # each rounded to float32 and added in float32 (3 roundings). The parameters below, not the losses,
                # carry the tight float64 check.
                assert_parity(got, expected, reduction_len=3, dtype=torch.float32, msg=f"{mode} rank {rank} losses")
            else:
                assert_parity(got, expected, reduction_len=STEPS * GRAD_LEN, msg=f"{mode} rank {rank} losses")
            if dtype == torch.float64:
                for k, v in ref_state.items():
                    scale = ADAM_SCALE + v.abs().max().item()
                    what = f"{mode} rank {rank} {k}"
                    assert_parity(state[k], v, reduction_len=STEPS * GRAD_LEN, scale=scale, msg=what)


@pytest.mark.distributed
def test_fabric_epso_matches_one_process_dp2_ep2_every_mode():
    """4 processes (DP=2 x EP=2), modes ep_aware / dp / none: the reduced gradients of the first step and 10 clipped
    AdamW steps (losses, final parameters) equal one process."""
    modes = ("ep_aware", "dp", "none")
    results = run_pooled_test(_fabric_train, 4, ep=2, modes=modes, timeout=300)
    _compare(results, _reference(4), 4)


@pytest.mark.distributed
def test_fabric_epso_float32_grouped_gemm_matches_one_process():
    """4 processes (DP=2 x EP=2), EP-aware, float32 (the grouped GEMM kernels): the first step's reduced gradients
    and 10 steps of losses equal one process within float32's rounding rule."""
    results = run_pooled_test(_fabric_train, 4, ep=2, modes=("ep_aware",), precision="32-true", timeout=300)
    _compare(results, _reference(4, torch.float32), 4, torch.float32)


@pytest.mark.distributed
@pytest.mark.parametrize("bug", ["world_group", "missing_dp_scale"])
def test_parity_check_catches_injected_bugs(bug):
    """Expert gradients reduced over the world instead of their DP group, or gradients divided by EP instead of
    DP*EP, fail the float64 parity check (DP=2 x EP=2, EP-aware): the rule is tight enough to see real bugs."""
    results = run_pooled_test(_fabric_train, 4, ep=2, modes=("ep_aware",), bug=bug, timeout=300)
    with pytest.raises(AssertionError):
        _compare(results, _reference(4), 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_fabric_epso_matches_one_process_dp2_ep4_alltoall_every_mode():
    """8 processes (DP=2 x EP=4), every mode with the all-to-all dispatcher: 10 clipped AdamW steps and the reduced
    gradients of the first step equal one process."""
    modes = ("ep_aware", "dp", "none")
    results = run_pooled_test(_fabric_train, 8, ep=4, modes=modes, dispatcher="alltoall", timeout=400)
    _compare(results, _reference(8), 8)
