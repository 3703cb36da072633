"""Failure attribution without processes: each kind of evidence gives the verdict of the module's table."""

import signal

from mula_lightning.launch.attribution import (
    DIVERGED,
    LOST,
    SUSPECT,
    NanRecord,
    attribute_exits,
    attribute_hang,
    attribute_nan,
    parse_nan_line,
)
from mula_lightning.launch.backends import RankExit


def test_exits_only_sigkill_of_a_whole_node_or_a_node_failure_report_lose_it():
    """SIGKILL of every rank of n1 (and errors elsewhere) loses n1; one of two ranks killed, SIGABRT, SIGSEGV or an
    exit code make the first failing host a suspect; SLURM's node-failure report wins over the killed tasks."""
    kill = -int(signal.SIGKILL)
    v = attribute_exits([RankExit("n1", [2], 1), RankExit("n1", [0, 1], kill), RankExit("n0", [3], 1)], 2)
    assert v.kind == SUSPECT and v.suspects == ["n1"]  # n1 also had an orderly failure: not vanished
    v = attribute_exits([RankExit("n0", [0], 1), RankExit("n1", [2, 3], kill)], 2)
    assert v.kind == LOST and v.lost == ["n1"] and "n1" in v.why
    for code in (-int(signal.SIGABRT), -int(signal.SIGSEGV), -int(signal.SIGBUS), 1, -64):
        v = attribute_exits([RankExit("n2", [4], code), RankExit("n0", [0], 1)], 1)
        assert (v.kind, v.suspects) == (SUSPECT, ["n2"]), code
    v = attribute_exits([RankExit("n3", [5], kill), RankExit("n2", [], kill, node_failure=True)], 1)
    assert v.kind == LOST and v.lost == ["n2"]


def test_nan_one_unit_is_a_suspect_several_units_or_a_replayed_step_a_divergence():
    """NaN in one EP group spanning two hosts: both hosts suspect, the group recorded; two EP groups: divergence;
    hosts only (no EP): one host suspect, two hosts divergence; the same step again on other hosts: divergence."""
    group = [NanRecord("a", 7, [0], [0], 2, 8), NanRecord("b", 7, [1], [0], 2, 8)]
    v = attribute_nan(group)
    assert v.kind == SUSPECT and v.suspects == ["a", "b"] and v.ep_groups == [0]
    assert attribute_nan([NanRecord("a", 7, [0], [0]), NanRecord("c", 7, [4], [2])]).kind == DIVERGED
    assert attribute_nan([NanRecord("a", 7, [0])]).suspects == ["a"]
    assert attribute_nan([NanRecord("a", 7, [0]), NanRecord("b", 7, [1])]).kind == DIVERGED
    replay = attribute_nan([NanRecord("z", 7, [0])], previous=[NanRecord("a", 7, [0])])
    assert replay.kind == DIVERGED and "again on other nodes" in replay.reason
    assert attribute_nan([NanRecord("a", 9, [0])], previous=[NanRecord("a", 7, [0])]).kind == SUSPECT


def test_nan_lines_round_trip_and_old_lines_still_parse():
    """NaNDetector's JSON line reads back; an earlier version's ``HOST key=value`` line, a bare host line and junk
    values parse leniently; a line that is not a record is skipped."""
    record = NanRecord("nid01", step=3, ranks=[4, 5], ep_groups=[1], bad=2, world=16)
    assert parse_nan_line(record.line() + "\n") == record and record.line().startswith("{")
    assert parse_nan_line(record.legacy_line()) == record
    assert parse_nan_line('{"host": "nid04", "step": "x", "ranks": [1, "2"]}') == NanRecord("nid04", ranks=[1])
    assert parse_nan_line('{"step": 3}') is None and parse_nan_line("{not json") is None
    assert parse_nan_line("nid02\n") == NanRecord("nid02")
    assert parse_nan_line("nid03 step=x ranks=1,2 what=3") == NanRecord("nid03", ranks=[1, 2])
    assert parse_nan_line("  \n") is None


def test_hang_blames_the_ranks_behind_and_nobody_when_all_stopped_together():
    """A stopped process loses its host; otherwise the silent ranks with the lowest step, behind the rest, make their
    hosts suspects; all silent at the same step: nobody is blamed."""
    records = {0: {"host": "a"}, 1: {"host": "b"}, 2: {"host": "c"}}
    assert attribute_hang([1], records, {0: 5, 1: 5, 2: 5}, ["b"]).lost == ["b"]
    v = attribute_hang([0, 1, 2], records, {0: 6, 1: 5, 2: 6}, [])
    assert v.kind == SUSPECT and v.suspects == ["b"]
    assert attribute_hang([0, 1, 2], records, {0: 5, 1: 5, 2: 5}, []).kind == "nobody"


def test_every_attempt_of_mula_fit_resumes_unless_the_user_start_point_is_still_the_newest():
    """``--ckpt_path last`` from the first attempt on (a requeued job continues); a user's ``--ckpt_path X`` is kept
    while no checkpoint of this launch exists and replaced by ``last`` after; other commands run unchanged."""
    from mula_lightning.launch.launcher import command_for_attempt

    layout = ["--trainer.num_nodes", "2", "--trainer.devices", "4"]
    fit = ["mula", "fit", "--config", "c.yaml"]
    assert command_for_attempt(fit, 0, 2, 4) == [*fit, "--ckpt_path", "last", *layout]
    user = [*fit, "--ckpt_path", "x/state.ckpt"]
    assert command_for_attempt(user, 0, 2, 4, keep_user_ckpt=True) == [*user, *layout]
    assert command_for_attempt(user, 1, 2, 4, keep_user_ckpt=False) == [*fit, "--ckpt_path", "last", *layout]
    assert command_for_attempt([*fit, "--ckpt_path=x"], 3, 2, 4) == [*fit, "--ckpt_path", "last", *layout]
    assert command_for_attempt(["python", "train.py"], 0, 2, 4) == ["python", "train.py"]


def test_exits_seen_at_the_same_moment_blame_the_signal_death_first():
    """One poll sees rank 0 exit 1 (its peer died) and rank 1 aborted: the abort's host is the suspect; an earlier
    report wins whatever its kind."""
    abort = -int(signal.SIGABRT)
    assert attribute_exits([RankExit("n0", [0], 1, at=5.0), RankExit("n1", [1], abort, at=5.0)], 1).suspects == ["n1"]
    assert attribute_exits([RankExit("n0", [0], 1, at=4.0), RankExit("n1", [1], abort, at=5.0)], 1).suspects == ["n0"]
