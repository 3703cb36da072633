"""The epso strategy with tensor parallelism (and MoE parallel folding) against one process, in real processes.

Layouts over 4 gloo ranks: TP=2 x DP=2 (dense and MoE models), TP=2 folded with EP=2 (attention tp2 x dp2, MoE ep2 x
edp2 on the same ranks), and each with sequence parallelism; expert tensor parallelism ETP=2 x EP=2, and TP=2 with
sequence parallelism folded with ETP=2; a Qwen-style MoE (per-head q/k norm, q/k/v biases, a dense first layer of its
own width, a gated shared expert) at TP=2 folded with EP=2, with and without SP; every one with the ``ep_aware``
optimizer, 5 AdamW steps clipped by the global norm (max_norm small enough that clipping fires on every step). The
reference is one process that runs each data-parallel batch (``world / tp`` of them: the ``tp`` ranks of a group read
the same one) through the unsharded model, averages the losses and steps torch's AdamW after torch's
``clip_grad_norm_``. Both sides run in float64, so :func:`mula_lightning.testing.assert_parity` is tight; an injected
bug (tensor-parallel gradients divided by the world size instead of the dense data-parallel size) must fail it.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import adamw_parameter_scale, assert_parity, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 5
H, FF, V, T, E = 32, 16, 128, 12, 4  # hidden, intermediate, vocabulary, sequence, experts
# Rounded operations feeding one element of the loss or of a gradient: per layer, dots over H (q / k / v / o and
# the router), T (attention), 2 FF (MLP or experts; twice that with a shared expert), the router's softmax; then the
# vocabulary's softmax; a weight gradient adds a sum over the tokens of every batch (2 batches x 2 x T). N AdamW steps
# allow N times one step's.
GRAD_LEN = 2 * (4 * H + T + 4 * FF + E) + V + 2 * 2 * T
ADAM_SCALE = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"])


def _config(kind):
    common = dict(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=FF)
    if kind == "dense":
        return MulaConfig.from_name("mula-tiny-dense", **common)
    if kind == "qwen":  # per-head q/k norm, q/k/v biases, a dense first layer, a gated shared expert, sequence loss
        return MulaConfig.from_name(
            "mula-tiny-moe", **common, num_experts=E, top_k=2, moe_impl="fast", qk_norm_per_head=True, qkv_bias=True,
            moe_layers=[1], dense_intermediate_size=24, shared_expert_intermediate_size=20, shared_expert_gate=True,
            seq_aux_loss_coef=0.05,
        )  # fmt: skip
    return MulaConfig.from_name("mula-tiny-moe", **common, num_experts=E, top_k=2, moe_impl="fast")


def _batch(step, dp_rank):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def _full_state(model, strategy):
    """Every parameter whole: DTensors gathered over tp, expert parts over ep x etp (collective)."""
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(model, strategy).items()}


def _setup(world_size, kind, tp, ep, sp, precision="64-true", etp=1):
    strategy = FabricEPSOStrategy(ep_size=ep, tp_size=tp, sequence_parallel=sp, etp_size=etp, bucket_numel=3000)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config(kind))
    model = fabric.setup_module(model)
    return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **HP))


def _steps(fabric, model, optimizer, steps):
    """Train ``steps`` clipped steps on the batches of this rank's dense data-parallel group; per step the loss and
    the global gradient norm before clipping."""
    dp_rank = fabric.strategy.distributed_sampler_kwargs["rank"]
    losses, norms = [], []
    for step in steps:
        x = _batch(step, dp_rank)
        out = model(x, labels=x)
        loss = out.loss + out.aux_loss
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _train(rank, world_size, kind, tp, ep, sp, precision="64-true", bug=None, etp=1):
    import mula_lightning.parallel.sharded_optimizer as so

    init = so.ShardedAdamW.__init__
    if bug == "world_divisor":  # every family divided by the world size, as before tensor parallelism

        def init_with_world_divisor(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.grad_divisor = self.world_size

        so.ShardedAdamW.__init__ = init_with_world_divisor
    try:
        fabric, model, optimizer = _setup(world_size, kind, tp, ep, sp, precision, etp)
    finally:
        so.ShardedAdamW.__init__ = init
    strategy = fabric.strategy
    from mula_lightning.parallel.params import local_tensor

    layer = model.module.model.layers[0]
    local_shapes = {
        "q_proj": tuple(local_tensor(layer.self_attn.q_proj.weight).shape),
        "o_proj": tuple(local_tensor(layer.self_attn.o_proj.weight).shape),
        "embed": tuple(local_tensor(model.module.model.embed_tokens.weight).shape),
        "lm_head": tuple(local_tensor(model.module.lm_head.weight).shape),
    }
    if kind == "moe":
        local_shapes["gate_up"] = tuple(layer.mlp.experts.gate_up_proj.shape)
        local_shapes["down"] = tuple(layer.mlp.experts.down_proj.shape)
    losses, norms = _steps(fabric, model, optimizer, range(STEPS))
    state = _full_state(model.module, strategy)
    return losses, norms, state, local_shapes, strategy.distributed_sampler_kwargs


def _reference(kind, dp, dtype=torch.float64, steps=STEPS, with_optimizer=False):
    model = init_weights(MulaForCausalLM(_config(kind)), seed=0).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses, norms = [], []
    for step in range(steps):
        per_batch = []
        for b in range(dp):
            x = _batch(step, b)
            out = model(x, labels=x)
            per_batch.append(out.loss + out.aux_loss)
        torch.stack(per_batch).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append([p.item() for p in per_batch])
    if with_optimizer:
        names = {p: n for n, p in model.named_parameters()}
        moments = {f"{names[p]}.{k}": v for p, s in opt.state.items() for k, v in s.items() if k != "step"}
        return model.state_dict(), moments
    return losses, norms, model.state_dict()


def _compare(results, reference, tp, ep=1, etp=1):
    ref_losses, ref_norms, ref_state = reference
    for rank, (losses, norms, state, local_shapes, sampler) in enumerate(results):
        assert sampler == {"num_replicas": len(results) // tp, "rank": rank // tp}
        expected_shapes = {"q_proj": (H // tp, H), "o_proj": (H, H // tp), "embed": (V // tp, H),
                           "lm_head": (V // tp, H)}  # fmt: skip
        if "gate_up" in local_shapes:  # E / ep experts, FF / etp of their intermediate size
            expected_shapes.update(gate_up=(E // ep, 2 * FF // etp, H), down=(E // ep, H, FF // etp))
        assert local_shapes == expected_shapes
        expected = torch.tensor([step[sampler["rank"]] for step in ref_losses], dtype=torch.float64)
        # Fabric's 64-true hands outputs back in float32: the loss and the aux loss each rounded, then added
        assert_parity(torch.tensor(losses, dtype=torch.float64), expected, reduction_len=3, dtype=torch.float32)
        # the global norm of the reduced gradients before clipping: a gradient reduced over the wrong ranks or by
        # the wrong divisor changes it (clipping and Adam would hide a uniform factor in the parameters)
        assert_parity(torch.tensor(norms), torch.tensor(ref_norms), reduction_len=STEPS * GRAD_LEN, msg="grad norms")
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            scale = ADAM_SCALE + value.abs().max().item()
            assert_parity(state[name], value, reduction_len=STEPS * GRAD_LEN, scale=scale, msg=f"rank {rank} {name}")


LAYOUTS = {
    "dense tp2 x dp2": dict(kind="dense", tp=2, ep=1, sp=False),
    "dense tp2 x dp2 + sp": dict(kind="dense", tp=2, ep=1, sp=True),
    "moe tp2 x dp2": dict(kind="moe", tp=2, ep=1, sp=False),
    "moe tp2 folded with ep2": dict(kind="moe", tp=2, ep=2, sp=False),
    "moe tp2 + sp folded with ep2": dict(kind="moe", tp=2, ep=2, sp=True),
    "moe etp2 x ep2": dict(kind="moe", tp=1, ep=2, sp=False, etp=2),
    "moe tp2 + sp folded with etp2": dict(kind="moe", tp=2, ep=1, sp=True, etp=2),
    "qwen-style moe tp2 + sp folded with ep2": dict(kind="qwen", tp=2, ep=2, sp=True),
    # without SP the per-head q/k norm's weight gradient is still a partial sum over tp (each rank normed its heads)
    "qwen-style moe tp2 folded with ep2": dict(kind="qwen", tp=2, ep=2, sp=False),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_epso_matches_one_process(layout):
    """4 processes, ep_aware, 5 clipped AdamW steps in float64: every rank's losses and every parameter (gathered
    whole) equal one process running the dense data-parallel batches; each rank holds 1/tp of every tensor-parallel
    weight and reads the batch of its dense data-parallel group."""
    spec = LAYOUTS[layout]
    results = run_pooled_test(_train, 4, **spec, timeout=300)
    _compare(results, _reference(spec["kind"], 4 // spec["tp"]), spec["tp"], spec["ep"], spec.get("etp", 1))


@pytest.mark.distributed
def test_parity_check_catches_a_wrong_gradient_divisor():
    """Tensor-parallel gradients divided by the world size (4) instead of the number of distinct batches (2) fail the
    float64 check (TP=2 x DP=2, MoE): the rule is tight enough to see the bug tensor parallelism invites."""
    results = run_pooled_test(_train, 4, kind="moe", tp=2, ep=1, sp=False, bug="world_divisor", timeout=300)
    with pytest.raises(AssertionError):
        _compare(results, _reference("moe", 2), 2)


def _save_at(rank, world_size, path, tp, ep, sp, steps, etp=1):
    fabric, model, optimizer = _setup(world_size, "moe", tp, ep, sp, etp=etp)
    _steps(fabric, model, optimizer, range(steps))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})
    return _full_state(model.module, fabric.strategy)


def _load_and_save_at(rank, world_size, path, again, tp, ep, sp, etp=1):
    fabric, model, optimizer = _setup(world_size, "moe", tp, ep, sp, etp=etp)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    fabric.save(again, state)
    return state["step"], _full_state(model.module, fabric.strategy)


def _one_process_load(path):
    """The checkpoint loaded into one process: the weights and the AdamW moments (``<param>.<exp_avg|exp_avg_sq>``)."""
    from mula_lightning.checkpoint.sharded import load_sharded_checkpoint
    from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
    from mula_lightning.parallel.state_dict import optimizer_state_dict
    from mula_lightning.parallel.topology import build_topology

    model = MulaForCausalLM(_config("moe")).to(torch.float64)
    topology = build_topology(1)
    optimizer = ShardedAdamW(model, topology, "ep_aware", **HP)
    load_sharded_checkpoint(path, {"model": model, "optimizer": optimizer}, topology)
    prefix = len("state.")
    moments = {k[prefix:]: v for k, v in optimizer_state_dict(optimizer).items() if k.startswith("state.")}
    return model.state_dict(), moments


SAVED_AT = {"tp2+sp x ep2": dict(tp=2, ep=2, sp=True), "etp2 x ep2": dict(tp=1, ep=2, sp=False, etp=2)}


@pytest.mark.distributed
@pytest.mark.parametrize("saved_at", list(SAVED_AT))
def test_checkpoint_saved_folded_loads_at_tp1_ep4_and_in_one_process(tmp_path, saved_at):
    """Saved after 2 steps at TP=2 x EP=2 with sequence parallelism, or at ETP=2 x EP=2 (4 ranks): loaded at
    TP=1 x EP=4 every weight is the saved one; loaded into one process the weights are the saved ones and the AdamW
    moments (parameter-shaped) equal those of torch's AdamW after the same 2 steps; saved again at TP=1 x EP=4, it
    loads into one process to exactly the same weights and moments."""
    steps, path, again = 2, tmp_path / "folded", tmp_path / "tp1ep4"
    saved = run_pooled_test(_save_at, 4, path=str(path), steps=steps, **SAVED_AT[saved_at], timeout=300)[0]
    for step, state in run_pooled_test(
        _load_and_save_at, 4, path=str(path), again=str(again), tp=1, ep=4, sp=False, timeout=300
    ):
        assert step == steps
        assert state.keys() == saved.keys() and all(torch.equal(state[k], v) for k, v in saved.items())
    weights, moments = _one_process_load(path)
    assert all(torch.equal(weights[k], v) for k, v in saved.items())
    dp = 4 // SAVED_AT[saved_at]["tp"]  # the batches of a step: one per dense data-parallel rank
    _, ref_moments = _reference("moe", dp, steps=steps, with_optimizer=True)
    assert moments.keys() == ref_moments.keys()
    for name, value in ref_moments.items():
        assert moments[name].shape == value.shape, name
        assert_parity(moments[name], value, reduction_len=steps * GRAD_LEN, msg=name)
    weights_again, moments_again = _one_process_load(again)
    assert all(torch.equal(weights_again[k], v) for k, v in weights.items())
    assert all(torch.equal(moments_again[k], v) for k, v in moments.items())
