"""Pipeline parallelism of a Mula model (``torch.distributed.pipelining`` schedules over gloo) against one process.

PP=2 over 2 processes, 4 micro-batches of one sequence each, an MoE model of 4 layers with its auxiliary losses on:
each schedule's gradients (scaled by 1 / micro-batches) and the weights after AdamW steps equal one process that
runs the 4 micro-batches separately and averages their losses (cross-entropy plus each micro-batch's weighted MoE
losses), in float64. Without the auxiliary losses' injection into each stage's backward the router gradients
differ, and the check fails.
"""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.testing import assert_parity, run_pooled_test

V, T, H, M = 64, 8, 16, 4  # vocabulary, sequence, hidden, micro-batches
STEPS = 3
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
# per layer, dots over H (q / k / v / o, router), T (attention), 2 x 16 (experts); the vocabulary's softmax;
# a weight gradient sums over the micro-batches' tokens
GRAD_LEN = 4 * (5 * H + T + 32) + V + M * T


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=H, num_layers=4, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast", z_loss_coef=1e-3,
    )  # fmt: skip


def _batch(step):
    return torch.randint(0, V, (M, T), generator=torch.Generator().manual_seed(step))


def _pipeline_rank(rank, world_size, schedule, inject=True):
    import mula_lightning.parallel.pipeline as pipeline

    apply = pipeline._StageAuxLoss.apply
    if not inject:  # the stage's auxiliary losses left out of its backward (put back below: the worker is pooled)
        pipeline._StageAuxLoss.apply = staticmethod(lambda x, aux, scale=1.0: x)
    try:
        return _run_schedule(rank, world_size, schedule)
    finally:
        pipeline._StageAuxLoss.apply = apply


def _run_schedule(rank, world_size, schedule):
    import mula_lightning.parallel.pipeline as pipeline

    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    virtual = 2 if pipeline.SCHEDULES[schedule] else 1
    stages = pipeline.split_into_stages(model, rank, world_size, virtual)
    sched = pipeline.build_schedule(
        schedule, stages, world_size * virtual, M, torch.device("cpu"), loss_fn=model.loss_function
    )
    params = {n: p for _, stage in stages for n, p in stage.named_parameters()}
    opt = torch.optim.AdamW(params.values(), **HP)
    first = any(index == 0 for index, _ in stages)
    last = any(index == world_size * virtual - 1 for index, _ in stages)
    grads, losses = [], []
    for step in range(STEPS):
        x = _batch(step)
        out: list = []
        kwargs = {"target": x, "losses": out} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        grads.append({n: p.grad.clone() for n, p in params.items()})
        losses.append([loss.item() * M for loss in out])  # the schedule holds each loss / M
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}, grads, losses, [i for i, _ in stages]


def _reference():
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    grads, losses = [], []
    for step in range(STEPS):
        x = _batch(step)
        outs = [model(x[i : i + 1], labels=x[i : i + 1]) for i in range(M)]
        torch.stack([o.loss + o.aux_loss for o in outs]).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append([o.loss.item() for o in outs])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, losses


def _logical(stage_name):
    """A stage module's parameter name as the single-device model names it."""
    if stage_name.startswith("layers."):
        return "model." + stage_name
    return {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(
        stage_name, stage_name
    )


def _compare(results, reference):
    ref_params, ref_grads, ref_losses = reference
    seen = set()
    for params, grads, losses, _ in results:
        for name, value in params.items():
            logical = _logical(name)
            seen.add(logical)
            for step in range(STEPS):
                scale = max(g.abs().max().item() for g in ref_grads[step].values())
                what = f"step {step} grad {logical}"
                assert_parity(
                    grads[step][name], ref_grads[step][logical], reduction_len=GRAD_LEN, scale=scale, msg=what
                )
            assert_parity(value, ref_params[logical], reduction_len=STEPS * GRAD_LEN, scale=1.0, msg=logical)
        if losses[0]:  # the last stage's rank: each micro-batch's cross-entropy
            assert_parity(torch.tensor(losses), torch.tensor(ref_losses), reduction_len=GRAD_LEN)
    assert seen == set(ref_params)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pipeline_schedules_match_one_process(schedule):
    """PP=2 (interleaved: 2 stages per rank, 4 in all): every stage's gradients for 3 steps, the weights after 3
    AdamW steps and each micro-batch's loss equal one process; each rank holds only its stages' parameters."""
    results = run_pooled_test(_pipeline_rank, 2, schedule=schedule, timeout=180)
    assert [r[3] for r in results] == ([[0, 2], [1, 3]] if schedule == "interleaved_1f1b" else [[0], [1]])
    _compare(results, _reference())


@pytest.mark.distributed
def test_auxiliary_losses_left_out_of_the_stage_backward_fail_the_check():
    """The same 1F1B run with each stage's MoE losses left out of its backward fails the parity check."""
    results = run_pooled_test(_pipeline_rank, 2, schedule="1f1b", inject=False, timeout=180)
    with pytest.raises(AssertionError):
        _compare(results, _reference())


@pytest.mark.parametrize(
    "layers,stages,boundaries,fragment",
    [
        (4, 3, None, r"num_layers \(4\) must be divisible by the pipeline stages \(3"),
        (4, 2, [0], r"stage boundaries \[0\] must be 1 increasing layer indices inside \(0, 4\)"),
        (4, 3, [2, 2], r"stage boundaries \[2, 2\]"),
    ],
)
def test_stages_that_do_not_fit_the_layers_are_named(layers, stages, boundaries, fragment):
    """Stages that do not divide the layers, or boundaries that do not cut them into non-empty stages, are named."""
    from mula_lightning.parallel.pipeline import stage_layer_ranges

    with pytest.raises(ValueError, match=fragment):
        stage_layer_ranges(layers, stages, boundaries)
    assert stage_layer_ranges(6, 3, [1, 5]) == [range(0, 1), range(1, 5), range(5, 6)]


def test_only_a_mula_model_is_split_and_1f1b_needs_enough_microbatches():
    """A module that is not a MulaForCausalLM is refused by name; 1F1B with fewer micro-batches than ranks too."""
    from mula_lightning.parallel.pipeline import build_schedule, split_into_stages

    with pytest.raises(ValueError, match="splits a MulaForCausalLM by layers; got Linear"):
        split_into_stages(torch.nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match=r"pp_microbatches \(1\) must be at least pp_size \(2\) for 1f1b"):
        build_schedule("1f1b", [(0, None)], 2, 1, torch.device("cpu"), loss_fn=None)
    with pytest.raises(ValueError, match=r"pp_schedule \('zb'\) must be one of"):
        build_schedule("zb", [(0, None)], 2, 4, torch.device("cpu"), loss_fn=None)
