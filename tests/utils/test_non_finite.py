"""NonFiniteCheck without a Trainer (what a Fabric loop uses): a rank's NaN loss stops every rank at the same step,
before the update, with a report that names the rank, its host and its tensors, the launcher's event line and the
host list; a clean step clears the flags; every rank leaves together (raising here instead of exiting)."""

import json
import os

import pytest
import torch

from mula_lightning.testing import run_distributed_test
from mula_lightning.utils.launch_env import NAN_EVENTS_ENV, parse_nan_line
from mula_lightning.utils.non_finite import NonFiniteCheck, NonFiniteError

BAD_RANK, BAD_STEP = 2, 3


def _loop(rank, world_size, root, events):
    """3 ranks on simulated nodes of 1; rank 2's input turns NaN at its 4th step (3 steps done). Returns each rank's
    (steps applied, the report it raised with, its weight after the last applied step)."""
    os.environ[NAN_EVENTS_ENV] = events
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)).double()
    check = NonFiniteCheck(root, exit_code=None).watch(model)  # raise: the harness sees each rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    try:
        while step < 6:
            for micro in range(2):  # two micro-batches per step: a NaN in either counts
                x = torch.full((2, 4), float(rank + micro + step), dtype=torch.float64)
                if rank == BAD_RANK and step == BAD_STEP and micro == 1:
                    x[0, 0] = float("nan")
                loss = model(x).square().mean()
                check.loss(loss)
                loss.backward()
            check.step(step)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
    except NonFiniteError as err:
        return step, err.report, model[0].weight.detach().clone()
    return step, None, None


@pytest.mark.distributed
def test_a_nan_on_one_rank_stops_every_rank_before_the_update_and_names_it(tmp_path):
    """Rank 2's second micro-batch of step 4 holds a NaN: all 3 ranks raise at that step with 3 steps applied (the
    earlier clean steps cleared the flags), rank 2's weights stay finite (the update never ran), the report on disk
    names rank 2 on node2 with a non-finite loss and its 4 tensors (the last layer first: backward order), and the event
    line reaches both the report folder and the launcher's file (MULA_NAN_EVENTS_FILE); node2 is in the host list."""
    events = tmp_path / "launcher_nan_events.jsonl"
    results = run_distributed_test(_loop, 3, ranks_per_node=1, root=str(tmp_path / "nan"), events=str(events))
    assert [r[0] for r in results] == [BAD_STEP] * 3
    assert all(r[1]["bad_ranks"] == [BAD_RANK] for r in results)
    assert torch.isfinite(results[BAD_RANK][2]).all()
    report = json.loads((tmp_path / "nan" / "nan_report.json").read_text())
    (bad,) = report["ranks"]
    assert (report["step"], bad["rank"], bad["host"], bad["loss_finite"]) == (BAD_STEP, BAD_RANK, "node2", False)
    assert bad["first_offending_tensors"][0] in ("1.weight", "1.bias") and len(bad["first_offending_tensors"]) == 4
    for path in (tmp_path / "nan" / "nan_events.jsonl", events):
        (line,) = path.read_text().splitlines()
        record = parse_nan_line(line)
        assert (record.host, record.step, record.ranks, record.bad, record.world) == ("node2", BAD_STEP, [2], 1, 3)
    assert (tmp_path / "nan" / "failed_hosts.txt").read_text() == "node2\n"
