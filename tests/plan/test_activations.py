"""``mula_lightning.plan.activations``: the planned bytes a micro-batch keeps for backward equal what autograd saves,
and the schedules hold the micro-batches they are documented to hold.

The measured side counts the distinct storages autograd saves during one training forward (fused head and loss)
of a model on the CPU, parameters excluded (:func:`saved_tensor_bytes`); the cases vary the family (dense, MoE with
dense layers and a shared expert, per-head and full-width q/k norms, none), the dtype (float32, bf16: the unfused
norm and the float32 router copies) and the recomputation (whole layers, the expert blocks, norms and attention,
norms and MLPs). Expert parallelism is measured in real processes in ``test_comm.py``.
"""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing
from mula_lightning.plan.activations import micro_batches_in_flight, saved_tensor_bytes, stage_activation_bytes

SHAPES = dict(vocab_size=96, hidden_size=24, num_heads=3, num_kv_heads=1, head_dim=8, intermediate_size=20)
CASES = [  # preset, overrides, dtype, activation_checkpointing
    ("mula-tiny-moe", {}, torch.float32, None),
    ("mula-tiny-moe", {}, torch.bfloat16, None),
    ("mula-tiny-dense", {}, torch.bfloat16, None),
    (
        "mula-tiny-moe",
        dict(qk_norm_per_head=True, moe_layers=[1, 3], shared_experts=1, shared_expert_intermediate_size=12, top_k=3),
        torch.float32,
        None,
    ),  # fmt: skip
    ("mula-tiny-moe", dict(qk_norm=False), torch.bfloat16, None),
    ("mula-tiny-moe", {}, torch.float32, "full"),
    ("mula-tiny-moe", {}, torch.bfloat16, ["moe"]),
    ("mula-tiny-moe", {}, torch.float32, ["norm", "attention", "moe"]),
    ("mula-tiny-moe", dict(moe_layers=[0]), torch.bfloat16, ["norm", "mlp"]),
]


@pytest.mark.parametrize("preset, overrides, dtype, checkpointing", CASES)
def test_planned_activations_equal_what_autograd_saves(preset, overrides, dtype, checkpointing):
    """One micro-batch of 3 sequences of 10 tokens (sizes that are multiples of nothing in the model): the plan's
    bytes per micro-batch equal the saved storages' bytes exactly."""
    config = MulaConfig.from_name(preset, **{**SHAPES, **overrides})
    model = init_weights(MulaForCausalLM(config), seed=0).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    x = torch.randint(0, config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    with saved_tensor_bytes(model.parameters()) as saved:
        model(x, labels=x, return_logits=False)
    (planned,) = stage_activation_bytes(config, 1, 3, 10, 1, dtype.itemsize, checkpointing=checkpointing)
    assert saved["bytes"] == planned["per_micro_batch"]
    assert planned["activations"] == planned["per_micro_batch"] + planned["transient"]


def test_recomputation_keeps_less_and_moe_imbalance_costs_more():
    """On mula-20b-a2b at 4096 tokens in bf16: whole-layer recomputation keeps under a tenth of the plain bytes,
    the expert blocks' recomputation sits between; a routing headroom of 1.25 on the busiest rank adds exactly a
    quarter of the rows' bytes (pre-activations, outputs, received tokens) of the all-to-all dispatch."""
    config = MulaConfig.from_name("mula-20b-a2b")

    def stored(**kwargs):
        return stage_activation_bytes(config, 1, 2, 2048, 1, 2, **kwargs)[0]["per_micro_batch"]

    plain, full, moe = stored(), stored(checkpointing="full"), stored(checkpointing=["moe"])
    assert full < plain / 10 < moe < plain
    rows = 4096 * config.top_k
    per_row = 2 * config.intermediate_size * 2 + config.hidden_size * 2 + 8  # pre-activations, received row, index
    extra = stored(ep=8, dispatcher="alltoall", imbalance=1.25) - stored(ep=8, dispatcher="alltoall")
    assert extra == config.num_moe_layers * (rows // 4) * per_row


def test_micro_batches_held_by_each_schedule():
    """1F1B holds pp - s micro-batches on stage s (fewer when there are fewer), GPipe all of them, interleaved 1F1B
    Megatron's warm-up count of model chunks; without pipelining one; an unknown schedule is named."""
    assert [micro_batches_in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [micro_batches_in_flight("gpipe", 4, s, 8) for s in range(4)] == [8] * 4
    assert [micro_batches_in_flight("interleaved_1f1b", 4, s, 8, 2) for s in range(4)] == [11, 9, 7, 5]
    assert micro_batches_in_flight("1f1b", 1, 0, 8) == 1
    with pytest.raises(ValueError, match=r"pp_schedule \('zb'\) must be one of"):
        micro_batches_in_flight("zb", 2, 0, 4)
    stages = stage_activation_bytes(MulaConfig.from_name("mula-tiny-moe"), 2, 1, 64, 4, 2, schedule="1f1b")
    assert [s["in_flight"] for s in stages] == [2, 1]
    assert stages[0]["activations"] == 2 * stages[0]["per_micro_batch"] + stages[0]["transient"]


def _context_parallel_saved(rank, world_size, dtype, checkpointing):
    import torch.distributed as dist

    from mula_lightning.parallel.context_parallel import apply_context_parallel

    config = MulaConfig.from_name("mula-tiny-moe", **SHAPES)
    model = init_weights(MulaForCausalLM(config), seed=0).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    apply_context_parallel(model, dist.group.WORLD, world_size, rank)
    x = torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with saved_tensor_bytes(model.parameters()) as saved:
        model(x, labels=x, return_logits=False)
    return saved["bytes"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("cp", "dtype", "checkpointing"),
    [
        (2, torch.float32, None),
        (4, torch.bfloat16, None),
        (2, torch.bfloat16, "full"),
        (4, torch.float32, ["norm", "attention"]),
    ],  # fmt: skip
    ids=["cp2 f32", "cp4 bf16", "cp2 bf16 full", "cp4 f32 norm+attention"],
)
def test_planned_context_parallel_activations_equal_what_autograd_saves(cp, dtype, checkpointing):
    """Context parallelism on cp gloo ranks (3 sequences of 16 tokens, GQA 3:1): on every rank the plan's bytes
    (the rank's tokens / cp everywhere, the whole sequences' keys and values, the gathered keys' order, the loss's
    count) equal the saved storages' bytes exactly, with and without recomputation."""
    from mula_lightning.testing import run_pooled_test

    config = MulaConfig.from_name("mula-tiny-moe", **SHAPES)
    (planned,) = stage_activation_bytes(config, 1, 3, 16, 1, dtype.itemsize, checkpointing=checkpointing, cp=cp)
    saved = run_pooled_test(_context_parallel_saved, cp, dtype=dtype, checkpointing=checkpointing, timeout=120)
    assert saved == [planned["per_micro_batch"]] * cp
