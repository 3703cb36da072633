"""``mula_lightning.plan.comm``: the planned bytes per collective per level of one optimizer step equal what the
communication ledger records on every rank of real gloo runs.

4 ranks (2 nodes of 2), a 4-layer MoE model whose layers 1 and 3 are MoE (routing forced uniform, so the all-to-all
pairs are the plan's balanced ones), one optimizer step of 2 micro-batches:

* ``epso`` DP 2 x EP 2: ``ep_aware`` with the all-gather dispatcher and bf16 gradient reduction; ``dp`` with the
  all-to-all dispatcher and the expert blocks recomputed; ``none`` with whole layers recomputed;
* ``epso`` PP 2 x EP 2 (1F1B, 2 micro-batches): each stage's ranks against the plan of their stage;
* ``zero_topo`` with EP 2 (weights on 1 rank, gradients over the node, optimizer states over all 4);
* tensor parallelism folded over the same ranks (DTensor's collectives recorded): TP 2 x EP 2; TP 2 with sequence
  parallelism, the all-to-all dispatcher, ``none`` and attention and MLPs recomputed in float32; ETP 2 x EP 2; TP 2
  with SP x ETP 2 with the expert blocks recomputed; TP 2 with SP x EP 2 with whole layers recomputed; PP 2 x TP 2
  x EP 2;
* context parallelism folded over the same ranks: CP 2 x TP 2 with SP x EP 2 with the all-to-all dispatcher,
  attention and the expert blocks recomputed in float32; CP 4 x EP 4 with whole layers recomputed; PP 2 x CP 2
  folded with EP 2.

The bytes one micro-batch keeps for backward equal the plan's too (every case without pipelining).

Every (tag, op, level) the ledger holds is in the plan with the same calls and bytes, and the plan holds nothing
the ledger lacks except the pipeline's point-to-point sends (``ledger=False``).
"""

import contextlib

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import CommLedger, record_functional_collectives
from mula_lightning.plan import Layout
from mula_lightning.plan.activations import saved_tensor_bytes, stage_activation_bytes
from mula_lightning.plan.comm import Batch, bytes_per_link, comm_bytes
from mula_lightning.plan.states import PRECISIONS
from mula_lightning.testing import run_pooled_test

