"""The differential tester of the Trainer's loop (:mod:`mula_lightning.testing.trainer_conformance`).

A Trainer program (accumulation, ``gradient_clip_val``, skipped steps through an ``optimizer_step`` override, a
step-interval scheduler, a norm-logging hook, a resume mid-run by a second Trainer) runs on every rank of a real
strategy (gloo, float64) and, written as the Fabric calls the Trainer makes, in one process with DDP's semantics;
every loss, hook norm, learning rate and every rank's full weights after every step must agree (norms and weights
to a relative 1e-12). Lightning's DDP is the control that the translation into calls is Lightning's loop.
"""

import pytest
from hypothesis import given

from mula_lightning.testing.conformance import seeded_programs
from mula_lightning.testing.trainer_conformance import (
    TRAINER_LAYOUTS,
    TrainerProgram,
    check_trainer_program,
    trainer_programs,
)

#: seeded Trainer programs per layout in ``make test`` (about a second each on warm gloo ranks)
PROGRAMS_PER_LAYOUT = 5


@pytest.mark.distributed
def test_zero_topo_trainer_materialises_the_routers_selection_bias():
    """Found by this tester: under ``Trainer(strategy=ZeroTopoStrategy(...))`` a model built on the meta device in
    ``configure_model`` kept its routers' selection bias (``expert_bias=True``, DeepSeek-V3's auxiliary-loss-free
    routing) on the meta device: the first forward failed on every rank ("Cannot copy out of meta tensor"). Fabric's
    path set it; the Trainer's now does too, and the run (accumulation 2, a skipped window, a resume, an expert
    that no token chooses, EP 2) trains like one process."""
    check_trainer_program(
        TrainerProgram(
            "zero_topo zero3 ep2",
            ("step", "skip", "step"),
            accumulate=2,
            log_norm=True,
            resume_after=1,
            idle_expert=True,
        )  # fmt: skip
    )


@pytest.mark.distributed
@pytest.mark.parametrize("layout", TRAINER_LAYOUTS)
def test_seeded_trainer_programs_train_like_one_process(layout):
    """A fixed, seeded set of Trainer programs per layout (Lightning's DDP the control): accumulation 1-3, clipping
    or not, skipped windows, a norm hook, a resume after any window, any frozen set, a slow rank and an idle expert.
    A failure is shrunk to the smallest failing program and printed as code."""

    @seeded_programs(layout, PROGRAMS_PER_LAYOUT)
    @given(trainer_programs(layout))
    def run(program):
        check_trainer_program(program)

    run()


def test_trainer_programs_translate_to_the_calls_lightning_makes_and_bad_ones_are_named():
    """A window is a zero_grad, its backwards (the last synchronised), then for a step the norm hook, the clip and the
    step; the scheduler steps after every window, skipped or not. A program the Trainer cannot run is refused with a
    message naming the value."""
    program = TrainerProgram("ddp", ("skip", "step"), accumulate=3, clip=True, log_norm=True)
    assert program.calls() == ("zero_grad", "backward_no_sync", "backward_no_sync", "backward", "scheduler",
                               "zero_grad", "backward_no_sync", "backward_no_sync", "backward", "norm", "clip", "step",
                               "scheduler")  # fmt: skip
    assert eval(program.to_code().replace("check_trainer_program", ""), {"TrainerProgram": TrainerProgram}) == program
    with pytest.raises(ValueError, match=r"resume_after \(2\) must be in \[1, 1\]"):
        check_trainer_program(TrainerProgram("ddp", ("step", "step"), resume_after=2))
    with pytest.raises(ValueError, match="'epso dp' is not one the Trainer runs"):
        check_trainer_program(TrainerProgram("epso dp", ("step",)))
    with pytest.raises(ValueError, match="windows must be"):
        check_trainer_program(TrainerProgram("ddp", ("step", "stop")))
