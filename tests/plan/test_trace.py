"""``mula plan --trace``: the real set-up code of chosen ranks at the full world size under torch's fake process
group, compared with the plan.

In ``make test`` the worlds are smaller than the papers' (192 and 32 ranks; the 12,288-rank 220B recipe and the
384-rank ZeRO-topo layout are in BENCHMARKS.md): the traced bytes of every state kind equal the plan's up to the
flat buffers' padding, every group has the layout's size and contains the rank, the checkpoint's DCP plan names the
rank's file, and each traced process stays below 4 GB resident; the items the trace says each rank writes are those
a real save of 4 gloo ranks writes. A disagreement and a rank outside the world are named in one line.
"""

import json

import pytest

from mula_lightning.cli import main as mula
from mula_lightning.plan import Layout
from mula_lightning.plan.trace import TRACED_KINDS, check_trace

GB = 10**9


def _traced(capsys, *args):
    assert mula(["plan", *args, "--trace", "--json"]) == 0
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    return layout, layout["traced"]


def test_epso_pipeline_and_experts_at_192_ranks(capsys):
    """mula-7b-a1b on 16 Aurora nodes, PP 4 x EP 4 x DP 12: ranks 0 (first stage) and -1 (last) hold the planned
    bytes, their groups have the layout's sizes (EP 4 in a node, the 12 replicas of their expert slice, their 48-rank
    stage, the 4-rank pipeline), each writes its own DCP file, and the process stays below 4 GB."""
    layout, traced = _traced(capsys, "mula-7b-a1b", "--nodes", "16", "--ep", "4", "--pp", "4", "--ranks", "0,-1")
    assert [t["rank"] for t in traced] == [0, 191] and [t["stage"] for t in traced] == [0, 3]
    for t in traced:
        planned = layout["stages"][t["stage"]]
        for kind in TRACED_KINDS:
            held = t["memory_bytes"][kind]
            assert abs(held - planned[kind]) <= t["padding_elements"] * 8, (kind, held, planned[kind])
        assert {k: len(v) for k, v in t["groups"].items()} == {"ep": 4, "edp": 12, "stage": 48, "pp": 4}
        assert t["groups"]["ep"] == list(range(t["rank"] // 4 * 4, t["rank"] // 4 * 4 + 4))
        assert t["checkpoint_files"] == [f"__{t['rank']}_0.distcp"] and t["checkpoint_bytes"] > 0
        assert t["peak_resident_bytes"] < 4 * GB


def test_tensor_and_expert_tensor_parallelism_folded_at_96_ranks(capsys):
    """mula-7b-a1b on 8 Aurora nodes, PP 2 x EP 4 x ETP 2 with TP 2 and sequence parallelism folded over the same
    ranks, replicated optimizer: rank -1 holds the planned bytes (its tensor-parallel shards counted locally), its
    tp group is its 2 neighbours, its dense layers' 24 replicas of a shard span the stage, its experts' block is its
    8 consecutive ranks."""
    layout, (t,) = _traced(capsys, "mula-7b-a1b", "--nodes", "8", "--ep", "4", "--etp", "2", "--tp", "2", "--sp", "2",
                           "--pp", "2", "--mode", "none", "--ranks", "-1")  # fmt: skip
    assert (t["rank"], t["stage"], layout["sp"], layout["dense_dp"], layout["dp"]) == (95, 1, True, 24, 6)
    for kind in TRACED_KINDS:
        assert abs(t["memory_bytes"][kind] - layout["stages"][1][kind]) <= t["padding_elements"] * 8, kind
    assert t["groups"]["tp"] == [94, 95] and t["groups"]["expert"] == list(range(88, 96))
    assert t["groups"]["dense_dp"] == list(range(49, 96, 2)) and len(t["groups"]["edp"]) == 6
    assert t["peak_resident_bytes"] < 4 * GB


def test_context_parallelism_folded_with_experts_and_tensor_parallelism_at_96_ranks(capsys):
    """mula-7b-a1b on 8 Aurora nodes at 32K tokens, CP 4 x TP 2 (with SP) x EP 4: rank -1 holds the planned bytes,
    its cp group is the 4 ranks of its tp slice that read its batch (stride tp), the replicas of its dense shard are
    the dp x cp ranks of that slice (48), its experts' 4 consecutive ranks; the plan counts the keys' and values'
    exchanges over the cp group and an eighth of a sequence's tokens dispatched per rank (a quarter, split over tp)."""
    layout, (t,) = _traced(capsys, "mula-7b-a1b", "--nodes", "8", "--ep", "4", "--cp", "4", "--tp", "2", "--sp", "2",
                           "--seq-len", "32768", "--ranks", "-1")  # fmt: skip
    assert (t["rank"], layout["cp"], layout["dense_dp"], layout["dp"]) == (95, 4, 48, 24)
    for kind in TRACED_KINDS:
        assert abs(t["memory_bytes"][kind] - layout["stages"][0][kind]) <= t["padding_elements"] * 8, kind
    assert t["groups"]["cp"] == [89, 91, 93, 95] and t["groups"]["tp"] == [94, 95]
    assert t["groups"]["dense_dp"] == list(range(1, 96, 2)) and t["groups"]["ep"] == [92, 93, 94, 95]
    rows = {(c["tag"], c["op"]): c for c in layout["collectives"]}
    assert rows["cp.kv", "all_gather"]["group_size"] == 4 and rows["cp.kv", "reduce_scatter"]["calls"] == 16
    assert rows["moe.dispatch.x", "all_gather"]["bytes_sent"] == 16 * 3 * 4096 * 2048 * 2  # 16 MoE layers, 3 of 4
    assert t["peak_resident_bytes"] < 4 * GB


def test_zero_topo_three_levels_with_experts(capsys):
    """mula-7b-a1b with zero_topo and EP 8 on 4 Frontier nodes (32 GCDs): the traced engine holds the planned
    weights, gradients and optimizer states of its three levels (up to the units' padding); the engine's own groups:
    its dense weight group is its GPU's 2 GCDs, its gradient group its node, and its expert slice (EP 8 = a node) is
    not sharded inside the node, its gradient shard all-reduced over the slice's replica on each of the 4 nodes."""
    layout, (t,) = _traced(capsys, "mula-7b-a1b", "--cluster", "frontier", "--nodes", "4", "--strategy", "zero_topo",
                           "--ep", "8", "--ranks", "-3")  # fmt: skip
    assert (
        t["rank"] == 29 and t["groups"]["dense.weight"] == [28, 29] and t["groups"]["dense.grad"] == list(range(24, 32))
    )
    assert t["groups"]["expert.grad_cross"] == [5, 13, 21, 29] and t["groups"]["expert.weight"] == [29]  # one per GPU
    assert t["memory_bytes"]["weights"] == pytest.approx(layout["stages"][0]["weights"], abs=t["padding_elements"] * 2)
    assert t["peak_resident_bytes"] < 4 * GB


def test_disagreements_and_bad_ranks_are_named(capsys):
    """A traced rank holding other bytes than the plan, or a group without the rank, raises naming both values;
    --ranks outside the world or not integers: exit code 1 and one line."""
    layout = Layout(8, ep=2, ranks_per_node=4)
    planned = {"stages": [{"weights": 100, "gradients": 200, "master": 50, "moments": 100}]}
    good = {"weights": 100, "gradients": 200, "master": 50, "moments": 100}
    groups = {"ep": [2, 3], "edp": [1, 3, 5, 7], "stage": list(range(8)), "pp": [3]}
    check_trace({"rank": 3, "measured": dict(good), "padding_elements": 0, "groups": groups}, planned, layout)
    with pytest.raises(
        ValueError, match=r"traced rank 3: gradients 260 bytes, the plan says 200 \(padding allows 40\)"
    ):
        check_trace({"rank": 3, "measured": {**good, "gradients": 260}, "padding_elements": 10, "groups": groups},
                    planned, layout)  # fmt: skip
    with pytest.raises(ValueError, match=r"traced rank 3: its edp group \[0, 2, 4, 6\] \(4 ranks\) should hold 4"):
        check_trace({"rank": 3, "measured": dict(good), "padding_elements": 0,
                     "groups": {**groups, "edp": [0, 2, 4, 6]}}, planned, layout)  # fmt: skip
    for ranks, message in [("0,99999", "rank 99999 is outside the world of 12 ranks (0 to 11, or -1 to -12)"),
                           ("first", "--ranks ('first') must be comma-separated integers")]:  # fmt: skip
        assert mula(["plan", "mula-1b", "--trace", "--ranks", ranks]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def _config():
    from mula_lightning.models import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=16, num_experts=4, top_k=2,
    )  # fmt: skip


SAVES = {  # name: strategy, its arguments
    "epso ep2 tp2": ("epso", dict(ep_size=2, tp_size=2)),
    "epso pp2 ep2": ("epso", dict(ep_size=2, pp_size=2, pp_microbatches=2)),
    "zero_topo ep2": ("zero_topo", dict(ep_size=2, ranks_per_node=2, ranks_per_gpu=2)),
}


def _save(rank, world_size, name, path):
    import torch
    from lightning.fabric import Fabric

    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    kind, kwargs = SAVES[name]
    strategy = FabricEPSOStrategy(**kwargs) if kind == "epso" else FabricZeroTopoStrategy(**kwargs)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank // kwargs.get("tp_size", 1)))
    if kwargs.get("pp_size", 1) > 1:
        strategy.pipeline_step(x, x)
    else:
        fabric.backward(model(x, labels=x).loss)
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer})


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SAVES))
def test_traced_checkpoint_writes_equal_a_real_save(name, tmp_path):
    """The DCP items the trace says each rank writes (the DP-scattered choice of a writer for every replicated item)
    are those a real save of the same layout on 4 gloo ranks puts in that rank's file: ``epso`` EP 2 x TP 2, PP 2 x
    EP 2, and ``zero_topo`` (EP 2, weights over a GPU's 2 ranks)."""
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader

    from mula_lightning.plan.trace import trace
    from mula_lightning.testing import run_pooled_test

    kind, kwargs = SAVES[name]
    path = tmp_path / "ckpt"
    run_pooled_test(_save, 4, name=name, path=str(path), timeout=300)
    items: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        items[info.relative_path] = items.get(info.relative_path, 0) + 1
    spec = {
        "config": dataclasses.asdict(_config()), "world_size": 4, "strategy": kind, "ep": 2,
        "pp": kwargs.get("pp_size", 1),
        "tp": kwargs.get("tp_size", 1), "etp": 1, "sp": False, "mode": "ep_aware", "precision": "bf16-true",
        "zero_sizes": (0, 0, 0, 0), "ranks_per_node": 2, "ranks_per_gpu": kwargs.get("ranks_per_gpu", 1),
        "dispatcher": "allgather", "checkpointing": None, "schedule": "1f1b", "micro_batches": 2, "virtual": 1,
        "reduce_dtype": "float32", "bucket_numel": 40_000_000,
    }  # fmt: skip
    traced = {t["rank"]: t for t in trace(spec, [0, 1, 2, 3])}
    for rank, t in traced.items():
        written = items.get(f"__{rank}_0.distcp", 0)
        assert (t["checkpoint_items"], t["checkpoint_files"]) == (written, [f"__{rank}_0.distcp"] if written else [])
