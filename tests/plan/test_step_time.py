"""``mula_lightning.plan.step_time``: the predicted step follows its stated assumptions: FLOPs as the model counts
them, the 1F1B bubble, recomputation's extra forward, communication hidden behind compute only where it overlaps,
and MFU from the model's FLOPs."""

import dataclasses

import pytest

from mula_lightning.models import MulaConfig
from mula_lightning.plan import Layout, Training, plan_layout
from mula_lightning.plan.clusters import CLUSTERS, GB
from mula_lightning.plan.step_time import flops_per_token


@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=True, shared_experts=1, moe_layers=[1, 3])])
@pytest.mark.parametrize("preset", ["mula-1b", "mula-20b-a2b", "mula-tiny-moe"])
def test_flops_per_token_is_the_models(preset, overrides):
    """The cached count equals :meth:`MulaConfig.flops_per_token` (the throughput callback's MFU numerator)."""
    if overrides and preset == "mula-1b":
        overrides = dict(tie_word_embeddings=True)
    config = MulaConfig.from_name(preset, **overrides)
    assert flops_per_token(config, 1000) == config.flops_per_token(1000)


def _plan(config, cluster=CLUSTERS["aurora"], nodes=32, **kwargs):
    layout_keys = {"ep", "pp", "mode", "strategy"}
    layout = Layout(
        nodes * cluster.devices_per_node,
        ranks_per_node=cluster.devices_per_node,
        ranks_per_gpu=cluster.devices_per_gpu,
        **{k: v for k, v in kwargs.items() if k in layout_keys},
    )
    training = Training(**{k: v for k, v in kwargs.items() if k not in layout_keys})
    return plan_layout(config, layout, cluster, training)


def test_bubble_recomputation_and_mfu():
    """mula-100b-a7b, PP 4 x EP 12: the 1F1B bubble is (pp - 1) micro-batch times, so 8 micro-batches cost 11 and
    16 cost 19 of them; recomputing the expert blocks adds their forward (a third of their training FLOPs); MFU is the
    model's FLOPs over step time x ranks x peak, below the assumed GEMM efficiency."""
    config = MulaConfig.from_name("mula-100b-a7b")
    eight = _plan(config, ep=12, pp=4, micro_batch_size=8, micro_batches=8)["time"]
    sixteen = _plan(config, ep=12, pp=4, micro_batch_size=16, micro_batches=16)["time"]
    per_micro = eight["bubble_s"] / 3
    assert eight["compute_s"] + eight["bubble_s"] == pytest.approx(11 * per_micro)
    assert sixteen["compute_s"] + sixteen["bubble_s"] == pytest.approx(19 * per_micro)
    recomputed = _plan(config, ep=12, pp=4, micro_batch_size=8, micro_batches=8, checkpointing=["moe"])["time"]
    assert eight["compute_s"] < recomputed["compute_s"] < 4 / 3 * eight["compute_s"]
    cluster = CLUSTERS["aurora"]
    mfu = config.flops_per_token(2048) * eight["tokens_per_step"] / (eight["step_time_s"] * 384 * cluster.peak_flops)
    assert eight["mfu"] == pytest.approx(mfu) and eight["mfu"] < cluster.matmul_efficiency
    assert eight["tokens_per_step"] == 96 * 8 * 2048  # 384 ranks / 4 stages read their own 8 sequences


def test_communication_exposed_only_where_it_cannot_overlap():
    """mula-20b-a2b, EP 12 within the node: faster node links shorten the step (the dispatch is exposed), faster
    inter-node links too (the weights' all-gather after the update); with replicated states (``none``: all-reduces
    only, bucket by bucket in the last backward) on a slow device, whose backward hides them, the inter-node link does
    not matter; on the nominal device it does (the backward of one micro-batch is shorter than the all-reduce)."""
    config = MulaConfig.from_name("mula-20b-a2b")
    aurora = CLUSTERS["aurora"]
    links = dict(aurora.bandwidths)

    def step(mode, efficiency=aurora.matmul_efficiency, **bandwidths):
        cluster = dataclasses.replace(
            aurora, bandwidths=tuple({**links, **bandwidths}.items()), matmul_efficiency=efficiency
        )
        return _plan(config, cluster, ep=12, mode=mode, micro_batches=4)["time"]["step_time_s"]

    base = step("ep_aware")
    assert step("ep_aware", intra_node=2 * links["intra_node"]) < base
    assert step("ep_aware", inter_node=2 * links["inter_node"]) < base
    assert step("none", 0.01, inter_node=100 * GB) == pytest.approx(step("none", 0.01))
    assert step("none", inter_node=100 * GB) < step("none")
