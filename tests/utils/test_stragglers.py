"""Straggler scores: arrival times name the rank that fell behind, never the ranks that waited for it; tiny
sections' jitter names nobody; one process's monitor times only the window before each report, leaves checkpoint
saves and validation out of the step, and scores its own slowdown (the individual score)."""

import json
import math
import time

import pytest
import torch

from mula_lightning.utils.stragglers import StragglerMonitor, score_ranks

SECTIONS = ("data", "forward", "backward", "optimizer", "end")


def test_the_rank_that_fell_behind_is_named_not_the_ranks_that_waited():
    """Rank 2's forward takes 20 ms longer; ranks 0, 1 and 3 then wait 20 ms in the backward's all-reduce, so their
    backward *durations* are the long ones. Scored on arrival times, rank 2 alone is named, at the forward (10 / 30
    = 0.33), whatever rank holds which place."""
    arrivals = torch.tensor(
        [
            [1.0, 10.0, 40.0, 45.0, 46.0],
            [1.2, 10.5, 40.1, 45.2, 46.0],
            [1.1, 30.0, 40.2, 45.1, 46.1],
            [0.9, 9.9, 40.0, 45.0, 46.2],
        ]
    )
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        named = score_ranks(arrivals[order], SECTIONS, threshold=0.75, min_lag=0.1)
        (rank, section, relative, lag) = named[0]
        assert len(named) == 1 and order[rank] == 2 and SECTIONS[section] == "forward"
        assert relative == pytest.approx(9.9 / 30.0) and lag == pytest.approx(20.1)
    durations = torch.diff(arrivals, dim=1, prepend=torch.zeros(4, 1))
    assert (durations[[0, 1, 3], 2] > 1.5 * durations[2, 2]).all()  # what a duration score would have blamed


def test_jitter_in_tiny_sections_and_unmeasured_ranks_name_nobody():
    """A data wait of 2 ms against 1 ms scores 0.5 but lags 1 ms of a 50 ms step (under min_lag = 10 %): nobody is
    named; a rank lagging 6 ms there is. A rank without measurements (NaN) is never named nor the fastest; no
    measurement at all names nobody; a table that does not match the sections is refused, naming both."""
    arrivals = torch.tensor([[1.0, 50.0], [2.0, 50.0], [math.nan, math.nan]])
    assert score_ranks(arrivals, ("data", "end"), 0.75, 0.1) == []
    arrivals[1, 0] = 7.0
    assert [(r, s) for r, s, _, _ in score_ranks(arrivals, ("data", "end"), 0.75, 0.1)] == [(1, 0)]
    assert score_ranks(torch.full((2, 2), math.nan), ("data", "end"), 0.75, 0.1) == []
    with pytest.raises(ValueError, match=r"shape \(3, 2\) do not match the 3 sections"):
        score_ranks(arrivals, ("data", "forward", "end"), 0.75, 0.1)


def _step(monitor, step, forward_s, save_s=0.0):
    with monitor.section("data"):
        pass
    with monitor.section("forward"):
        time.sleep(forward_s)
    monitor.mark("optimizer")
    report = monitor.step_done(step)
    if save_s:
        with monitor.section("checkpoint"):
            time.sleep(save_s)
    return report


def test_one_process_times_the_window_and_writes_a_report_every_n_steps(tmp_path):
    """every_n_steps 4, window 2: steps 1-2 are not timed (their 50 ms forward is not in the report), steps 3-4 are
    (10 ms); a 30 ms save after step 3 and a paused validation are not in step 4's time but the save is reported by
    its own; the report at step 8 (steps 7-8 at 40 ms) scores the run's slowdown: individual ~ 10 / 40. One JSON
    line per report in the file."""
    path = tmp_path / "stragglers.jsonl"
    monitor = StragglerMonitor(every_n_steps=4, window=2, path=path)
    reports = []
    for step in range(1, 9):
        forward = {1: 0.05, 2: 0.05, 3: 0.01, 4: 0.01}.get(step, 0.04)
        reports.append(_step(monitor, step, forward, save_s=0.03 if step == 3 else 0.0))
        if step == 3:
            with monitor.paused():
                time.sleep(0.03)
    assert [r is not None for r in reports] == [False, False, False, True] * 2
    first, second = reports[3], reports[7]
    assert 10 <= first.step_ms < 25, first  # neither the 50 ms steps, the save nor the validation
    assert 40 <= second.step_ms < 60 and 0.15 < second.min_individual < 0.5
    assert first.stragglers == [] and first.world == 1
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 8] and lines[1]["min_individual"] == second.min_individual


def test_bad_settings_are_refused_naming_them():
    """A window longer than the interval, a threshold outside (0, 1], a negative lag: errors with the values."""
    with pytest.raises(ValueError, match=r"window \(20\) in 1..every_n_steps"):
        StragglerMonitor(every_n_steps=10, window=20)
    with pytest.raises(ValueError, match=r"threshold \(1.5\)"):
        StragglerMonitor(threshold=1.5)
    with pytest.raises(ValueError, match=r"min_lag \(-0.1\)"):
        StragglerMonitor(min_lag=-0.1)
