"""The learning-rate schedule travels with the run (issue 76, item 2): a resume keeps the checkpoint's schedule, refuses
another one in one line naming both values, or re-plans it when asked."""

import pytest
import torch

from mula_lightning.lr_schedule import ScheduleChangeError, WarmupCosine, WarmupCosineLR, warmup_cosine


def _scheduler(steps_done=0, lr=1e-3, follows=True, replan=False, **schedule):
    settings = dict(warmup_steps=2, decay_steps=6, peak=lr, minimum=1e-4) | schedule
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = WarmupCosineLR(optimizer, WarmupCosine(**settings), horizon_follows_max_steps=follows, replan=replan)
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
