"""The memory-mapped dataset and the Megatron-style sampler on an ``arange`` dataset (token value = position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from mula_lightning.data.dataset import MegatronSampler, TokenShardDataset, collate_batch

SEQ = 4


def _loader(ds: TokenShardDataset, sampler: MegatronSampler) -> DataLoader:
    return DataLoader(ds, batch_size=sampler.micro_batch_size, sampler=sampler, collate_fn=collate_batch)


def _instance_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // SEQ).tolist()


def _run_step(iterators: list, samplers: list[MegatronSampler]) -> list[int]:
    """One training step on every rank (in rank order), then mark it consumed everywhere."""
    ids = []
    for it in iterators:
        ids += _instance_ids(next(it))
    for s in samplers:
        s.mark_consumed()
    return ids


def _ranks(ds, mbs: int, dp: int, gbs: int | None = None) -> list[MegatronSampler]:
    return [MegatronSampler(ds, mbs, r, dp, global_batch_size=gbs) for r in range(dp)]


def test_dataset_reads_rows_across_shards(tmp_path, make_arange_dataset):
    """Contiguous reads spanning shard boundaries return exactly the requested rows, as int64 with equal labels."""
    ds = TokenShardDataset(make_arange_dataset(tmp_path, 30, SEQ, per_shard=7))
    batch = ds.__getitems__([5, 6, 7, 8, 20, 3])
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (6, SEQ)
    assert _instance_ids(batch) == [5, 6, 7, 8, 20, 3]
    assert torch.equal(batch["input_ids"][:, 1] - batch["input_ids"][:, 0], torch.ones(6, dtype=torch.int64))
    assert torch.equal(batch["labels"], batch["input_ids"])
    np.testing.assert_array_equal(ds.read(0, 30)[:, 0], np.arange(30) * SEQ)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 90), mbs=st.integers(1, 4), dp=st.integers(1, 4), accum=st.integers(1, 2))
def test_all_ranks_cover_each_instance_once_per_epoch(tmp_path_factory, n, mbs, dp, accum, make_arange_dataset):
    """All DP ranks together see every instance of a pass exactly once, each rank a contiguous slice of each step,
    with equal shapes; only the last partial global batch is dropped; the second pass repeats the first."""
    gbs = mbs * dp * accum
    if n < gbs:
        return
    ds = TokenShardDataset(make_arange_dataset(tmp_path_factory.mktemp("d"), n, SEQ))
    samplers = _ranks(ds, mbs, dp, gbs)
    loaders = [_loader(ds, s) for s in samplers]
    steps = len(loaders[0])
    assert all(len(dl) == steps for dl in loaders)
    for _ in range(2):  # two passes
        iterators = [iter(dl) for dl in loaders]
        seen = []
        for _ in range(steps):
            step = _run_step(iterators, samplers)
            for r in range(dp):  # rank r holds the r-th contiguous block of the step
                block = step[r * mbs : (r + 1) * mbs]
                assert block == list(range(block[0], block[0] + mbs))
            seen += step
        assert all(next(it, None) is None for it in iterators)
        assert seen == list(range(n // gbs * gbs))


@pytest.mark.parametrize(("before", "after"), [((2, 3), (3, 1)), ((4, 2), (1, 3)), ((1, 1), (2, 2))])
def test_resume_after_dp_and_micro_batch_change(tmp_path, before, after, make_arange_dataset):
    """Changing (dp_size, micro_batch_size) mid-epoch and resuming from the saved state repeats and skips nothing:
    the instances seen before plus after are exactly the prefix of the data order up to the new step's tail."""
    n = 61
    ds = TokenShardDataset(make_arange_dataset(tmp_path, n, SEQ))
    dp, mbs = before
    samplers = _ranks(ds, mbs, dp)
    iterators = [iter(_loader(ds, s)) for s in samplers]
    seen = []
    for _ in range(3):
        seen += _run_step(iterators, samplers)
    state = samplers[0].state_dict()
    assert state["consumed_samples"] == 3 * dp * mbs
    assert all(s.state_dict() == state for s in samplers)

    dp, mbs = after
    resumed = _ranks(ds, mbs, dp)
    for s in resumed:
        s.load_state_dict(state)
    loaders = [_loader(ds, s) for s in resumed]
    iterators = [iter(dl) for dl in loaders]
    remaining = (n - len(seen)) // (dp * mbs)
    for _ in range(remaining):
        seen += _run_step(iterators, resumed)
    assert all(next(it, None) is None for it in iterators)
    assert seen == list(range(len(seen)))
    assert n - len(seen) < dp * mbs  # only the tail shorter than one new global batch is left out
    # the next pass starts from instance 0 again
    assert _instance_ids(next(iter(loaders[0])))[0] == 0


def test_state_refuses_another_dataset(tmp_path, make_arange_dataset):
    """A position saved on one dataset is refused on another, with both fingerprints in the message."""
    a = TokenShardDataset(make_arange_dataset(tmp_path / "a", 20, SEQ))
    b = TokenShardDataset(make_arange_dataset(tmp_path / "b", 21, SEQ))
    state = MegatronSampler(a, 2).state_dict()
    with pytest.raises(ValueError, match=b.manifest.fingerprint):
        MegatronSampler(b, 2).load_state_dict(state)


def test_validation_pads_with_ignored_labels(tmp_path, make_arange_dataset):
    """Validation keeps every instance: the last step is padded on every rank to equal shapes, pad labels -100."""
    ds = TokenShardDataset(make_arange_dataset(tmp_path, 20, SEQ), "val")  # 5 instances
    batches = [list(_loader(ds, MegatronSampler(ds, 2, r, 2, pad=True))) for r in range(2)]
    assert [len(b) for b in batches] == [2, 2]
    real = []
    for rank_batches in batches:
        for b in rank_batches:
            assert b["input_ids"].shape == (2, SEQ)
            keep = b["labels"][:, 0] != -100
            assert torch.all(b["labels"][~keep] == -100) and torch.all(b["input_ids"][~keep] == 7)  # EOS rows
            real += b["input_ids"][keep, 0].tolist()
    assert sorted(real) == [10**6 + i * SEQ for i in range(5)]


def test_too_few_instances_for_one_global_batch(tmp_path, make_arange_dataset):
    """A split smaller than one global batch is a clear error naming the sizes."""
    ds = TokenShardDataset(make_arange_dataset(tmp_path, 5, SEQ))
    with pytest.raises(ValueError, match=r"5 instances, fewer than one global batch of 8"):
        MegatronSampler(ds, 4, 0, 2)
    with pytest.raises(ValueError, match=r"global_batch_size \(6\) must be a positive multiple"):
        MegatronSampler(ds, 2, 0, 2, global_batch_size=6)
