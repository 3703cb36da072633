"""The learning-rate schedule travels with the run (issue 76, item 2): a resume keeps the checkpoint's schedule, refuses
another one in one line naming both values, or re-plans it when asked."""

import pytest
import torch

from mula_lightning.lr_schedule import LRSchedule, ScheduleChangeError, ScheduledLR, warmup_cosine, warmup_stable_decay


def _scheduler(steps_done=0, lr=1e-3, follows=True, replan=False, **schedule):
    settings = dict(warmup_steps=2, decay_steps=6, peak=lr, minimum=1e-4) | schedule
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = ScheduledLR(optimizer, LRSchedule(**settings), horizon_follows_max_steps=follows, replan=replan)
    for _ in range(steps_done):
        optimizer.step()
        scheduler.step()
    return scheduler


def _lr(scheduler):
    return scheduler.optimizer.param_groups[0]["lr"]


def test_a_longer_max_steps_keeps_the_checkpoints_horizon_and_says_so(capsys):
    """Saved at step 5 of a 6-step horizon that follows max_steps, resumed with max_steps 10: the cosine still ends
    at step 6 (the rate stays at min_lr after it), where the re-resolved horizon would have raised it again."""
    saved = _scheduler(steps_done=5).state_dict()
    resumed = _scheduler(decay_steps=10)
    resumed.load_state_dict(saved)
    assert resumed.schedule.decay_steps == 6 and resumed.last_epoch == 5
    resumed.optimizer.step()
    resumed.step()
    assert _lr(resumed) == pytest.approx(1e-4) and warmup_cosine(6, 2, 10, 1e-3, 1e-4) > 5e-4
    err = capsys.readouterr().err
    assert "keeping the checkpoint's learning-rate schedule" in err and "would make it 10" in err


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(lr=2e-3, peak=2e-3), "lr 0.001 (checkpoint) vs 0.002 (now)"),
        (dict(minimum=5e-5), "min_lr 0.0001 (checkpoint) vs 5e-05 (now)"),
        (dict(warmup_steps=3), "warmup_steps 2 (checkpoint) vs 3 (now)"),
        (dict(follows=False, decay_steps=10), "decay_steps 6 (checkpoint) vs 10 (now)"),
    ],
)
def test_another_schedule_on_a_resume_is_refused_naming_both_values(change, named):
    """Another peak, minimum, warm-up or explicit horizon: one line naming the option with both values and the way
    to switch (``replan_schedule``)."""
    saved = _scheduler(steps_done=3).state_dict()
    with pytest.raises(ScheduleChangeError, match="replan_schedule") as error:
        _scheduler(**change).load_state_dict(saved)
    assert named in str(error.value)


def test_replan_switches_to_this_runs_schedule_from_the_checkpoints_step():
    """With ``replan``: the step count is the checkpoint's, the schedule and peak this run's; the rate is set now."""
    saved = _scheduler(steps_done=3).state_dict()
    resumed = _scheduler(lr=2e-3, peak=2e-3, decay_steps=20, replan=True)
    resumed.load_state_dict(saved)
    assert resumed.last_epoch == 3 and resumed.base_lrs == [2e-3]
    assert _lr(resumed) == pytest.approx(warmup_cosine(3, 2, 20, 2e-3, 1e-4))
    assert resumed.get_last_lr() == [_lr(resumed)]


