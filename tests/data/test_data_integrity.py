"""Data integrity at load: a shard changed in place (same size) is caught by its SHA-256 on the next open, token
ids outside the vocabulary are named with their shard, instance and position, and `mula data verify` checks all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mula_lightning.data import manifest as manifest_module
from mula_lightning.data.cli import main as data_cli
from mula_lightning.data.dataset import TokenShardDataset
from mula_lightning.data.manifest import VERIFIED_DIR, DataManifest


def _flip_one_token(path, value):
    """Overwrite the first token of a .npy shard in place: same size, other content."""
    array = np.load(path, mmap_mode="r+")
    array[0, 0] = value
    array.flush()
    del array


def test_in_place_corruption_is_caught_on_the_next_open(make_arange_dataset, tmp_path, monkeypatch):
    """The first open hashes each shard and leaves a stamp; an unchanged shard is not hashed again; a shard whose
    bytes change in place (same size, so the manifest's size check passes) fails its SHA-256 on the next open."""
    root = make_arange_dataset(tmp_path / "d", num_instances=20)
    assert TokenShardDataset(root, "train").read(0, 20).shape == (20, 4)
    stamps = sorted(p.name for p in (root / VERIFIED_DIR).iterdir())
    assert stamps == ["train-00000.npy.json", "train-00001.npy.json", "train-00002.npy.json"]

    calls = []
    real = manifest_module.sha256_file
    monkeypatch.setattr(manifest_module, "sha256_file", lambda p: calls.append(p) or real(p))
    TokenShardDataset(root, "train").read(0, 20)
    assert calls == []  # unchanged files: the stamps stand

    _flip_one_token(root / "train-00001.npy", 3)  # a value inside the vocabulary: only the checksum can see it
    DataManifest.load(root)  # sizes, shapes and dtypes still match
    with pytest.raises(ValueError, match=r"shard .*train-00001.npy: SHA-256 .* differs from the manifest"):
        TokenShardDataset(root, "train").read(0, 20)


def test_token_ids_outside_the_vocabulary_are_named(make_arange_dataset, tmp_path):
    """An id >= vocab_size raises a ValueError naming the shard, the instance inside it, the position and the id
    (instead of an IndexError deep inside the embedding)."""
    root = make_arange_dataset(tmp_path / "d", num_instances=20, per_shard=7)
    manifest = DataManifest.load(root)
    manifest.content["vocab_size"] = 60  # the arange tokens of instance i are 4i .. 4i+3: instance 15 holds 60
    dataset = TokenShardDataset(root, "train", manifest, verify_checksums=False)
    assert dataset.read(0, 15).max() == 59
    with pytest.raises(ValueError, match=r"train-00002.npy: token id 60 at instance 1, position 0 is outside the "):
        dataset.read(10, 20)


def test_mula_data_verify(make_arange_dataset, tmp_path, capsys):
    """`mula data verify DIR`: one summary line and exit 0 on a sound dataset; one error line naming the corrupt
    shard and exit 1 after an in-place change, without a traceback."""
    root = make_arange_dataset(tmp_path / "d", num_instances=20)
    assert data_cli(["verify", str(root)]) == 0
    assert "every shard matches its SHA-256; 100 token ids checked" in capsys.readouterr().out
    _flip_one_token(root / "val-00000.npy", 1)
    assert data_cli(["verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mula data verify: error: shard") and "val-00000.npy" in err and "Traceback" not in err
    assert json.loads((root / "manifest.json").read_text())["vocab_size"] == 2**31  # nothing rewritten
