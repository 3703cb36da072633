"""The sharded strategies' own saves (Lightning's ``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fabric.save``)
replace their directory whole, and with ``async_save=True`` write in the background while training goes on.

Slow storage is simulated by delaying the strategies' DCP write, so that the saves overlap training steps; a run
killed with SIGKILL while ``last.ckpt`` is being rewritten must resume from the previous ``last.ckpt``, intact.
"""

import os
import signal
import time

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from mula_lightning.checkpoint.replace_dir import PARTIAL_SUFFIX, readable_checkpoint, save_replacing
from mula_lightning.checkpoint.slots import CheckpointWriteError
from mula_lightning.testing import DistributedTestError, run_pooled_test
from mula_lightning.testing.fabric_run import tiny_moe_config
from mula_lightning.testing.lightning_module import MetaCausalLM


def _batches(rank, steps=8):
    g = torch.Generator().manual_seed(rank)
    return DataLoader(torch.randint(0, 64, (2 * steps, 8), generator=g), batch_size=2)


def _full_weights(module, strategy):
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    return {k: v.detach().clone() for k, v in full_state_dict(module.model, strategy).items()}


class _RecordWeights(Callback):
    """The full weights after every optimizer step (what a save of that step must hold)."""

    def __init__(self):
        self.at = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.at[trainer.global_step] = _full_weights(module, trainer.strategy)


def _slow_storage(kill_at_step=None, delay=0.4, fail_last_at_step=None):
    """Delay every strategy DCP write by ``delay`` s; SIGKILL the process once the write of ``last.ckpt`` at
    ``kill_at_step`` is on disk but not yet moved into place (from the background thread: the whole process dies,
    training included). Returns the undelayed write, to put back (pooled worker processes run later tests)."""
    from mula_lightning.strategies import common

    write = common.save_dcp

    def slow(path, tensors, metadata, planner=None, process_group=None):
        time.sleep(delay)
        if metadata.get("global_step") == fail_last_at_step and path.name.startswith("last.ckpt"):
            raise OSError("No space left on device")
        write(path, tensors, metadata, planner, process_group=process_group)
        if metadata.get("global_step") == kill_at_step and path.name.startswith("last.ckpt"):
            os.kill(os.getpid(), signal.SIGKILL)

    common.save_dcp = slow
    return write


def _strategy(layout, async_save):
    from mula_lightning.strategies import EPSOStrategy, ZeroTopoStrategy

    if layout == "epso":
        return EPSOStrategy(ep_size=2, async_save=async_save)
    return ZeroTopoStrategy(block_size=16, async_save=async_save)


def _fit(rank, world_size, root, layout, max_steps, resume=False, kill_at_step=None, async_save=True, fail=None):
    from mula_lightning.strategies import common

    write = _slow_storage(kill_at_step, fail_last_at_step=fail)
    record = _RecordWeights()
    checkpoint = ModelCheckpoint(root, every_n_train_steps=2, save_top_k=1, save_last=True)
    strategy = _strategy(layout, async_save)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
        callbacks=[record, checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    module = MetaCausalLM(tiny_moe_config(num_layers=1))
    try:
        trainer.fit(module, _batches(rank), ckpt_path="last" if resume else None)
    finally:
        common.save_dcp = write
    waits = strategy._async_saver.waits if strategy._async_saver is not None else []
    return trainer.global_step, record.at, _full_weights(module, strategy), len(waits)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["epso", "zero_topo"])
