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


def test_datamodule_reads_litdata_like_npy_and_resumes_exactly(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """``MulaDataModule`` over the litdata format yields the same batches as over the npy format of the same settings
    (training order and validation), the chunks keep the manifest's uint16 dtype, and a position saved after 3 steps
    resumes on two DP ranks with the very next instances, as with npy shards."""
    import torch
    from litdata.streaming.item_loader import TokensLoader  # noqa: F401  (the reader under test)

    from mula_lightning.data import MulaDataModule
    from mula_lightning.data.litdata_io import LitdataTokenDataset

    inputs = [str(write_jsonl(tmp_path / f"p{s}.jsonl", make_documents(40, seed=s))) for s in range(2)]
    kw = dict(seq_len=16, tokenizer=str(tiny_tokenizer), workers=0, progress=False, val_fraction=0.1)
    npy = prepare(inputs, str(tmp_path / "npy"), **kw)
    lit = prepare(inputs, str(tmp_path / "lit"), format="litdata", shard_tokens=16 * 50, **kw)
    assert lit.dtype == np.uint16
    assert open_litdata(lit.root, "train", cache_dir=str(tmp_path / "c"))[0].dtype == torch.uint16
    modules = {name: MulaDataModule(str(m.root), micro_batch_size=3) for name, m in (("npy", npy), ("lit", lit))}
    for dm in modules.values():
        dm.setup("fit")
    assert isinstance(modules["lit"].train_dataset, LitdataTokenDataset)
    batches = {name: list(dm.train_dataloader()) for name, dm in modules.items()}
    assert len(batches["lit"]) == len(batches["npy"]) > 3
    for a, b in zip(batches["lit"], batches["npy"]):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    for a, b in zip(modules["lit"].val_dataloader(), modules["npy"].val_dataloader()):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])

    dm = MulaDataModule(str(lit.root), micro_batch_size=2)
    for _, _ in zip(range(3), dm.train_dataloader()):
        dm.mark_consumed()
    state = dm.state_dict()
    flat = torch.cat([b["input_ids"] for b in batches["npy"]])  # the npy order, 3 instances per batch
    for rank in range(2):
        other = MulaDataModule(str(lit.root), micro_batch_size=1, dp_rank=rank, dp_size=2)
        other.load_state_dict(state)
        other.setup("fit")
        first = next(iter(other.train_dataloader()))["input_ids"][0]
        assert torch.equal(first, flat[6 + rank])
