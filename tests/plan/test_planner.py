"""``mula_lightning.plan.planner``: the communication buffers and step transients it adds to the states, as its
docstring states them (``benchmarks/memory.py`` sets the totals against measured steps: float32 within 10%)."""

import dataclasses

from mula_lightning.models import MulaConfig
from mula_lightning.plan import CLUSTERS, Layout, Training, plan_layout

TRAINING = Training(micro_batch_size=1, seq_len=64)


def test_buffers_of_each_strategy_and_library():
    """mula-tiny-moe on 4 ranks, float32: ``epso`` holds the reduce-scatter outputs and the largest gradient
    (the head's, vocabulary x hidden) in backward, and, where the library does not gather in place (gloo), every
    local weight again while the gathers are in flight; ``zero_topo`` the root unit with its gradient, two layers
    and one layer's gradient, and the largest gradient."""
    config = MulaConfig.from_name("mula-tiny-moe")
    nccl = dataclasses.replace(CLUSTERS["dgx-h100"], devices_per_node=4)
    gloo = dataclasses.replace(nccl, inplace_all_gather=False)
    layout = Layout(4, ep=2, precision="32-true", ranks_per_node=4)
    states = plan_layout(config, layout, nccl, TRAINING)["stages"][0]
    largest = config.vocab_size * config.hidden_size * 4
    assert states["buffers"] == states["moments"] // 8 * 4 + largest
    local = (states["weights"]) // 4  # float32 elements this rank holds
    assert plan_layout(config, layout, gloo, TRAINING)["stages"][0]["buffers"] == max(states["buffers"], local * 4)
    zero = plan_layout(config, Layout(4, strategy="zero_topo", ep=2, precision="32-true", ranks_per_node=4), nccl,
                       TRAINING)["stages"][0]  # fmt: skip
    h = config.hidden_size
    root = 2 * config.vocab_size * h + h
    ne, e = config.layer_params(0)
    assert zero["buffers"] == root * 8 + (ne + e // 2) * 12 + largest
