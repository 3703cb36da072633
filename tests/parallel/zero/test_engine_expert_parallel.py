"""The hierarchical ZeRO engine with expert parallelism on 8 gloo processes (2 nodes x 2 GPUs x 2 GCDs): each expert
slice sharded over its edp replicas, the dense weights over every rank, against one process; the ledger's bytes per
tag equal the closed form of both families, each collective on its level; quantized collectives on both families
within the dense case's bound.

The model is an MoE made expert parallel the way the strategy makes it (``apply_expert_parallel`` over the EP groups
of consecutive ranks), then handed to the engine with ``ep_size``. The float64 reference is one process running every
rank's batch, as in ``test_engine.py``.
"""

import pytest
import torch

from mula_lightning.models import MulaForCausalLM, init_weights
from mula_lightning.parallel.ledger import CommLedger, ring_bytes_sent
from mula_lightning.parallel.zero.quantization import packed_bytes
from mula_lightning.testing import adamw_parameter_scale, assert_parity, one_process_data_parallel, run_pooled_test
from mula_lightning.testing.fabric_run import tiny_moe_config

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM, STEPS, BLOCK, WORLD = 0.05, 4, 16, 8
H, FF, V, T, E = 16, 16, 64, 8, 8
GRAD_LEN = 2 * (3 * H + T + 2 * FF + E) + V + WORLD * 2 * T
CONFIGS = [("ep2", 2, False), ("ep4", 4, False), ("ep2_q", 2, True)]
# the level of each collective, per family: dense weights over a GPU's 2 GCDs, gradients inside a node; an expert
# slice's replicas are one per EP group: EP=2 puts 2 of them in a node (gradients reduce-scattered there), EP=4 one
LEVELS = {
    "dense": {"weights.forward": "gcd", "weights.backward": "gcd", "grads.reduce_scatter": "intra_node",
              "grads.all_reduce": "inter_node", "weights.post_step": "inter_node"},
    2: {"grads.reduce_scatter": "intra_node", "grads.all_reduce": "inter_node", "weights.post_step": "inter_node"},
    4: {"grads.all_reduce": "inter_node", "weights.post_step": "inter_node"},
}  # fmt: skip


def _config():
    return tiny_moe_config(num_experts=E, intermediate_size=FF)  # hidden 16, vocabulary 64, 2 layers, top-2


def _batch(step, rank):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(rank, world_size):
    from mula_lightning.parallel.expert_parallel import apply_expert_parallel
    from mula_lightning.parallel.topology import build_topology
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    out = {}
    for name, ep, quant in CONFIGS:
        model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
        apply_expert_parallel(model, build_topology(ep).ep_group)
        layout = ZeroTopoLayout(world_size, 4, 2)  # w 2, g 4, o 8, s 2
        engine = HierarchicalZeroAdamW(model, layout, **HP, quantize_weights=quant, quantize_grads=quant,
                                       block_size=BLOCK, ep_size=ep)  # fmt: skip
        losses = []
        for step in range(STEPS):
            x = _batch(step, rank)
            with CommLedger() as ledger:
                loss = model(x, labels=x).loss
                loss.backward()
                engine.clip_grad_norm_(MAX_NORM)
                engine.step()
            if step == 0:
                records = [
                    (r.tag, r.level, r.bytes_sent) for r in ledger.records if r.tag.startswith(("weights.", "grads."))
                ]
            losses.append(loss.item())
        units = []
        for u in engine.units:
            lay = u.family.layout
            sizes = (lay.weight_size, lay.secondary_size, lay.grad_size, lay.optimizer_size, lay.world_size)
            units.append((u.family.name, u.buf.numel, sizes))
        from mula_lightning.parallel.zero.state_dict import full_model_state_dict

        state = {k: v.clone() for k, v in full_model_state_dict(engine, model).items()}
        out[name] = (losses, state, records, units)
    return out


def _expected_bytes(units, quant, b=8):
    """Closed form of one step per tag: (d - 1) / d of the moved elements of each unit over its family's groups."""
    wq = (lambda n: packed_bytes(n, 8, BLOCK)) if quant else (lambda n: b * n)
    gq = (lambda n: packed_bytes(n, 4, BLOCK)) if quant else (lambda n: b * n)
    out = {"grads.norm": ring_bytes_sent("all_reduce", WORLD, b)}

    def add(key, value):
        if value:
            out[key] = out.get(key, 0) + value

    for _, n, (w, s, g, o, world) in units:
        add("weights.forward", (w - 1) * wq(n // w))
        add("weights.backward", (s - 1) * (wq(n // s) if quant or s != w else b * n // s))
        add("grads.reduce_scatter", (g - 1) * gq(n // g))
        add("grads.all_reduce", ring_bytes_sent("all_reduce", world // g, b * n // g))
        add("weights.post_step", (o // w - 1) * b * (n // o))
    return out


@pytest.mark.distributed
def test_expert_slices_sharded_over_their_replicas_match_one_process_and_the_ledger():
    """EP=2 and EP=4 inside the 3-level layout, 4 clipped AdamW steps: losses and every (gathered) weight equal one
    process (float64); the experts form a unit per MoE layer in their family (EP=2: weights on 1 rank, gradients over
    2, optimizer states over 4 of the 4 replicas; EP=4: 1, 1, 2 of 2); one step's bytes per tag equal the closed form
    summed over both families, on the levels above; with INT8 / INT4 collectives on both families the loss stays
    within 2% of the unquantized run and differs from it."""
    results = run_pooled_test(_train, WORLD, ranks_per_node=4, ranks_per_gpu=2, timeout=400)
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    ref = one_process_data_parallel(model, _batch, WORLD, range(STEPS), MAX_NORM, **HP)
    scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"])
    for rank, per_config in enumerate(results):
        for name, ep, quant in CONFIGS:
            losses, state, records, units = per_config[name]
            families = {fam: sizes for fam, _, sizes in units}
            assert [fam for fam, *_ in units] == ["dense", "dense", "expert", "dense", "expert"], name
            assert families["expert"][:4] == ((1, 1, 2, 4) if ep == 2 else (1, 1, 1, 2)), name
            assert units[2][1] == E // ep * 3 * FF * H  # this rank's slice of one layer's experts, nothing padded
            got: dict[str, int] = {}
            for tag, level, sent in records:
                got[tag] = got.get(tag, 0) + sent
                allowed = {LEVELS["dense"].get(tag), LEVELS[ep].get(tag), "inter_node" if tag == "grads.norm" else None}
                assert level in allowed, (name, tag, level)
            assert got == _expected_bytes(units, quant), name
            if quant:
                plain = per_config["ep2"][0]
                assert losses != plain and abs(losses[-1] - plain[-1]) <= 0.02 * plain[-1], (losses, plain)
                continue
            expected = torch.tensor([s[rank] for s in ref], dtype=torch.float64)
            assert_parity(torch.tensor(losses, dtype=torch.float64), expected, reduction_len=STEPS * GRAD_LEN,
                          msg=f"{name} rank {rank} losses")  # fmt: skip
            for key, value in model.state_dict().items():
                assert_parity(state[key], value, reduction_len=STEPS * GRAD_LEN,
                              scale=scale + value.abs().max().item(), msg=f"{name} rank {rank} {key}")  # fmt: skip
