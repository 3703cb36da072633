"""Optional litdata output: ``format="litdata"`` round-trips to exactly the instances of the ``npy`` format."""

from __future__ import annotations

import numpy as np
import pytest

from mula_lightning.data import open_litdata, prepare

pytest.importorskip("litdata")


def test_litdata_round_trip(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """Written with litdata.optimize and read with StreamingDataset + TokensLoader, each split gives back the same
    instances, in the same permuted order, as the memory-mapped npy shards of the same settings."""
    inputs = [str(write_jsonl(tmp_path / f"p{s}.jsonl", make_documents(40, seed=s))) for s in range(2)]
    kw = dict(seq_len=16, tokenizer=str(tiny_tokenizer), workers=0, progress=False, val_fraction=0.1)
    npy = prepare(inputs, str(tmp_path / "npy"), **kw)
    lit = prepare(inputs, str(tmp_path / "lit"), format="litdata", shard_tokens=16 * 50, **kw)
    assert lit.storage == "litdata" and lit.fingerprint != npy.fingerprint
    for split in ("train", "val"):
        expected = np.concatenate([np.load(npy.root / s["file"]) for s in npy.shards(split)])
        ds = open_litdata(lit.root, split, cache_dir=str(tmp_path / "cache" / split))
        got = np.stack([ds[i].numpy() for i in range(len(ds))])
        assert len(ds) == lit.num_instances(split) == len(expected)
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="prepared with format 'npy', not 'litdata'"):
        open_litdata(npy.root)
