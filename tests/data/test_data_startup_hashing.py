"""Start-up cost of data integrity: over a prepared dataset no process re-reads a shard to hash it, and over an
unstamped copy (a dataset copied elsewhere, or stamps lost) each shard is hashed once in the whole job, not once per
rank and DataLoader worker (at thousands of ranks over a multi-terabyte corpus that was petabytes of reads)."""

import shutil
from pathlib import Path

import pytest

from mula_lightning.testing import DistributedTestError, run_pooled_test


def _start(rank, world_size, data_dir, log_dir):
    """A rank's start-up as the Trainer runs it: DataModule setup, a batch from each loader, and a DataLoader
    worker's view (the dataset pickled and read again, as a worker process receives it: the ranks of
    run_distributed_test are daemons and cannot start workers); every SHA-256 computed is logged."""
    import pickle

    import mula_lightning.data.manifest as manifest_module
    from mula_lightning.data.datamodule import MulaDataModule

    real = manifest_module.sha256_file

    def counting(path):
        with open(Path(log_dir) / f"hash.rank{rank}", "a") as fh:
            fh.write(Path(path).name + "\n")
        return real(path)

    manifest_module.sha256_file = counting
    try:
        data = MulaDataModule(data_dir, micro_batch_size=2, num_workers=0, dp_rank=rank, dp_size=world_size)
        data.setup("fit")
        next(iter(data.train_dataloader()))
        val = data.val_dataloader()
        if val:
            next(iter(val))
        worker_copy = pickle.loads(pickle.dumps(data.train_dataset))
        assert worker_copy.read(len(worker_copy) - 2, len(worker_copy)).shape[0] == 2
    finally:
        manifest_module.sha256_file = real  # a pooled rank runs the next test with the real function


def _hashes(log_dir):
    return sorted(line for f in Path(log_dir).glob("hash.rank*") for line in f.read_text().split())


def _shards(data_dir):
    return sorted(p.name for p in Path(data_dir).glob("*.npy"))


@pytest.mark.distributed
def test_four_ranks_hash_each_shard_at_most_once_in_total(tiny_data, tmp_path):
    """4 ranks over the prepared dataset: no hash at all (prepare stamped the shards). Over a copy without stamps:
    every shard hashed exactly once over the 4 ranks and their DataLoader workers' copies; started again: none. A shard
    corrupted in place (same size) is found by the rank that hashes it and every rank stops naming it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    run_pooled_test(_start, 4, data_dir=str(tiny_data), log_dir=str(logs), timeout=240)
    assert _hashes(logs) == []

    copy = tmp_path / "copy"
    shutil.copytree(tiny_data, copy)
    shutil.rmtree(copy / ".verified")
    logs = tmp_path / "logs2"
    logs.mkdir()
    run_pooled_test(_start, 4, data_dir=str(copy), log_dir=str(logs), timeout=240)
    assert _hashes(logs) == _shards(copy) and len(_shards(copy)) >= 2
    logs = tmp_path / "logs3"
    logs.mkdir()
    run_pooled_test(_start, 4, data_dir=str(copy), log_dir=str(logs), timeout=240)
    assert _hashes(logs) == []

    shutil.rmtree(copy / ".verified")
    victim = copy / _shards(copy)[-1]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DistributedTestError) as info:
        run_pooled_test(_start, 4, data_dir=str(copy), log_dir=str(tmp_path), timeout=240)
    assert sorted(info.value.failures) == [0, 1, 2, 3]
    assert all(victim.name in text and "SHA-256" in text for text in info.value.failures.values())