def test_async_saves_resume_from_last_with_the_weights_of_the_saved_step(tmp_path, layout):
    """2 processes save every 2 steps (top-1 plus last.ckpt) on slow storage while training goes on: the save of
    step 4 holds exactly the step-4 weights (staged, not those of the steps taken during its write), the end of
    training waits for it, the rotation left one top-k directory and no partial one, and ``ckpt_path="last"`` resumes
    at step 4 with those weights."""
    root = tmp_path / "ckpt"
    first = run_pooled_test(_fit, 2, root=str(root), layout=layout, max_steps=5, timeout=300)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"], names
    assert all(w > 0 for *_, w in first)  # a later save waited for the one in flight
    resumed = run_pooled_test(_fit, 2, root=str(root), layout=layout, max_steps=4, resume=True, timeout=300)
    for (_, at, _, _), (step, _, weights, _) in zip(first, resumed):
        assert step == 4 and sorted(weights) == sorted(at[4])
        assert all(torch.equal(weights[k], v) for k, v in at[4].items())
        assert any(not torch.equal(at[5][k], v) for k, v in at[4].items())  # step 5 changed the weights


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_while_last_is_rewritten_leaves_the_previous_last_whole(tmp_path, async_save):
    """Killed once the new last.ckpt of step 4 is fully written but not yet moved into place: last.ckpt is still
    the complete step-2 checkpoint (it was never overwritten in place), and ``ckpt_path="last"`` resumes from it
    with the step-2 weights; the next run's save clears the stale partial directory."""
    root = tmp_path / "ckpt"
    straight = run_pooled_test(_fit, 2, root=str(tmp_path / "straight"), layout="epso", max_steps=2, timeout=300)
    with pytest.raises(DistributedTestError, match="SIGKILL"):
        run_pooled_test(
            _fit, 2, root=str(root), layout="epso", max_steps=6, kill_at_step=4, async_save=async_save, timeout=300
        )
    assert (root / ("last.ckpt" + PARTIAL_SUFFIX) / ".metadata").is_file()
    resumed = run_pooled_test(_fit, 2, root=str(root), layout="epso", max_steps=2, resume=True, timeout=300)
    for (_, at, _, _), (step, _, weights, _) in zip(straight, resumed):
        assert step == 2 and all(torch.equal(weights[k], v) for k, v in at[2].items())
    run_pooled_test(_fit, 2, root=str(root), layout="epso", max_steps=4, resume=True, timeout=300)
    assert not (root / ("last.ckpt" + PARTIAL_SUFFIX)).exists()


def _write(payload):
    def write(target):
        target.mkdir(parents=True, exist_ok=True)
        (target / "data").write_text(payload)
        (target / ".metadata").write_text("done")

    return write


def test_a_failed_write_leaves_the_previous_directory_and_a_kill_between_renames_is_recovered(tmp_path):
    """One process: a write that raises leaves the previous directory untouched and raises CheckpointWriteError
    naming the path; a save interrupted between its two renames (path missing) is read from the complete new
    version, else from the previous one."""
    path = tmp_path / "last.ckpt"
    save_replacing(path, _write("one"))
    assert (path / "data").read_text() == "one" and readable_checkpoint(path) == path

    def failing(target):
        _write("two")(target)
        raise OSError("No space left on device")

    with pytest.raises(CheckpointWriteError, match=r"last.ckpt: not saved \(OSError: No space left on device\)"):
        save_replacing(path, failing)
    assert (path / "data").read_text() == "one"

    path.rename(tmp_path / "last.ckpt.replaced")  # killed after the first rename, before the second
    _write("two")(tmp_path / "last.ckpt.partial")
    assert (readable_checkpoint(path) / "data").read_text() == "two"
    (tmp_path / "last.ckpt.partial" / ".metadata").unlink()  # the new version incomplete: the previous one
    assert (readable_checkpoint(path) / "data").read_text() == "one"
    save_replacing(path, _write("three"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and (path / "data").read_text() == "three"


@pytest.mark.distributed
def test_a_failed_last_asynchronous_save_fails_the_run_at_teardown(tmp_path):
    """The last save of a run (last.ckpt at step 4) fails in the background after training ended: the Trainer's
    teardown waits for it and the run fails naming the error, instead of ending green without its checkpoint; the
    step-2 last.ckpt is still there, whole."""
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError, match="No space left on device"):
        run_pooled_test(_fit, 2, root=str(root), layout="epso", max_steps=4, fail=4, timeout=300)
    assert (root / "last.ckpt" / ".metadata").is_file() and (root / "epoch=0-step=4.ckpt" / ".metadata").is_file()
