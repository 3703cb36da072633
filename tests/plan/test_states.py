"""``mula_lightning.plan.states``: one rank's model-state bytes from closed forms, against the papers and against
what the optimizers really allocate.

* Aurora Table 1: total and active parameters of every preset, to the table's precision;
* the Aurora paper's 16 bytes per parameter (bf16 weights and gradients, fp32 master and moments) beside ours (float32
  gradient buffers: 18) for replicated states, and EPSO's split (Section 3.2): sharding the non-expert states over all
  DP x EP ranks instead of DP saves (1 - 1/EP) of them;
* 4 gloo ranks, bf16-true: ``epso`` DP 2 x EP 2 in every mode and ``zero_topo`` (3-level, EP 2): the planned weights,
  gradients and optimizer state of every rank equal what the strategy holds, up to the flat buffers' padding;
* layouts that cannot run are named.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.parallel.params import local_tensor
from mula_lightning.plan import Layout, stage_params, state_bytes
from mula_lightning.testing import run_pooled_test

TABLE_1 = {  # preset: (total, active) in billions, as printed (1.3 B, 6.9 B, 20 B, 100 B, 220 B)
    "mula-1b": (1.3, 1.3, 1),
    "mula-7b-a1b": (6.9, 1.3, 1),
    "mula-20b-a2b": (20, 2.4, 0),
    "mula-100b-a7b": (100, 7.6, 0),
    "mula-220b-a10b": (220, 10, 0),
}


@pytest.mark.parametrize("preset", list(TABLE_1))
def test_aurora_table_1_parameters(preset):
    """Total and active parameters round to Table 1's printed values (its last digit)."""
    total, active, digits = TABLE_1[preset]
    config = MulaConfig.from_name(preset)
    assert round(config.num_params() / 1e9, digits) == total
    assert round(config.num_params(active=True) / 1e9, 1 if active < 10 else 0) == active
    stages = stage_params(config)
    assert stages[0].non_expert + stages[0].expert == config.num_params()


def test_bytes_per_parameter_and_the_epso_split():
    """Replicated bf16-true states cost 18 bytes per parameter here (the paper's 16 with bf16 gradients: 2 + 2 + 4 +
    8; our gradient buffers are float32); at DP 16 x EP 12 EPSO keeps 1/(DP x EP) of the non-expert states where SO
    keeps 1/DP, and the same expert states."""
    config = MulaConfig.from_name("mula-20b-a2b")
    params = config.num_params()
    (replicated,) = state_bytes(config, Layout(16, ep=1, mode="none"))
    assert replicated["total"] == pytest.approx(18 * params, rel=1e-12)
    assert replicated["weights"] + replicated["gradients"] - params * 2 + replicated["master"] + replicated["moments"] \
        == pytest.approx(16 * params, rel=1e-12)  # the paper's rule, with 2-byte gradients  # fmt: skip
    (stage,) = stage_params(config)
    (so,) = state_bytes(config, Layout(192, ep=12, mode="dp"))
    (epso,) = state_bytes(config, Layout(192, ep=12, mode="ep_aware"))
    saved = stage.non_expert / 16 * (1 - 1 / 12) * 12  # moments (8) and master (4) bytes of the non-expert states
    assert so["moments"] + so["master"] - epso["moments"] - epso["master"] == pytest.approx(saved, rel=1e-9)
    assert so["weights"] == epso["weights"] and so["gradients"] == epso["gradients"]


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _held(rank, world_size, strategy_name, mode, tp=1, etp=1):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if strategy_name == "epso":
        strategy = FabricEPSOStrategy(ep_size=2, sharded_optimizer=mode, bucket_numel=None, tp_size=tp, etp_size=etp)
    else:
        strategy = FabricZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, ep_size=2, block_size=1)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))
    fabric.backward(model(x, labels=x).loss)
    optimizer.step()
    if strategy_name == "zero_topo":
        held = strategy.engine.memory_bytes()
        units = len(strategy.engine.units)
        return {"weights": held["weights"] + held["secondary"], "gradients": held["grads"],
                "optimizer": held["optimizer"]}, units  # fmt: skip
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    weights = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    gradients = sum(b.grads.numel() * b.grads.element_size() for b in inner.buffers.values())
    return {"weights": weights, "gradients": gradients, "optimizer": inner.state_bytes()}, len(inner.buffers)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy_name, mode, tp, etp", [
    ("epso", "none", 1, 1), ("epso", "dp", 1, 1), ("epso", "ep_aware", 1, 1), ("zero_topo", None, 1, 1),
    ("epso", "ep_aware", 2, 1), ("epso", "none", 2, 1), ("epso", "ep_aware", 1, 2),
])  # fmt: skip
def test_planned_bytes_equal_what_the_strategy_holds(strategy_name, mode, tp, etp):
    """4 ranks (2 nodes x 2 GCDs), bf16-true, one step: every rank's weights, gradient buffers and optimizer state
    (moments and fp32 master) equal the plan's, up to the padding of each flat buffer (at most its shard group's
    size less one element per buffer); with EP 2 and TP 2 (EPSO and replicated) or ETP 2 folded over the ranks."""
    layout = Layout(4, strategy=strategy_name, ep=2, mode=mode or "ep_aware", ranks_per_node=2, ranks_per_gpu=2,
                    tp=tp, etp=etp)  # fmt: skip
    (planned,) = state_bytes(_config(), layout)
    planned = {"weights": planned["weights"], "gradients": planned["gradients"],
               "optimizer": planned["master"] + planned["moments"]}  # fmt: skip
    for held, buffers in run_pooled_test(_held, 4, strategy_name=strategy_name, mode=mode, tp=tp, etp=etp,
                                         timeout=300):  # fmt: skip
        for kind, value in held.items():
            per_element = {"weights": 2, "gradients": 4, "optimizer": 12}[kind]
            slack = buffers * 3 * per_element * (2 if strategy_name == "zero_topo" else 1)  # padding, < 4 per buffer
            assert planned[kind] <= value <= planned[kind] + slack, (kind, planned[kind], value)


