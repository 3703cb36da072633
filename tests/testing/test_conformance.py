"""The differential tester of training loops (:mod:`mula_lightning.testing.conformance`) and the defects it finds.

A loop program runs on every rank of a real Fabric strategy (gloo, float64) and in one process with DDP's gradient
semantics and plain ``torch.optim.AdamW``; every loss, every returned norm, the learning rates and every rank's full
weights after every step must agree (norms and weights to a relative 1e-12, losses to 1e-6: Fabric's 64-true hands
them back in float32). The review programs are the smallest loops that showed the defects of issue 71 and of the
review before it; each fails on the engines as they were (``e295864``; the accumulation one at ``dcd8837``'s parent).
The seeded programs are the tester's fixed share of ``make test``: ``make fuzz MINUTES=N`` draws fresh ones.
"""

import pytest
import torch
from hypothesis import given

from mula_lightning.testing.conformance import (
    LAYOUTS,
    LoopProgram,
    calls_of_rounds,
    check_program,
    loop_programs,
    seeded_programs,
    valid_calls,
)

#: seeded programs per layout in ``make test`` (a few tenths of a second each on warm gloo ranks); half of it for the
#: Muon layouts, whose engine is the AdamW one's but for the layout and the update
PROGRAMS_PER_LAYOUT = 8

