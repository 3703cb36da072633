"""``mula plan --optimizer muon`` (:mod:`mula_lightning.plan.muon`): Muon's owners, momentum bytes and Newton-Schulz
FLOPs per rank, against what :class:`~mula_lightning.parallel.sharded_muon.ShardedMuon` really holds.

* 4 gloo ranks, bf16-true, DP 2 x EP 2 in every ``epso`` mode, one step: every rank's optimizer bytes (momentum,
  AdamW moments, float32 master), Muon elements and Newton-Schulz FLOPs equal the plan of that rank; the plan's row
  is the busiest rank's;
* one rank (``none``): the Newton-Schulz FLOPs are those of every matrix ``muon_param_groups`` gives Muon, counted
  from a model built here, and the step time grows by them at the cluster's matmul rate; Muon's elements cost 4
  bytes of state where AdamW's cost 8;
* the trace at 24 ranks (PP 2 x EP 4 x DP 3) holds each traced rank's own planned bytes;
* a fit config's ``model.optimizer`` is read; ``zero_topo`` and tensor parallelism with Muon are refused in one
  line; the search plans only the layouts Muon runs under.
"""

import json

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.cli import main as mula
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.optim.muon import MuonAdamW, muon_param_groups, newton_schulz_flops
from mula_lightning.parallel.params import is_expert_param, local_tensor
from mula_lightning.plan import CLUSTERS, Layout, Training, plan_layout, state_bytes
from mula_lightning.plan.cli import part_of_node
from mula_lightning.plan.muon import stage_muon
from mula_lightning.testing import run_pooled_test

MUON_FAMILIES = ("muon_non_expert", "muon_expert")


def _config():
    """Three layers of uneven matrices (grouped-query attention: k and v narrower than q and o), 4 experts."""
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1,
        intermediate_size=24, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


def _held(rank, world_size, mode):
    from mula_lightning.strategies import FabricEPSOStrategy

    strategy = FabricEPSOStrategy(ep_size=2, sharded_optimizer=mode, bucket_numel=None)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, MuonAdamW(muon_param_groups(model), lr=1e-3))
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))
    fabric.backward(model(x, labels=x).loss)
    optimizer.step()
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    owned = [seg for fam in MUON_FAMILIES if fam in inner.buffers for seg in inner.buffers[fam].segments]
    assert all(seg.numel == seg.slot.numel for seg in owned)  # whole matrices
    padding = sum(b.numel - sum(s.numel for s in b.slots) for buf in inner.buffers.values() for b in buf.buckets)
    return {
        "optimizer": inner.state_bytes(),
        "muon_elements": sum(seg.numel for seg in owned),
        "flops": sum(newton_schulz_flops(local_tensor(seg.slot.param).shape) for seg in owned),
        "padding": padding,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["none", "dp", "ep_aware"])
def test_each_ranks_planned_muon_state_equals_what_sharded_muon_holds(mode):
    """DP 2 x EP 2, bf16-true, one step of MuonAdamW under ``epso``: for every rank the plan of that rank gives its
    optimizer bytes (up to the AdamW families' padding, 12 bytes an element), its Muon elements and its
    Newton-Schulz FLOPs exactly; the plan's own row is the rank with the most."""
    config = _config()
    layout = Layout(4, ep=2, mode=mode, optimizer="muon")
    (share,) = stage_muon(config, 1, 4, 2, mode)
    held = run_pooled_test(_held, 4, mode=mode, timeout=300)
    planned = []
    for rank, got in enumerate(held):
        (row,) = state_bytes(config, layout, rank=rank)
        planned.append(row["master"] + row["moments"])
        assert abs(got["optimizer"] - planned[-1]) <= 12 * got["padding"], (rank, got, row)
        assert got["muon_elements"] == share.rank_elements(rank) and got["flops"] == share.rank_flops(rank), rank
    (worst,) = state_bytes(config, layout)
    assert worst["master"] + worst["moments"] == max(planned)
    if mode != "none":  # whole matrices per owner: the ranks differ
        assert len({h["muon_elements"] for h in held}) > 1