def test_a_checkpoint_without_a_saved_schedule_resumes_with_this_runs():
    """A checkpoint of the earlier plain-lambda scheduler holds no settings: this run's schedule, no refusal."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    old = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer.step()
    old.step()
    resumed = _scheduler(decay_steps=10)
    resumed.load_state_dict(old.state_dict())
    assert resumed.schedule.decay_steps == 10 and resumed.last_epoch == 1


def test_the_refusal_after_the_run_started_is_one_line_not_a_run_failure(monkeypatch):
    """``mula fit`` raises the refusal as it is (the console script prints its one line), not as a run failure with a
    traceback, although it comes after the preflight checks."""
    from mula_lightning import lightning_cli

    def resumed(args, started):
        started.append("fit")
        raise ScheduleChangeError("lr 0.001 (checkpoint) vs 0.002 (now)")

    monkeypatch.setattr(lightning_cli, "build_cli", resumed)
    with pytest.raises(ScheduleChangeError):
        lightning_cli.main(["fit"])


def test_wsd_warms_up_holds_the_peak_then_decays_over_its_last_fraction():
    """Warm-up 10, horizon 100, the last 20 % decaying: the peak from step 9 to 79, then ``linear`` (half way down at
    step 90) or ``1-sqrt`` (1 - sqrt(1/2) of the way up at step 90), ``min_lr`` from step 100; never rising after
    the warm-up. The constant schedule keeps the peak."""
    peak, low = 1e-3, 1e-4
    rates = {shape: [warmup_stable_decay(s, 10, 100, peak, low, 0.2, shape) for s in range(120)] for shape in
             ("linear", "1-sqrt")}  # fmt: skip
    for shape, r in rates.items():
        assert r[0] == pytest.approx(peak / 10) and r[9] == r[79] == peak and r[100] == r[119] == low, shape
        assert all(a >= b for a, b in zip(r[9:], r[10:])), shape
    assert rates["linear"][90] == pytest.approx(low + 0.5 * (peak - low))
    assert rates["1-sqrt"][90] == pytest.approx(low + (1 - 0.5**0.5) * (peak - low))
    constant = LRSchedule(10, 100, peak, low, kind="constant")
    assert [constant.rate(s) for s in (0, 9, 100, 10_000)] == [pytest.approx(peak / 10), peak, peak, peak]
    with pytest.raises(ValueError, match="'wsdd' is not one of"):
        LRSchedule(10, 100, peak, low, kind="wsdd")
    with pytest.raises(ValueError, match="decay_shape 'sqrt'"):
        LRSchedule(10, 100, peak, low, kind="wsd", decay_shape="sqrt")


def test_a_wsd_run_extended_while_stable_takes_the_new_horizon_and_one_in_its_decay_keeps_its_own(capsys):
    """Saved at step 50 of a WSD horizon of 100 (``decay_steps: null``), resumed with ``max_steps`` 200: the rate at
    step 50 is the peak under both, so the horizon moves to 200 (the decay now starts at 160); saved at step 90 (in
    the decay), the same extension would raise the rate: the checkpoint's horizon is kept."""
    wsd = dict(kind="wsd", warmup_steps=10, decay_steps=100, decay_fraction=0.2)
    resumed = _scheduler(**(wsd | {"decay_steps": 200}))
    resumed.load_state_dict(_scheduler(steps_done=50, **wsd).state_dict())
    assert resumed.schedule.decay_steps == 200 and _lr(resumed) == pytest.approx(1e-3)
    assert "horizon moves from step 100 to 200" in capsys.readouterr().err
    decaying = _scheduler(**(wsd | {"decay_steps": 200}))
    decaying.load_state_dict(_scheduler(steps_done=90, **wsd).state_dict())
    assert decaying.schedule.decay_steps == 100 and "keeping the checkpoint's" in capsys.readouterr().err


def test_another_shape_is_refused_and_a_checkpoint_of_the_first_format_is_a_cosine():
    """A WSD run resumed as a cosine is named (``lr_schedule``); a state saved before the schedule had a kind (its
    settings: warm-up, horizon, peak, minimum) resumes as the cosine it was."""
    saved = _scheduler(steps_done=3, kind="wsd").state_dict()
    with pytest.raises(ScheduleChangeError, match="lr_schedule 'wsd' \\(checkpoint\\) vs 'cosine' \\(now\\)"):
        _scheduler().load_state_dict(saved)
    first = _scheduler(steps_done=3).state_dict()
    for key in ("kind", "decay_fraction", "decay_shape"):
        del first["lr_lambdas"][0][key]
    resumed = _scheduler()
    resumed.load_state_dict(first)
    assert resumed.schedule.kind == "cosine" and resumed.last_epoch == 3
