"""The failure drill: its plan puts each fault in the attempt it belongs to; 5 faults of 5 kinds through one real
`mula launch --in-job` (2 nodes x 2 ranks, the tiny MoE) are restarted in-job or fall back to a relaunch as they
should, and end at the last step with every loss bit-equal to a straight run's."""

import json

import pytest

from mula_lightning.testing.drill import (
    DRILL_KINDS,
    EVERY,
    HANG_TIMEOUT_S,
    DrillFault,
    drill_table,
    plan_drill,
    restart_ratio,
    run_drill,
)
from mula_lightning.utils.launch_env import parse_faults


def test_the_plan_spaces_faults_so_each_fires_in_its_own_attempt():
    """100 drawn faults: every kind comes up; steps increase; a slow fault shares its attempt with the next fault,
    every other fault ends its attempt; a full disk leaves 2 save intervals before the next fault (its failure
    surfaces at the next save's wait); a node kill names both ranks of one node; every spec parses; max_steps lies
    past the last fault; the same seed draws the same plan."""
    plan, max_steps = plan_drill(100, seed=3)
    assert {f.kind for f in plan} == set(DRILL_KINDS) and plan == plan_drill(100, seed=3)[0]
    for before, after in zip(plan, plan[1:], strict=False):
        assert after.step > before.step
        assert after.attempt == before.attempt + (before.kind != "slow")
        if before.kind == "diskfull":
            assert after.step - before.step > 2 * EVERY
    assert all(f.ranks in ([0, 1], [2, 3]) for f in plan if f.kind == "kill_node")
    assert all(len(f.ranks) == 1 for f in plan if f.kind != "kill_node")
    assert len(parse_faults(";".join(f.spec() for f in plan))) == sum(len(f.ranks) for f in plan)
    assert max_steps > plan[-1].step + EVERY
    with pytest.raises(ValueError, match="'meteor'"):
        plan_drill(3, 0, kinds=("meteor",))


def test_the_guides_in_job_launch_parses_and_restarts_a_rank_that_is_not_rank_0():
    """docs/launch.md's in-job example: its MULA_FAULT parses (rank 3 killed at step 5: not rank 0, whose process
    hosts the store, so the path taken is in-job) and its options are `mula launch --in-job`'s."""
    import shlex

    from mula_lightning.launch.cli import build_parser
    from mula_lightning.testing.doc_blocks import doc_block

    words = shlex.split(doc_block("launch-in-job").text.replace("\\\n", " "))
    (kill,) = parse_faults(next(w.split("=", 1)[1] for w in words if w.startswith("MULA_FAULT=")))
    args = build_parser().parse_args(words[words.index("launch") + 1 : words.index("--")])
    assert (kill.kind, kill.step, kill.rank) == ("kill", 5, 3) and args.in_job and args.nnodes * args.nproc_per_node > 3
    assert words[words.index("--") + 1 : words.index("--") + 3] == ["mula", "fit"]


@pytest.mark.distributed
def test_in_job_restarts_keep_the_survivors_and_fall_back_where_they_cannot(tiny_data, tmp_path, leftover_processes):
    """`mula launch --in-job` (2 nodes x 2 ranks, the tiny MoE, asynchronous saves) through 5 faults: an aborted
    rank, a Python exception, a stopped rank (a hang, detected within the hang timeout + 10 s: its node taken out)
    and a kill of rank 0's node (ranks 0 and 1 move to a buffer node: the launcher hosts the job's store) are each
    restarted in-job: the other ranks keep their processes (same pids), only the failed ones get new processes (and
    any survivor that could not leave the broken attempt, each named in an event). A rank killed during the set-up
    of an in-job restart (a second fault) falls back to a full relaunch, announced with why. Every part of each
    fault's cost is reported, every attempt's losses equal a straight run's, bit for bit, every step is done (the node
    kill's own step never completed), the in-job restarts cost less than the relaunch, and nothing of the launch is
    left running. The other kinds have tests of their own with real ranks (a slow rank:
    tests/callbacks/test_straggler_detection.py; a NaN's relaunch: tests/training/test_fabric_example.py; a failed
    asynchronous save: tests/checkpoint/test_async_slots.py) and all 8 run together in `make drill`."""
    plan = [
        DrillFault("abort", 2, 0, [3]),
        DrillFault("exception", 4, 1, [1]),
        DrillFault("kill_rank", 0, 2, [2]),  # step 0: in the set-up of attempt 2, while the job restarts
        DrillFault("hang", 7, 3, [3]),
        DrillFault("kill_node", 10, 4, [0, 1]),
    ]
    result = run_drill(tmp_path, tiny_data, faults=0, seed=0, in_job=True, plan=plan)
    report = json.loads((tmp_path / "drill" / "launch" / "launch_report.json").read_text())
    attempts, events = report["attempts"], " ".join(e["text"] for e in report["events"])
    assert result["bit_equal"] and result["lost_steps"] == 0 and len(attempts) == 6
    rows = result["faults"]
    paths = [row["path"] for row in rows]
    assert paths == ["in-job", "in-job", "relaunch", "in-job", "in-job"], paths
    in_job = [attempts[k] for k in (1, 2, 4, 5)]
    for attempt, failed in zip(in_job, [[3], [1], [2, 3], [0, 1]], strict=True):
        stuck = set(attempt["replaced_ranks"]) - set(failed)  # survivors that could not leave: replaced as well
        assert set(failed) <= set(attempt["replaced_ranks"]), (attempt["attempt"], attempt["replaced_ranks"])
        assert all(f"rank {r} could not leave attempt {attempt['attempt'] - 1}" in events for r in stuck), events
    for before, after in zip(attempts, attempts[1:], strict=False):
        if after["started_by"] == "in-job":  # the survivors' processes are the same, the replaced ones new
            kept = [r for r in range(4) if r not in after["replaced_ranks"]]
            assert [after["pids"][r] for r in kept] == [before["pids"][r] for r in kept]
            assert not set(after["pids"]) & {before["pids"][r] for r in after["replaced_ranks"]}
        else:
            assert not set(after["pids"]) & set(before["pids"])
    assert attempts[4]["nodes"][1] != attempts[3]["nodes"][1]  # the hung rank's node taken out: a buffer node
    assert attempts[5]["nodes"][0] != attempts[4]["nodes"][0]  # rank 0's node lost: ranks 0, 1 on a buffer node
    assert "no in-job restart (a second fault before the in-job restart of attempt 2 completed)" in events
    by_kind = {row["kind"]: row for row in rows}
    assert by_kind["hang"]["taken_out"] and by_kind["kill_node"]["taken_out"]
    assert by_kind["hang"]["cost_s"]["detection"] <= HANG_TIMEOUT_S + 10
    assert by_kind["kill_node"]["last_step"] == by_kind["kill_node"]["step"] - 1, by_kind["kill_node"]
    for kind in ("hang", "kill_node"):  # every part of the cost of a fault with steps after it
        assert all(v is not None and v >= 0 for v in by_kind[kind]["cost_s"].values()), by_kind[kind]
    ratio = restart_ratio(result)
    assert ratio["restart_ratio"] is not None and ratio["restart_ratio"] < 1, ratio
    assert leftover_processes(result["launch_id"]) == []
    print(drill_table(result), ratio)