def test_layouts_that_cannot_run_are_named():
    """Sizes that do not divide (pp x ep x etp, pp x tp, heads, intermediate size), an EP the experts do not split
    into, sequence parallelism without TP, 'dp' mode with TP, tensor parallelism or pipeline stages under zero_topo,
    an EP group larger than a node, context parallelism beside what it does not run with (expert tensor
    parallelism, zero_topo): one ValueError each, naming the values."""
    config = MulaConfig.from_name("mula-7b-a1b")
    cases = [
        (Layout(12, ep=5), r"pp \(1\) x ep \(5\) must divide the world size \(12\)"),
        (Layout(32, ep=16, pp=2), None),
        (Layout(40, ep=40), r"ep \(40\) must divide the experts of mula-7b-a1b \(64\)"),
        (Layout(16, tp=3), r"pp \(1\) x tp \(3\) must divide the world size \(16\)"),
        (Layout(32, tp=32), r"tp_size \(32\) must divide num_heads \(16\), num_kv_heads \(16\)"),
        (Layout(16, sp=True), r"sequence parallelism .* needs tp > 1"),
        (Layout(16, tp=2, mode="dp"), r"sharded_optimizer='dp' does not run with tp \(2\) or etp \(1\)"),
        (Layout(16, etp=3), r"pp \(1\) x ep \(1\) x etp \(3\) must divide the world size \(16\)"),
        (Layout(48, ep=2, etp=3), r"etp \(3\) must divide the experts' intermediate_size \(1024\)"),
        (Layout(16, strategy="zero_topo", tp=2, ranks_per_node=8), r"zero_topo has no tensor .* \(tp 2, etp 1\)"),
        (Layout(16, strategy="zero_topo", pp=2, ranks_per_node=8), r"zero_topo has no pipeline parallelism \(pp 2\)"),
        (Layout(16, strategy="zero_topo", ep=16, ranks_per_node=8), r"ep_size \(16\) must divide the ranks of a node"),
        (Layout(40, pp=5), r"num_layers \(16\) must be divisible by the pipeline stages \(5"),
        (Layout(16, cp=4, tp=8), r"pp \(1\) x cp \(4\) x tp \(8\) must divide the world size \(16\)"),
        (Layout(16, cp=2, pp=2), None),
        (Layout(16, cp=2, etp=2), r"cp \(2\) > 1 with etp \(2\) > 1 is not supported yet"),
        (Layout(16, cp=2, tp=2, sp=True), None),
        (Layout(16, cp=2, strategy="zero_topo", ranks_per_node=8), r"cp \(2\) > 1 runs under epso, not zero_topo"),
        (Layout(16, cp=0), r"cp \(0\) must be a positive integer"),
        (Layout(16, cp=4, tp=2, ep=8), None),
    ]
    for layout, message in cases:
        if message is None:
            state_bytes(config, layout)
            continue
        with pytest.raises(ValueError, match=message):
            state_bytes(config, layout)
