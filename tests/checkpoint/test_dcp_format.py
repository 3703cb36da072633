"""The shared sharded-checkpoint format (``checkpoint.dcp_format``): what both sharded strategies write and read."""

import pytest
import torch

from mula_lightning.checkpoint.dcp_format import METADATA_KEY, load_dcp, save_dcp, saved_keys


def test_round_trip_of_tensors_and_metadata(tmp_path):
    """Logical-key tensors come back into the caller's targets in place, the metadata (tensors and plain data) is
    returned, and the metadata item never stays among the targets."""
    path = tmp_path / "ckpt"
    model = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.arange(5.0)}
    save_dcp(path, {"model": model}, {"step": 7, "rng": torch.tensor([1, 2, 3])})
    assert saved_keys(path) == {"model", METADATA_KEY}
    targets = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    meta = load_dcp(path, targets)
    assert meta["step"] == 7 and torch.equal(meta["rng"], torch.tensor([1, 2, 3]))
    assert set(targets) == {"model"}
    assert all(torch.equal(targets["model"][k], v) for k, v in model.items())


def test_missing_keys_are_named_or_skipped(tmp_path):
    """A target the checkpoint lacks is named with what the checkpoint holds (strict), or dropped (not strict); a
    directory that is not a DCP checkpoint is named; the metadata key cannot be used for state."""
    path = tmp_path / "ckpt"
    save_dcp(path, {"model": {"w": torch.ones(2)}}, {})
    with pytest.raises(KeyError, match=r"has no \['optimizer'\] \(it holds \['metadata', 'model'\]\)"):
        load_dcp(path, {"model": {"w": torch.zeros(2)}, "optimizer": {"x": torch.zeros(1)}})
    targets = {"model": {"w": torch.zeros(2)}, "optimizer": {"x": torch.zeros(1)}}
    load_dcp(path, targets, strict=False)
    assert set(targets) == {"model"} and torch.equal(targets["model"]["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="not a torch.distributed.checkpoint directory"):
        load_dcp(tmp_path, {})
    with pytest.raises(ValueError, match="'metadata' is reserved"):
        save_dcp(tmp_path / "other", {METADATA_KEY: {"w": torch.ones(1)}}, {})
