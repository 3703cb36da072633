"""``mula plan --search``: every layout of a preset on a cluster planned, those that fit ranked by predicted step
time, the others kept with their reason; the Aurora paper's own layouts are among those that fit."""

import json

import pytest

from mula_lightning.cli import main as mula
from mula_lightning.models import MulaConfig
from mula_lightning.plan import Layout
from mula_lightning.plan.clusters import CLUSTERS
from mula_lightning.plan.planner import Training, plan_layout
from mula_lightning.plan.search import candidates, search

PAPER = {  # preset: the paper's (ep, pp) on 256 Aurora nodes (Section 2.2); the 1B and 7B ran DP=3072
    "mula-1b": (1, 1),
    "mula-7b-a1b": (1, 1),
    "mula-20b-a2b": (12, 1),
    "mula-100b-a7b": (12, 4),
    "mula-220b-a10b": (12, 8),
}


@pytest.mark.parametrize("preset", list(PAPER))
def test_every_table_1_preset_has_layouts_that_fit_aurora_and_the_papers_is_one(preset):
    """256 nodes, the recipes' global batch (3072 sequences of 2048): layouts fit; the paper's EP x PP with EPSO is
    among them; the list is sorted by step time; every rejected layout says why; nothing that fits exceeds the
    device less its reserve; the 220B fits without pipelining only with EP spread over 4 nodes."""
    cluster = CLUSTERS["aurora"]
    result = search(MulaConfig.from_name(preset), cluster, 256)
    fitting = result["layouts"]
    assert fitting and result["global_batch"] == 3072
    ep, pp = PAPER[preset]
    assert any((p["ep"], p["pp"], p["strategy"], p["mode"]) == (ep, pp, "epso", "ep_aware") for p in fitting)
    times = [p["step_time_s"] for p in fitting]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert all(p["memory_bytes"]["total"] <= cluster.memory_bytes - cluster.reserved_bytes for p in fitting)
    assert all(r["reason"] for r in result["rejected"])
    if preset == "mula-220b-a10b":  # without pipelining it fits only with EP across nodes (48: 4 nodes)
        assert {p["ep"] for p in fitting if p["pp"] == 1} == {48}
        assert any(
            r["pp"] == 1 and r["ep"] == 12 and r["reason"].startswith("stage 0 needs") for r in result["rejected"]
        )


def test_candidates_divide_and_the_command_line(capsys):
    """Every candidate's sizes divide (pp the layers and the world, ep the experts and a stage; zero_topo without
    pipelining and with EP inside a node; tp the node's devices and the heads, ep_aware with sequence parallelism);
    --search prints the 10 fastest and JSON lists all, each with the stable keys; a global batch is only split into
    whole batches (33 sequences: over 1, 3 or 11 distinct batches)."""
    config = MulaConfig.from_name("mula-7b-a1b")
    cluster = CLUSTERS["frontier"]
    layouts = list(candidates(config, cluster, 4))
    assert {lay.strategy for lay in layouts} == {"epso", "zero_topo"}
    for lay in layouts:
        assert config.num_layers % lay.pp == 0 and 32 % (lay.pp * lay.ep) == 0 and config.num_experts % lay.ep == 0
        assert lay.strategy == "epso" or (lay.pp == 1 and 8 % lay.ep == 0)
        assert lay.tp == 1 or (8 % lay.tp == 0 and config.num_heads % lay.tp == 0 and lay.sp and lay.mode == "ep_aware")
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert mula(["plan", "mula-7b-a1b", "--cluster", "frontier", "--nodes", "4", "--search"]) == 0
    out = capsys.readouterr().out
    assert "--search:" in out and out.count("\n  1 ") == 1 and "\n 10 " in out
    assert mula(["plan", "mula-7b-a1b", "--cluster", "frontier", "--nodes", "4", "--search", "--json",
                 "--global-batch", "64"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["global_batch"] == 64 and result["layouts"]
    for key in ("dp", "ep", "etp", "tp", "pp", "strategy", "fits", "reason", "memory_bytes", "comm_bytes",
                "step_time_s", "tokens_per_s", "mfu"):  # fmt: skip
        assert key in result["layouts"][0]
    assert mula(["plan", "mula-7b-a1b", "--cluster", "frontier", "--nodes", "4", "--search", "--global-batch", "33",
                 "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert all(33 % (32 // (p["pp"] * p["tp"])) == 0 for p in result["layouts"])
    assert any(r["reason"].startswith("the global batch (33) does not divide") for r in result["rejected"])


def test_long_sequences_are_searched_with_context_parallelism():
    """The search tries CP only where each of a sequence's 2 x cp chunks keeps CP_MIN_CHUNK tokens (none at 2,048
    tokens; CP 2 to 8 at 32K on 2 DGX-H100 nodes), under epso, alone or beside TP with SP, with pipelining too; at
    64K the fastest layout that fits is context parallel, and a CP layout holds fewer activations per rank than the
    same layout without CP."""
    config, cluster = MulaConfig.from_name("mula-7b-a1b"), CLUSTERS["dgx-h100"]
    assert {lay.cp for lay in candidates(config, cluster, 2, seq_len=2048)} == {1}
    long = [lay for lay in candidates(config, cluster, 2, seq_len=32768) if lay.cp > 1]
    assert {lay.cp for lay in long} == {2, 4, 8}  # CP 16 would leave chunks of 1,024 tokens
    assert all(lay.strategy == "epso" and lay.sp == (lay.tp > 1) and lay.mode == "ep_aware" for lay in long)
    assert {lay.pp for lay in long} == {1, 2, 4, 8}  # CP 2 x PP 16 would need 32 ranks
    assert {lay.tp for lay in long} == {1, 2, 4, 8} and all(16 % (lay.cp * lay.tp) == 0 for lay in long)
    result = search(config, cluster, 2, seq_len=65536)
    fastest = result["layouts"][0]
    assert fastest["cp"] > 1, fastest
    training = Training(seq_len=65536, checkpointing=fastest["activation_checkpointing"])
    sizes = dict(ep=fastest["ep"], tp=fastest["tp"], ranks_per_node=8)
    plain = plan_layout(config, Layout(16, **sizes), cluster, training)["memory_bytes"]["activations"]
    split = plan_layout(config, Layout(16, cp=fastest["cp"], **sizes), cluster, training)["memory_bytes"]
    assert split == fastest["memory_bytes"] and split["activations"] < 0.6 * plain