REVIEW_PROGRAMS = {
    # zero_topo: the shards were all-reduced across nodes and divided at the norm query; the second backward landed
    # in them unreduced and undivided, and step saw the sync done
    "1: zero_topo, a backward after a norm query": LoopProgram(
        "zero_topo 3-level", "setup_with_scheduler", ("backward", "norm", "backward", "clip", "step")
    ),
    # epso mode none: zero_grad dropped the in-place all-reduce in flight, which then summed the next backward's
    # gradients on the faster rank
    "3: epso none, a skipped step while the slow rank reduces": LoopProgram(
        "epso none", "setup_with_scheduler", ("backward", "zero_grad", "backward", "step"), slow_rank=1
    ),
    # a scheduler built on the user's optimizer before setup_optimizers wrote into param groups nobody read
    "4: epso, a scheduler built before setup_optimizers": LoopProgram(
        "epso ep_aware", "two_call_scheduler_before", ("backward", "step", "zero_grad", "scheduler", "backward", "step")
    ),
    "4: zero_topo, a scheduler built before setup_optimizers": LoopProgram(
        "zero_topo zero3",
        "two_call_scheduler_before",
        ("backward", "step", "zero_grad", "scheduler", "backward") + ("step",),
    ),
    # zero_topo freed layer 0 once its attention's gradients arrived; the frozen input norm's backward then read freed
    # storage (a crash on every rank)
    "5: zero_topo, a frozen input norm under a trainable attention": LoopProgram(
        "zero_topo zero3", "two_call_scheduler_after", ("backward", "step"), frozen=("model.layers.0.input_layernorm",)
    ),
    # the previous review: two synchronised backwards per step (accumulation without no_backward_sync) kept only the
    # first one's gradients
    "dcd8837: epso, accumulation without no_backward_sync": LoopProgram(
        "epso ep_aware", "setup_then_scheduler", ("backward", "backward", "step")
    ),
    # found by the tester: Fabric's optimizer wrapper subclasses the engine's class, so its inherited zero_grad ran with
    # the wrapper as self and cleared the "synchronised" flag on the wrapper: after a norm query the next backward
    # was added to the dropped gradients (epso) or not reduced at all (zero_topo)
    "tester: epso, a zero_grad through Fabric's wrapper after a norm query": LoopProgram(
        "epso none", "setup_then_scheduler", ("backward", "norm", "zero_grad", "backward", "step")
    ),
    "tester: zero_topo, a zero_grad through Fabric's wrapper after a norm query": LoopProgram(
        "zero_topo zero3", "setup_then_scheduler", ("backward", "norm", "zero_grad", "backward", "step")
    ),
    # found by the tester: tensor parallelism rebuilt the q/k norms as DTensor parameters that required a gradient
    # whatever the norm's flag was, so an optimizer built after setup_module (the Trainer's order) trained a frozen
    # attention's norms
    "tester: epso TP 2, a frozen attention's norms after the two-call set-up": LoopProgram(
        "epso ep_aware tp2", "two_call_scheduler_after", ("backward", "step"), frozen=("model.layers.1.self_attn",)
    ),
    # found by the tester: zero_topo wrote (and on load required) Adam moments for frozen parameters, which torch's
    # AdamW and epso never hold, so an epso checkpoint of a partly frozen model did not load into zero_topo
    "tester: epso to zero_topo, a reload with a frozen MoE layer": LoopProgram(
        "epso dp",
        "setup_with_scheduler",
        ("backward", "step", "zero_grad", "save_reload", "backward", "step"),
        frozen=("model.layers.0.mlp",),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(REVIEW_PROGRAMS))
def test_the_review_loops_train_like_one_process(name):
    """Each loop that showed a defect of issue 71 (items 1, 3, 4, 5) or of the review before (accumulation without
    ``no_backward_sync``) now gives the losses, norms, learning rates and weights of one process."""
    check_program(REVIEW_PROGRAMS[name])


@pytest.mark.distributed
def test_zero_topo_shards_frozen_parameters_at_setup_module_and_never_updates_them():
    """``zero_topo`` 3-level on 4 ranks, two-call set-up with the embedding (a root parameter) and the first layer's
    attention (part of a layer) frozen on the meta model: no parameter holds storage after ``setup_module`` (before,
    a frozen parameter sent the whole model to every rank), and two clipped steps give one process's weights with the
    same parameters frozen (the frozen ones unchanged)."""
    check_program(
        LoopProgram(
            "zero_topo 3-level",
            "two_call_scheduler_after",
            ("backward", "clip", "step", "zero_grad", "backward_no_sync", "backward", "clip", "step"),
            frozen=("model.embed_tokens", "model.layers.0.self_attn"),
        )
    )


def _halved(layout: str) -> bool:
    """Layouts whose seeded share is halved: Muon's (the AdamW engine but for the layout and the update) and context
    parallelism's (the engine unchanged but for the reduction's divisor; its model path has tests of its own)."""
    return layout.endswith("muon") or " cp" in layout


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if _halved(name)])
def test_five_clipped_accumulated_steps_equal_one_process(layout):
    """Issue 72's and 73's parity program on every Muon layout (DP 2, EP 2, DP 2 x EP 2 in both modes) and every
    context-parallel one (CP 2, CP 4, CP 2 folded with EP 2, CP 2 x EP 2 beside DP 2, CP 2 x TP 2 with and without
    SP): five steps of two accumulated
    micro-batches (``no_backward_sync``, then a synchronised backward), each clipped, give one process's losses,
    norms and weights to a relative 1e-12 (:data:`~mula_lightning.testing.conformance.RTOL`); one process is
    ``MuonAdamW`` for Muon, itself ``torch.optim.Muon`` per matrix and per expert matrix and AdamW for the rest
    (``tests/optim/test_muon.py``), and sees each batch's whole sequences where the CP ranks hold two chunks each."""
    calls = ("backward_no_sync", "backward", "clip", "step", "zero_grad") * 5
    check_program(LoopProgram(layout, "setup_with_scheduler", calls))


