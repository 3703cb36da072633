"""The failure drill: its plan puts each fault in the attempt it belongs to, and 5 faults of different kinds (a node
killed, a slow rank, NaN on one rank, a hang, a full disk during an asynchronous save) through one real `mula
launch` (2 nodes x 2 ranks, the tiny MoE) end at the last step with every loss bit-equal to a straight run's."""

import pytest

from mula_lightning.testing.drill import DRILL_KINDS, EVERY, HANG_TIMEOUT_S, drill_table, plan_drill, run_drill
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


@pytest.mark.distributed
def test_five_mixed_faults_end_bit_equal_to_a_straight_run(tiny_data, tmp_path, leftover_processes):
    """In order: node 0 or 1 killed (taken out, a buffer node in its place), a slow rank (named in the straggler
    reports, no relaunch), NaN on one rank (NaNDetector, relaunch), a rank stopped (a hang, detected within the hang
    timeout + 10 s, its node taken out), ENOSPC in one rank's asynchronous save (the save fails on every rank at the
    next save's wait, the run resumes from the older slot). Every attempt's losses equal the straight run's, every
    step is done, nothing of the launch is left running, and each relaunch's cost parts are reported."""
    kinds = ("kill_node", "slow", "nan", "hang", "diskfull")
    result = run_drill(tmp_path, tiny_data, faults=5, seed=0, kinds=kinds, in_order=True)
    rows = {r["kind"]: r for r in result["faults"]}
    assert result["bit_equal"] and result["lost_steps"] == 0 and result["attempts"] == 5
    assert rows["kill_node"]["taken_out"] and rows["hang"]["taken_out"]
    assert "NaN" in rows["nan"]["reason"] and rows["slow"]["path"] == "straggler report"
    assert rows["hang"]["cost_s"]["detection"] <= HANG_TIMEOUT_S + 10
    for kind in ("kill_node", "nan"):  # the fault's own step was never completed (nor, for NaN, applied)
        assert rows[kind]["last_step"] == rows[kind]["step"] - 1, rows[kind]
    for kind in ("kill_node", "nan", "hang", "diskfull"):
        cost = rows[kind]["cost_s"]
        assert all(cost[k] is not None and cost[k] >= 0 for k in cost), (kind, cost)
    assert leftover_processes(result["launch_id"]) == []
    print(drill_table(result))