V, H, T, MICRO, ACCUM = 64, 16, 8, 2, 2
HW = HardwareTopology.uniform(4, 2, 1)
CASES = {  # name: strategy, its arguments, precision
    "epso ep_aware allgather bf16-reduce": (
        "epso",
        dict(ep_size=2, sharded_optimizer="ep_aware", reduce_dtype=torch.bfloat16),
        "bf16-true",
    ),  # fmt: skip
    "epso dp alltoall moe-recompute": (
        "epso",
        dict(ep_size=2, sharded_optimizer="dp", dispatcher="alltoall", activation_checkpointing=["moe"]),
        "32-true",
    ),  # fmt: skip
    "epso ep_aware alltoall": ("epso", dict(ep_size=2, dispatcher="alltoall"), "bf16-true"),
    "epso none full-recompute": (
        "epso",
        dict(ep_size=2, sharded_optimizer="none", activation_checkpointing="full"),
        "bf16-true",
    ),  # fmt: skip
    "epso pp2 ep2 alltoall": (
        "epso",
        dict(ep_size=2, pp_size=2, pp_schedule="1f1b", pp_microbatches=ACCUM, dispatcher="alltoall"),
        "bf16-true",
    ),  # fmt: skip
    "zero_topo ep2": ("zero_topo", dict(ep_size=2, ranks_per_node=2, ranks_per_gpu=1, block_size=4), "bf16-true"),
    "epso tp2 ep2": ("epso", dict(tp_size=2, ep_size=2), "bf16-true"),
    "epso tp2 sp ep2 alltoall none attention-recompute": (
        "epso",
        dict(
            tp_size=2,
            sequence_parallel=True,
            ep_size=2,
            dispatcher="alltoall",
            sharded_optimizer="none",
            activation_checkpointing=["attention", "mlp"],
        ),
        "32-true",
    ),  # fmt: skip
    "epso etp2 ep2": ("epso", dict(etp_size=2, ep_size=2), "bf16-true"),
    "epso tp2 sp etp2 moe-recompute": (
        "epso",
        dict(tp_size=2, sequence_parallel=True, etp_size=2, activation_checkpointing=["moe"]),
        "bf16-true",
    ),  # fmt: skip
    "epso tp2 sp full-recompute": (
        "epso",
        dict(tp_size=2, sequence_parallel=True, ep_size=2, activation_checkpointing="full"),
        "bf16-true",
    ),  # fmt: skip
    "epso tp2 pp2 ep2": (
        "epso",
        dict(tp_size=2, ep_size=2, pp_size=2, pp_schedule="1f1b", pp_microbatches=ACCUM),
        "bf16-true",
    ),  # fmt: skip
    "epso cp2 tp2 sp ep2 alltoall attention-recompute": (
        "epso",
        dict(
            cp_size=2,
            tp_size=2,
            sequence_parallel=True,
            ep_size=2,
            dispatcher="alltoall",
            activation_checkpointing=["attention", "moe"],
        ),
        "32-true",
    ),  # fmt: skip
    "epso cp4 ep4 full-recompute": ("epso", dict(cp_size=4, ep_size=4, activation_checkpointing="full"), "bf16-true"),
    "epso cp2 pp2 ep2": (
        "epso",
        dict(cp_size=2, ep_size=2, pp_size=2, pp_schedule="1f1b", pp_microbatches=ACCUM),
        "bf16-true",
    ),  # fmt: skip
}


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=H, num_layers=4, num_heads=2, num_kv_heads=2,
        intermediate_size=8, num_experts=4, top_k=2, moe_layers=[1, 3], forced_uniform_routing=True,
    )  # fmt: skip


