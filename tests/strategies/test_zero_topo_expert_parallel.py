"""Expert parallelism inside ``zero_topo``: checkpoints that reshard across EP degrees and layouts, ``mula export`` of
them, and the options it refuses.

8 gloo processes as 2 nodes x 2 GPUs x 2 GCDs train a tiny MoE (8 experts) with EP=4 inside the 3-level layout, save
after 3 clipped AdamW steps and go on; the checkpoint is loaded into EP=2 under ZeRO-3 over the same ranks, then into
one process, and both continue with the losses of the uninterrupted one-process reference (float64). The checkpoint
holds the single-device keys and shapes (each expert slice at its rows), so ``mula export`` writes the HF model the
reference holds after 3 steps. (The parity of training itself at EP=2 / EP=4, with the auxiliary losses and the
expert bias, is in ``test_epso_expert_bias.py``; the two-call set-up in ``test_two_call_setup.py``.)
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaForCausalLM, init_weights
from mula_lightning.testing import assert_parity, one_process_data_parallel, run_pooled_test
from mula_lightning.testing.fabric_run import clipped_fabric_steps, tiny_moe_config

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CLIP, STEPS, SAVE_AT, WORLD = 0.05, 5, 3, 8
H, FF, V, T, E = 16, 8, 64, 8, 8
GRAD_LEN = 2 * (3 * H + T + 2 * FF + E) + V + WORLD * 2 * T  # dots, softmaxes and the sum over every rank's tokens
F32 = dict(reduction_len=3, dtype=torch.float32)  # Fabric hands the loss back in float32
EP4 = dict(ranks_per_node=4, ranks_per_gpu=2, ep_size=4, dispatcher="alltoall")  # w 2, g 4, o 8; experts 1, 1, 2
EP2_ZERO3 = dict(ranks_per_node=4, weight_size=8, grad_size=8, optimizer_size=8, secondary_size=8, ep_size=2)


def _config():
    return tiny_moe_config(num_experts=E, intermediate_size=FF)  # hidden 16, vocabulary 64, 2 layers, top-2


def _batch(step, rank):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 * step + rank))


def _fabric(world_size, options):
    from mula_lightning.strategies import FabricZeroTopoStrategy

    fabric = Fabric(accelerator="cpu", devices=world_size, precision="64-true",
                    strategy=FabricZeroTopoStrategy(block_size=16, **options))  # fmt: skip
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model = fabric.setup_module(model)
    return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **HP))


def _steps(fabric, model, optimizer, rank, start, stop):
    return clipped_fabric_steps(fabric, model, optimizer, _batch, rank, range(start, stop), CLIP)


def _save_and_reshard(rank, world_size, path):
    fabric, model, optimizer = _fabric(world_size, EP4)
    units = [(u.family.name, u.buf.numel, u.nw, u.no) for u in fabric.strategy.engine.units]
    losses = _steps(fabric, model, optimizer, rank, 0, SAVE_AT)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
    losses += _steps(fabric, model, optimizer, rank, SAVE_AT, STEPS)
    fabric2, model2, optimizer2 = _fabric(world_size, EP2_ZERO3)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric2.load(path, state)
    return losses, _steps(fabric2, model2, optimizer2, rank, state["step"], STEPS), units


@pytest.mark.distributed
def test_an_ep4_checkpoint_resumes_at_ep2_and_in_one_process_and_exports(tmp_path):
    """EP=4 (3-level) -> EP=2 (ZeRO-3) over 8 ranks -> one process: every continuation has the reference's losses,
    and ``mula export`` of the EP=4 checkpoint gives the reference's HF weights after 3 steps (float64)."""
    from mula_lightning.checkpoint.dcp_format import load_dcp
    from mula_lightning.checkpoint.export import export_to_hf
    from mula_lightning.models.hf_convert import mula_to_hf_state_dict
    from mula_lightning.parallel.zero import state_dict as zc
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    path = tmp_path / "ckpt"
    results = run_pooled_test(_save_and_reshard, WORLD, path=str(path), timeout=400)
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    ref = one_process_data_parallel(model, _batch, WORLD, range(SAVE_AT), CLIP, opt)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    ref += one_process_data_parallel(model, _batch, WORLD, range(SAVE_AT, STEPS), CLIP, opt)
    for rank, (losses, resumed, units) in enumerate(results):
        # root, then each layer's dense unit and its experts' (2 of 8 here: 1/4 of the layer's expert weights)
        assert [name for name, *_ in units] == ["dense", "dense", "expert", "dense", "expert"]
        for name, numel, nw, no in units:  # dense: w 2, o 8; experts over their 2 edp ranks: w 1, o 2
            assert (nw, no) == ((numel, numel // 2) if name == "expert" else (numel // 2, numel // 8))
        assert units[2][1] == 2 * 3 * FF * H  # two experts' gate, up and down projections
        expected = torch.tensor([s[rank] for s in ref], dtype=torch.float64)
        assert_parity(torch.tensor(losses, dtype=torch.float64), expected, **F32, msg=f"rank {rank} losses")
        assert_parity(torch.tensor(resumed, dtype=torch.float64), expected[SAVE_AT:], **F32, msg=f"rank {rank} EP=2")

    single = MulaForCausalLM(_config()).to(torch.float64)
    engine = HierarchicalZeroAdamW(single, ZeroTopoLayout(1, 1, 1), **HP, block_size=16)
    targets = {"model": zc.model_state_dict(engine, single), "optimizer": zc.optimizer_state_dict(engine, True)}
    assert load_dcp(path, targets)["step"] == SAVE_AT
    zc.load_model_state_dict(engine, targets["model"])
    zc.apply_optimizer_state_dict(engine, targets["optimizer"])
    for step in range(SAVE_AT, STEPS):  # one process: the mean over the 8 ranks' batches
        per_rank = [single(_batch(step, r), labels=_batch(step, r)).loss for r in range(WORLD)]
        torch.stack(per_rank).mean().backward()
        engine.clip_grad_norm_(CLIP)
        engine.step()
        got = torch.tensor([p.item() for p in per_rank], dtype=torch.float64)
        assert_parity(got, torch.tensor(ref[step], dtype=torch.float64), reduction_len=STEPS * GRAD_LEN,
                      msg=f"one process, step {step}")  # fmt: skip

    out, parameters, _ = export_to_hf(path, tmp_path / "hf", config=_config())
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    expected = mula_to_hf_state_dict(at_save, _config())
    assert set(got) == set(expected) and parameters == sum(v.numel() for v in at_save.values())
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        assert_parity(got[key].to(torch.float64), value, reduction_len=SAVE_AT * GRAD_LEN,
                      scale=value.abs().max().item() + 1e-2, msg=f"exported {key}")  # fmt: skip


def _real_model_run(rank, world_size):
    from mula_lightning.strategies import FabricZeroTopoStrategy

    strategy = FabricZeroTopoStrategy(block_size=16, ranks_per_node=2, ranks_per_gpu=2, ep_size=2)
    fabric = Fabric(accelerator="cpu", devices=world_size, precision="64-true", strategy=strategy)
    fabric.launch()
    model = init_weights(MulaForCausalLM(_config()), seed=0)  # built whole on every rank, not on the meta device
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    return clipped_fabric_steps(fabric, model, optimizer, _batch, rank, range(SAVE_AT), CLIP)


@pytest.mark.distributed
def test_a_model_built_whole_is_cut_and_trains_like_one_process():
    """A model built on every rank with its values (the whole-model path, not one unit at a time) under EP=2 over 4
    ranks: its experts are cut to each rank's slice and the rest as on the meta path; 3 steps equal one process."""
    results = run_pooled_test(_real_model_run, 4, timeout=300)
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(torch.float64)
    ref = one_process_data_parallel(model, _batch, 4, range(SAVE_AT), CLIP, **HP)
    for rank, losses in enumerate(results):
        expected = torch.tensor([s[rank] for s in ref], dtype=torch.float64)
        assert_parity(torch.tensor(losses, dtype=torch.float64), expected, **F32, msg=f"rank {rank}")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ep_size=3, ranks_per_node=4), r"ep_size \(3\) must divide ranks_per_node \(4\)"),
        (dict(ep_size=2, etp_size=2), r"zero_topo has no expert tensor parallelism \(etp_size 2\)"),
        (dict(ep_size=2, dispatcher="deepep"), r"dispatcher \('deepep'\) must be one of \('allgather', 'alltoall'\)"),
        (dict(ep_size=0), r"ep_size \(0\) must be a positive integer"),
    ],
)
def test_bad_expert_parallel_options_are_refused_at_construction(options, message):
    """An ``ep_size`` that does not divide the ranks of a node, expert tensor parallelism, an unknown dispatcher or a
    non-positive degree: one ``ValueError`` naming the value, when the strategy is built (before any process)."""
    from mula_lightning.strategies import FabricZeroTopoStrategy, ZeroTopoStrategy

    for cls in (FabricZeroTopoStrategy, ZeroTopoStrategy):
        with pytest.raises(ValueError, match=message):
            cls(**options)


