"""``mula_lightning.utils.dist``: the helpers every package shares, on real gloo groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mula_lightning.testing import run_distributed_test
from mula_lightning.utils.dist import all_gather_object, is_distributed, release_process_groups


def _release_after_collectives(rank: int, world_size: int) -> tuple[list[int], bool, bool]:
    sub = dist.new_group(list(range(world_size)))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=sub)
    gathered = all_gather_object(rank * 10)
    release_process_groups()
    gone = not is_distributed() and not dist.distributed_c10d._world.pg_map
    release_process_groups()  # a second call (the in-job close after the stage's own) does nothing
    return gathered, gone, float(value) == world_size * (world_size + 1) / 2


def test_release_process_groups_destroys_the_default_group_and_its_subgroups_once_the_collectives_are_over():
    """After the collectives of a finished stage, ``release_process_groups`` leaves no group of any kind behind on
    every rank (what ``mula fit`` does before the interpreter's shutdown, which aborted a finished rank when it freed
    them), and a second call is a no-op."""
    results = run_distributed_test(_release_after_collectives, world_size=3)  # not pooled: a pool keeps its groups
    assert results == [([0, 10, 20], True, True)] * 3
