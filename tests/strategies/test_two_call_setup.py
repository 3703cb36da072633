"""Lightning's two-call set-up of a sharded strategy: ``fabric.setup_module(model)``, then
``fabric.setup_optimizers(AdamW(model.parameters()))`` (the order Lightning documents for FSDP), for ``zero_topo`` and
``epso`` at 4 and 8 gloo ranks, against one process. The 2- and 4-rank layouts, frozen parameter sets and schedulers
built before or after the second call are the loop tester's (``tests/testing/test_conformance.py``).

A Mula MoE model built on the meta device; the optimizer, built from the set-up module's parameters, has two param
groups (no weight decay on norms) and hyper-parameters other than the engine's defaults, so an optimizer whose groups
were not taken over changes the losses. ``zero_topo`` must shard at ``setup_module`` already: its parameters hold no
storage outside a forward (the units are chunked), where the whole-model path would hold the full model on every rank.
Float64 on both sides; the reference is one process running every rank's batch and averaging the losses.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.testing import adamw_parameter_scale, assert_parity, one_process_data_parallel, run_pooled_test
from mula_lightning.testing.fabric_run import clipped_fabric_steps

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CLIP, STEPS, T, V = 0.05, 3, 12, 128
LAYOUTS = {
    "zero_topo ZeRO-3, 4 ranks": (4, "zero_topo", dict(ranks_per_node=4, weight_size=4, grad_size=4)),
    "zero_topo 2 nodes x 2 GPUs x 2 GCDs, 8 ranks": (8, "zero_topo", dict(ranks_per_node=4, ranks_per_gpu=2)),
    "zero_topo 2 x 2 x 2 with ep4, 8 ranks": (8, "zero_topo", dict(ranks_per_node=4, ranks_per_gpu=2, ep_size=4)),
    "epso ep4, 8 ranks": (8, "epso", dict(ep_size=4)),
}


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _batch(step, rank):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 * step + rank))


def _groups(model):
    params = dict(model.named_parameters())
    return [
        {"params": [p for n, p in params.items() if not n.endswith("norm.weight")]},
        {"params": [p for n, p in params.items() if n.endswith("norm.weight")], "weight_decay": 0.0},
    ]


def _held_bytes(module):
    """Bytes of the storages behind the module's parameters (a chunked unit's parameters hold none)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}.values())


def _two_call(rank, world_size, kind, options):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if kind == "zero_topo":
        strategy = FabricZeroTopoStrategy(block_size=16, **options)
    else:
        strategy = FabricEPSOStrategy(bucket_numel=3000, **options)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model = fabric.setup_module(model)
    held = _held_bytes(model.module)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in _groups(model.module)]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(groups, **HP))
    data_rank = strategy.distributed_sampler_kwargs["rank"] if kind == "epso" else rank
    losses = clipped_fabric_steps(fabric, model, optimizer, _batch, data_rank, range(STEPS), CLIP)
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    weights = {k: v.clone() for k, v in full_state_dict(model.module, strategy).items()}  # collective
    return losses, held, data_rank, weights


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_setup_module_then_an_optimizer_of_its_parameters_trains_like_one_process(layout):
    """3 clipped AdamW steps after ``setup_module`` + ``setup_optimizers`` (two param groups): every rank's losses
    equal one process's on its batch (float64); under ``zero_topo`` no parameter holds storage after ``setup_module``
    (the module was sharded then, one unit at a time, not materialised whole)."""
    world, kind, options = LAYOUTS[layout]
    results = run_pooled_test(_two_call, world, kind=kind, options=options, timeout=300)
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    reference = one_process_data_parallel(
        model, _batch, world, range(STEPS), CLIP, optimizer=torch.optim.AdamW(_groups(model), **HP)
    )
    scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=CLIP, eps=HP["eps"])
    for rank, (losses, held, data_rank, weights) in enumerate(results):
        # Fabric's 64-true hands the loss back in the default dtype (float32): compared at float32's rounding
        expected = torch.tensor([step[data_rank] for step in reference], dtype=torch.float64)
        assert_parity(torch.tensor(losses, dtype=torch.float64), expected, reduction_len=3, dtype=torch.float32,
                      msg=f"rank {rank} losses")  # fmt: skip
        for name, value in model.state_dict().items():  # the weights after the steps, in float64
            assert_parity(weights[name], value, reduction_len=STEPS * 200, scale=scale + value.abs().max().item(),
                          msg=f"rank {rank} {name}")  # fmt: skip
        if kind == "zero_topo":
            assert held == 0, f"rank {rank}: {held} bytes of parameters after setup_module (the whole model?)"


def test_an_optimizer_the_engine_cannot_take_over_is_named():
    """One process: an engine built before its optimizer (as at ``setup_module``) refuses, naming them, param groups
    that leave a trainable parameter out, hold a parameter it does not shard, or hold one twice; groups that cover
    every parameter are taken over, their hyper-parameters included."""
    from mula_lightning.parallel.parallelize import parameter_initializer
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    with torch.device("meta"):
        model = MulaForCausalLM(_config())
    engine = HierarchicalZeroAdamW(model, ZeroTopoLayout(1, 1, 1), block_size=16,
                                   initializer=parameter_initializer(model))  # fmt: skip
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"1 trainable parameters are not in the optimizer \(model\.norm\.weight"):
        engine.adopt_param_groups([{"params": [p for n, p in params.items() if n != "model.norm.weight"]}])
    with pytest.raises(ValueError, match=r"shape \(3,\) is not one the zero_topo engine holds"):
        engine.adopt_param_groups([{"params": [*params.values(), torch.nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(ValueError, match="model.norm.weight is in more than one param group"):
        engine.adopt_param_groups([{"params": list(params.values())}, {"params": [params["model.norm.weight"]]}])
    groups = [{**g, "lr": 1e-3} for g in torch.optim.AdamW(_groups(model)).param_groups]  # AdamW's defaults filled
    engine.adopt_param_groups(groups)
    assert [g["lr"] for g in engine.param_groups] == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in engine.param_groups] == [0.01, 0.0]