def test_group_sizes_that_do_not_nest_with_ep_size_are_named():
    """The experts' edp layout of every group size: ``x / ep`` where ``ep | x``, 1 where ``x | ep``; a size that is
    neither (weight 2 of 3-way EP on 6 ranks per node) or an EP group crossing nodes is named."""
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout, expert_layout, expert_weight_replica_groups

    dense = ZeroTopoLayout(8, 4, 2)  # w 2, g 4, o 8, s 2
    ep2, ep4 = expert_layout(dense, 2), expert_layout(dense, 4)
    assert (ep2.world_size, ep2.ranks_per_node, ep2.weight_size, ep2.grad_size, ep2.optimizer_size) == (4, 2, 1, 2, 4)
    assert (ep4.world_size, ep4.ranks_per_node, ep4.weight_size, ep4.grad_size, ep4.optimizer_size) == (2, 1, 1, 1, 2)
    zero3 = ZeroTopoLayout.preset("zero3", 8, 4)
    assert expert_layout(zero3, 2).weight_size == expert_layout(zero3, 2).optimizer_size == 4
    # the same expert weight chunk: one rank per EP rank and chunk position, every rank once
    groups = expert_weight_replica_groups(zero3, 2)
    assert sorted(r for g in groups for r in g) == list(range(8)) and all(len({r % 2 for r in g}) == 1 for g in groups)
    with pytest.raises(ValueError, match=r"weight_size \(2\) must divide ep_size \(3\) or be a multiple of it"):
        expert_layout(ZeroTopoLayout(12, 6, 2), 3)
    with pytest.raises(ValueError, match=r"ep_size \(8\) must divide the ranks of a node \(4\)"):
        expert_layout(dense, 8)


def test_an_engine_given_uncut_experts_names_the_layer():
    """``ep_size`` > 1 on a model whose experts were not cut (every rank would take the whole layer for its slice and
    train it as such): one ``ValueError`` naming the layer and the counts, before anything is sharded."""
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    model = MulaForCausalLM(_config())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp holds 8 of its 8 experts; ep_size 2 needs them cut"):
        HierarchicalZeroAdamW(model, ZeroTopoLayout(2, 2), ep_size=2)