def _record(rank, world_size, name):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    kind, kwargs, precision = CASES[name]
    if kind == "epso":
        strategy = FabricEPSOStrategy(bucket_numel=None, **kwargs)
    else:
        strategy = FabricZeroTopoStrategy(**kwargs)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    group = kwargs.get("tp_size", 1) * kwargs.get("cp_size", 1)  # the ranks of a tp x cp group read one batch
    x = torch.randint(0, V, (MICRO * ACCUM, T), generator=torch.Generator().manual_seed(rank // group))
    ledger = CommLedger()
    for step in range(2):  # the second step is recorded: the pipeline's first infers its shapes with a forward
        with ledger if step else contextlib.nullcontext(), record_functional_collectives():
            if kind == "epso" and strategy.pp_size > 1:
                strategy.pipeline_step(x, x)
            else:
                for i in range(ACCUM):
                    mine = x[i * MICRO : (i + 1) * MICRO]
                    out = model(mine, labels=mine)
                    with fabric.no_backward_sync(model, enabled=i < ACCUM - 1):
                        fabric.backward((out.loss + out.aux_loss) / ACCUM)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the recipes clip: zero_topo's norm is a collective
            optimizer.step()
            optimizer.zero_grad()
    saved = None
    if not (kind == "epso" and strategy.pp_size > 1):  # one more micro-batch's forward: the bytes kept for backward
        with saved_tensor_bytes(lambda: model.parameters()) as saved:
            mine = x[:MICRO].clone()  # a view would keep (and count) the whole batch's storage
            model(mine, labels=mine, return_logits=False)
    got: dict = {}
    for r in ledger.records:
        calls, sent = got.get((r.tag, r.op, r.level), (0, 0))
        got[(r.tag, r.op, r.level)] = (calls + 1, sent + r.bytes_sent)
    return got, saved and saved["bytes"]


def _plan(name):
    kind, kwargs, precision = CASES[name]
    pp = kwargs.get("pp_size", 1)
    layout = Layout(4, strategy=kind, ep=kwargs.get("ep_size", 1), pp=pp,
                    mode=kwargs.get("sharded_optimizer", "ep_aware"), precision=precision, ranks_per_node=2,
                    ranks_per_gpu=1, tp=kwargs.get("tp_size", 1), etp=kwargs.get("etp_size", 1),
                    sp=kwargs.get("sequence_parallel", False), cp=kwargs.get("cp_size", 1),
                    extra={"block_size": kwargs.get("block_size", 256)})  # fmt: skip
    batch = Batch(MICRO, T, ACCUM)  # with PP too: the schedule cuts the rank's 4 sequences into ACCUM micro-batches
    reduce = "bfloat16" if kwargs.get("reduce_dtype") is torch.bfloat16 else "float32"
    return comm_bytes(_config(), layout, batch, HW, kwargs.get("dispatcher", "allgather"), reduce,
                      kwargs.get("activation_checkpointing"))  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_planned_collectives_equal_the_ledger_on_every_rank(name):
    """Every rank's ledger of one step equals its stage's planned (tag, op, level) -> (calls, bytes)."""
    stages = _plan(name)
    stage_size = 4 // len(stages)
    kind, kwargs, precision = CASES[name]
    (activations, *_) = stage_activation_bytes(
        _config(), 1, MICRO, T, ACCUM, PRECISIONS[precision], kwargs.get("ep_size", 1),
        kwargs.get("dispatcher", "allgather"), kwargs.get("activation_checkpointing"), tp=kwargs.get("tp_size", 1),
        sequence_parallel=kwargs.get("sequence_parallel", False), etp=kwargs.get("etp_size", 1),
        cp=kwargs.get("cp_size", 1),
    )  # fmt: skip
    for rank, (got, saved) in enumerate(run_pooled_test(_record, 4, name=name, ranks_per_node=2, timeout=300)):
        assert saved is None or saved == activations["per_micro_batch"], (name, rank, saved, activations)
        planned = stages[rank // stage_size]
        expected = {(c.tag, c.op, c.level): (c.calls, c.bytes_sent) for c in planned if c.ledger}
        assert got == expected, (name, rank, sorted(set(got.items()) ^ set(expected.items())))
        assert all(c.tag.startswith("pp.") for c in planned if not c.ledger)


def test_levels_of_the_papers_layouts():
    """mula-220b-a10b at PP 8 x EP 12 x DP 128 on Aurora (12 tiles per node, 2 per GPU): the token dispatch stays in
    the node (EP = a node), every optimizer collective crosses nodes, a pipeline send crosses nodes; bf16 gradient
    reduction halves the reduce-scatter's bytes."""
    config = MulaConfig.from_name("mula-220b-a10b")
    hw = HardwareTopology.uniform(12288, 12, 2)
    layout = Layout(12288, ep=12, pp=8, ranks_per_node=12, ranks_per_gpu=2)
    plain = comm_bytes(config, layout, Batch(1, 2048, 8), hw, "allgather", "float32")
    halved = comm_bytes(config, layout, Batch(1, 2048, 8), hw, "allgather", "bfloat16")
    for stage, half in zip(plain, halved):
        links = {c.tag: c.link for c in stage}
        assert {links[t] for t in links if t.startswith("moe.")} == {"intra_node"}
        assert {links[t] for t in links if t.startswith(("optimizer.", "pp."))} == {"inter_node"}
        rs = {c.tag: c.bytes_sent for c in stage if c.op == "reduce_scatter" and c.tag.startswith("optimizer.")}
        rs_half = {c.tag: c.bytes_sent for c in half if c.op == "reduce_scatter" and c.tag.startswith("optimizer.")}
        assert rs == {k: 2 * v for k, v in rs_half.items()}
        assert sum(bytes_per_link(stage).values()) == sum(c.bytes_sent for c in stage)