#: layouts whose seeded programs another layout's cover (their five-step program above still runs): CP 4 has CP 2's
#: code at another size, CP 2 x TP 2 the code of CP 2 x TP 2 with SP but for the routers' and norms' split
SEEDED_ELSEWHERE = {"epso ep_aware cp4", "epso ep_aware cp2 tp2"}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in SEEDED_ELSEWHERE])
def test_seeded_loop_programs_train_like_one_process(layout):
    """A fixed, seeded set of loop programs per layout (Lightning's DDP is the control): any set-up order, frozen
    set, slow rank, accumulation with and without ``no_backward_sync``, norm queries and clips between backwards,
    skipped steps, scheduler steps, and a save and load in place between steps. A failure is shrunk by
    ``hypothesis`` to the smallest failing program and printed as code."""

    @seeded_programs(layout, PROGRAMS_PER_LAYOUT // 2 if _halved(layout) else PROGRAMS_PER_LAYOUT)
    @given(loop_programs(layout))
    def run(program):
        check_program(program)

    run()


def test_the_grammar_keeps_to_what_ddp_defines():
    """``valid_calls`` refuses the loops DDP defines per rank only (a clip, norm or step on unreduced gradients), a
    step without a backward since the last one, and a backward straight after a step (torch keeps the gradients,
    the engines clear them); a loop built from rounds puts a zero_grad between a step and the next round's backward
    and is valid; the printed program is code that rebuilds it."""
    assert valid_calls(("backward_no_sync", "backward", "norm", "clip", "step", "zero_grad", "backward"))
    assert valid_calls(("zero_grad", "backward", "zero_grad", "scheduler", "backward", "step"))
    assert not valid_calls(("backward_no_sync", "clip"))
    assert not valid_calls(("backward_no_sync", "step"))
    assert not valid_calls(("backward", "step", "zero_grad", "step"))
    assert not valid_calls(("backward", "step", "backward"))
    assert not valid_calls(("backward", "save_load"))  # a checkpoint holds no gradients
    assert valid_calls(("backward", "step", "save_load", "zero_grad", "save_load", "backward"))
    rounds = [(True, [(2, ("norm", "clip")), (0, ())], True, True), (False, [(1, ())], False, False)]
    calls = calls_of_rounds(rounds)
    assert calls == ("zero_grad", "backward_no_sync", "backward_no_sync", "backward", "norm", "clip", "backward",
                     "step", "scheduler", "zero_grad", "backward_no_sync", "backward", "zero_grad")  # fmt: skip
    assert valid_calls(calls)
    program = LoopProgram("epso none", "setup_with_scheduler", calls, ("model.norm",), 1)
    assert eval(program.to_code().replace("check_program", ""), {"LoopProgram": LoopProgram}) == program
    with pytest.raises(ValueError, match="DDP does not define"):
        check_program(LoopProgram("ddp", "setup_with_scheduler", ("backward_no_sync", "step")))


def _banked_families(rank, world_size, options):
    """Three synchronised backwards around a norm query under ``epso`` with ``options``: the families holding a banked
    copy of reduced gradients when the step begins, and the loop's norms (for parity)."""
    from lightning.fabric import Fabric

    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.strategies import FabricEPSOStrategy
    from mula_lightning.testing.conformance import HP, batch, model_config

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricEPSOStrategy(bucket_numel=700, **options),
                    precision="64-true")  # fmt: skip
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(model_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    engine = fabric.strategy.sharded_optimizer
    data_rank = fabric.strategy.distributed_sampler_kwargs["rank"]
    banked = set()
    for micro, call in enumerate(["backward", "backward", "norm", "backward"]):
        if call == "norm":
            fabric.strategy.global_grad_norm(optimizer)
            continue
        x = batch(micro, data_rank)
        out = model(x, labels=x)
        fabric.backward(out.loss + out.aux_loss)
        banked |= {fam for fam, _ in engine._banked}
    engine.finish_grad_sync()
    return sorted(banked), sorted(engine.plans[f].shard_size for f in engine.buffers)


@pytest.mark.distributed
@pytest.mark.parametrize("options", [dict(sharded_optimizer="none"), dict(sharded_optimizer="ep_aware", ep_size=2)],
                         ids=["none", "ep_aware ep2"])  # fmt: skip
def test_a_replicated_family_banks_no_copy_of_its_gradients(options):
    """Review item 7 (issue 71): with several synchronised backwards per step (and one after a norm query), a family
    whose states are not sharded (mode ``none``; the experts at dp = 1 under EP 2, which never communicate) keeps
    its reduced gradients in its own buckets instead of banking a second copy of every element (27.7 GB for a 7B
    model before); only a sharded family banks, a shard-sized range per bucket. Parity of such loops with one
    process is the review and seeded programs' (``epso none``, ``epso ep_aware ep2``)."""
    from mula_lightning.testing import run_pooled_test

    check_program(
        LoopProgram(
            f"epso {options['sharded_optimizer']}" + (" ep2" if "ep_size" in options else ""),
            "setup_then_scheduler",
            ("backward", "backward", "norm", "backward", "clip", "step"),
        )
    )
    for banked, _ in run_pooled_test(_banked_families, 2, options=options, timeout=120):
        assert banked == ([] if options["sharded_optimizer"] == "none" else ["non_expert"]), banked