def test_newton_schulz_flops_and_momentum_of_one_rank_and_the_step_time():
    """One rank of mula-7b-a1b (nothing sharded): the plan's Newton-Schulz FLOPs are the sum over every tensor
    ``muon_param_groups`` gives Muon in a model built here; the step time is AdamW's plus those FLOPs at the
    cluster's matmul rate; the Muon elements' state is 4 bytes, not 8; at DP 2 x EP 4 ``ep_aware`` the busiest
    owner does at least an eighth of its slice's iteration and less than all of it."""
    config = MulaConfig.from_name("mula-7b-a1b")
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    (muon_group, _) = muon_param_groups(model)
    total = sum(newton_schulz_flops(p.shape) for p in muon_group["params"])
    elements = sum(p.numel() for p in muon_group["params"])
    cluster, training = part_of_node(CLUSTERS["dgx-h100"], 1), Training(micro_batch_size=1, seq_len=2048)
    adamw = plan_layout(config, Layout(1), cluster, training)
    muon = plan_layout(config, Layout(1, optimizer="muon"), cluster, training)
    assert muon["muon"]["newton_schulz_flops"] == [total]
    rate = cluster.peak_flops * cluster.matmul_efficiency
    assert muon["time"]["optimizer_s"] == pytest.approx(total / rate, rel=1e-12)
    assert muon["step_time_s"] == pytest.approx(adamw["step_time_s"] + total / rate, rel=1e-12)
    assert adamw["memory_bytes"]["moments"] - muon["memory_bytes"]["moments"] == 4 * elements
    assert adamw["memory_bytes"]["master"] == muon["memory_bytes"]["master"]
    sharded = plan_layout(config, Layout(8, ep=4, optimizer="muon"), CLUSTERS["dgx-h100"], training)
    local = sum(newton_schulz_flops((p.shape[0] // 4, *p.shape[1:]) if is_expert_param(n) else p.shape)
                for n, p in model.named_parameters() if any(p is q for q in muon_group["params"]))  # fmt: skip
    assert local / 8 <= sharded["muon"]["newton_schulz_flops"][0] < local


def test_traced_ranks_hold_their_own_planned_muon_state(capsys):
    """mula-7b-a1b on 2 Aurora nodes, PP 2 x EP 4 x DP 3 with Muon: the real set-up of ranks 0, 5 and -1 (both
    stages) holds the plan of each rank (``check_trace`` compares every kind of state), and at most the plan's
    busiest rank (up to the AdamW buffers' padding)."""
    assert mula(["plan", "mula-7b-a1b", "--nodes", "2", "--ep", "4", "--pp", "2", "--optimizer", "muon", "--trace",
                 "--ranks", "0,5,-1", "--json"]) == 0  # fmt: skip
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    assert layout["optimizer"] == "muon" and [t["rank"] for t in layout["traced"]] == [0, 5, 23]
    for t in layout["traced"]:
        slack = 8 * t["padding_elements"]  # the AdamW families' flat buffers pad; Muon's do not
        assert t["memory_bytes"]["moments"] <= layout["stages"][t["stage"]]["moments"] + slack


def test_configs_refusals_and_the_search(capsys):
    """The Muon example config plans with Muon (``model.optimizer``); ``--optimizer adamw`` overrides it; Muon under
    ``zero_topo`` or with tensor parallelism is refused in one line naming it; ``--search --optimizer muon`` plans
    only ``epso`` layouts without tensor parallelism and says so."""

    def run(*args):
        assert mula(["plan", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    config = "examples/configs/mula-tiny-moe-muon.yaml"
    (layout,) = run("--config", config, "--cluster", "dgx-h100")["layouts"]
    assert layout["optimizer"] == "muon" and layout["muon"]["newton_schulz_flops"][0] > 0
    assert run("--config", config, "--cluster", "dgx-h100", "--optimizer", "adamw")["layouts"][0]["muon"] is None
    for args, message in (
        (["--strategy", "zero_topo"], "optimizer 'muon' runs under epso, not zero_topo"),
        (["--tp", "2"], "optimizer 'muon' with tp (2) or etp (1) > 1 is not supported"),
        (["--etp", "2"], "optimizer 'muon' with tp (1) or etp (2) > 1 is not supported"),
    ):
        assert mula(["plan", "mula-7b-a1b", "--optimizer", "muon", *args]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    found = run("mula-7b-a1b", "--nodes", "2", "--optimizer", "muon", "--search")
    assert found["optimizer"] == "muon" and found["layouts"]
    assert {(p["strategy"], p["tp"], p["optimizer"]) for p in found["layouts"]} == {("epso", 1, "muon")}
    assert mula(["plan", "mula-7b-a1b", "--nodes", "2", "--optimizer", "muon", "--search"]) == 0
    assert "optimizer muon; the 10 fastest" in capsys.readouterr().out
