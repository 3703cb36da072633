"""Auxiliary-loss-free balancing and DeepSeek-V3's MoE recipe under the sharded strategies, against one process, in real
gloo processes.

An MoE model of DeepSeek-V3's shape (sigmoid scores, group-limited routing, routed scaling, one shared expert, a dense
first layer of its own width, the sequence-wise balance loss) whose routers move their selection bias
(``bias_update_rate`` 0.02, large enough that the bias moves choices within the run) and keep their load-balancing and
z losses on, 2 micro-batches per data-parallel
batch accumulated into each of 5 AdamW steps, float64. Layouts: ``epso`` DP=2 x EP=2 (all-gather dispatcher), EP=4
(all-to-all), PP=2 x EP=2 with 1F1B (the schedule's micro-batches; its shape-inference forward must not count), pure
PP=2 (one rank per stage) with one router per stage and with the dense layer alone on the first stage, and
``zero_topo`` over 2 ranks (its sharded, unit-by-unit setup gives the bias its initial value). The reference is one
process running every data-parallel batch's micro-batches through the whole model, with torch's AdamW and the bias
update installed on it; every rank's parameters and its bias after the 5 steps must match it, the bias must have moved,
and a checkpoint of the DP=2 x EP=2 run must hold the bias (read back by one process with DCP).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.moe.balancing import install_expert_bias_update
from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy
from mula_lightning.testing import adamw_parameter_scale, assert_parity, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 5
H, FF, V, T, E, M, L = 16, 16, 64, 8, 8, 2, 3  # hidden, intermediate, vocabulary, sequence, experts, micro, layers
MOE_LAYERS = [1, 2]
GRAD_LEN = L * (5 * H + T + 4 * FF + E) + V + 4 * M * T  # a weight gradient sums over up to 4 batches
ADAM_SCALE = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"])
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=H, num_layers=L, num_heads=2, num_kv_heads=2,
        intermediate_size=FF, num_experts=E, top_k=2, moe_impl="fast", z_loss_coef=1e-3, bias_update_rate=0.02,
        score_function="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5,
        shared_experts=1, moe_layers=MOE_LAYERS, dense_intermediate_size=24, seq_aux_loss_coef=0.05,
    )  # fmt: skip


def _batch(step, dp_rank):
    return torch.randint(0, V, (M, T), generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def _train(rank, world_size, strategy, path=None):
    kind, kwargs = strategy
    if kind == "zero_topo":
        strategy = FabricZeroTopoStrategy(**kwargs)
    else:
        strategy = FabricEPSOStrategy(pp_microbatches=M, bucket_numel=3000, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    pipelined = getattr(strategy, "pp_size", 1) > 1
    dp_rank = strategy.distributed_sampler_kwargs["rank"]
    for step in range(STEPS):
        x = _batch(step, dp_rank)
        if pipelined:
            strategy.pipeline_step(x, x)
        else:
            for i in range(M):
                out = model(x[i : i + 1], labels=x[i : i + 1])
                with fabric.no_backward_sync(model, enabled=i < M - 1):
                    fabric.backward((out.loss + out.aux_loss) / M)
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    if path is not None:
        fabric.save(path, {"model": model, "optimizer": optimizer})
    inner = model.module
    if kind == "zero_topo":
        with strategy.engine.full_parameters():
            state = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    else:
        state = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    topo = strategy.expert_topology() if kind == "zero_topo" else getattr(strategy, "topology", None)
    return state, (topo.ep_rank, topo.ep_size) if topo is not None else (0, 1)


def _reference(dp):
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    install_expert_bias_update(opt, model)
    for step in range(STEPS):
        losses = []
        for b in range(dp):
            x = _batch(step, b)
            losses += [model(x[i : i + 1], labels=x[i : i + 1]) for i in range(M)]
        torch.stack([o.loss + o.aux_loss for o in losses]).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


LAYOUTS = {
    "epso dp2 x ep2 allgather": (4, 4, ("epso", dict(ep_size=2, dispatcher="allgather"))),
    "epso ep4 alltoall": (4, 4, ("epso", dict(ep_size=4, dispatcher="alltoall"))),
    "epso pp2 x ep2 1f1b": (4, 2, ("epso", dict(ep_size=2, pp_size=2, pp_schedule="1f1b", pp_boundaries=[2]))),
    # pure pipeline parallelism: a stage of one rank has no stage group; its loads are its own, not summed over the
    # world (equal numbers of routers per stage: other layers' loads were added; unequal: the job hung)
    "epso pp2 only, equal stages": (2, 1, ("epso", dict(pp_size=2, pp_schedule="1f1b", pp_boundaries=[2]))),
    "epso pp2 only, dense first stage": (2, 1, ("epso", dict(pp_size=2, pp_schedule="gpipe", pp_boundaries=[1]))),
    "zero_topo over 2 ranks": (2, 2, ("zero_topo", dict(weight_size=2, grad_size=2, optimizer_size=2))),
    # expert parallelism inside the hierarchical engine, 2 nodes x 2 GPUs x 2 GCDs: the expert slices sharded over
    # their edp ranks (EP=2: w 1, g 2, o 4 of them; EP=4: w 1, g 1, o 2), the dense weights over all 8 as before
    "zero_topo 3-level ep2 allgather, 8 ranks": (
        8,
        8,
        ("zero_topo", dict(ranks_per_node=4, ranks_per_gpu=2, ep_size=2, block_size=16)),
    ),
    "zero_topo 3-level ep4 alltoall, 8 ranks": (
        8,
        8,
        ("zero_topo", dict(ranks_per_node=4, ranks_per_gpu=2, ep_size=4, dispatcher="alltoall", block_size=16)),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_bias_and_weights_match_one_process(layout, tmp_path):
    """After 5 accumulated steps every rank's selection biases (identical on every rank, and moved) and parameters
    equal one process's; the DP=2 x EP=2 checkpoint holds the bias, read back by one process."""
    world, dp, strategy = LAYOUTS[layout]  # dp: the batches a step reads (expert-parallel peers read their own)
    path = str(tmp_path / "ckpt") if layout.startswith("epso dp2") else None
    results = run_pooled_test(_train, world, strategy=strategy, path=path, timeout=300)
    ref = _reference(dp)
    assert all(ref[BIAS.format(i)].unique().numel() > 1 for i in MOE_LAYERS)  # moved, and not alike
    held_anywhere = {i for state, _ in results for i in MOE_LAYERS if BIAS.format(i) in state}
    assert held_anywhere == set(MOE_LAYERS)  # a stage of dense layers alone holds no router
    for rank, (state, (ep_rank, ep_size)) in enumerate(results):
        held = [i for i in MOE_LAYERS if BIAS.format(i) in state]
        for i in held:  # the update is exact arithmetic on identical counts: bit for bit
            assert torch.equal(state[BIAS.format(i)], ref[BIAS.format(i)]), f"rank {rank} layer {i}"
            assert state[BIAS.format(i)].dtype == torch.float32
        for name, value in state.items():
            expected = ref[name]
            if ".experts." in name and ep_size > 1:
                per = expected.shape[0] // ep_size
                expected = expected[ep_rank * per : (ep_rank + 1) * per]
            scale = ADAM_SCALE + expected.abs().max().item()
            assert_parity(value, expected, reduction_len=STEPS * GRAD_LEN, scale=scale, msg=f"rank {rank} {name}")
    if path is not None:
        single = MulaForCausalLM(_config())
        target = {"model": single.state_dict()}
        dcp.load(target, checkpoint_id=path)
        for i in MOE_LAYERS:
            assert torch.equal(single.state_dict()[BIAS.format(i)], ref[BIAS.format(i)])
