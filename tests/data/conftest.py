"""Shared fixtures of the data tests: tiny local corpora, a tiny tokenizer, and an arange dataset.

Everything is built in ``tmp_path``: no network, no hub. The helpers are handed to tests as (session-scoped,
stateless) fixtures rather than imported, so the tests run under ``--import-mode=importlib`` as well.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from mula_lightning.data.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    atomic_write_json,
    fingerprint_of,
    sha256_file,
)

_WORD_TEXT = (
    "expert router token shard gather permute memory rank batch tensor gradient optimizer layer attention "
    "sparse dense aurora mula lightning fabric checkpoint resume epoch sample context window"
)
WORDS = _WORD_TEXT.split()


def _make_documents(n: int, seed: int, words_per_doc: tuple[int, int] = (5, 60)) -> list[str]:
    """``n`` random short documents of known words (some with newlines and non-ASCII text)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*words_per_doc))]
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), "naïve—Ünïcode\n")
        docs.append(f"doc {seed}-{i}: " + " ".join(words))
    return docs


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture
def tiny_tokenizer(tmp_path: Path) -> Path:
    """A byte-level BPE of 300 ids trained here on the test vocabulary; returns its ``tokenizer.json``."""
    from mula_lightning.data.tokenizer import train_bpe

    tok = train_bpe(_make_documents(200, seed=99), 300)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def _make_arange_dataset(root: Path, num_instances: int, seq_len: int = 4, per_shard: int = 7) -> Path:
    """A dataset whose train instance ``i`` holds ``i * seq_len + [0, seq_len)``, split over several shards.

    The token value identifies the instance, so any reader can be checked for exactly-once coverage.
    """
    root.mkdir(parents=True, exist_ok=True)
    data = np.arange(num_instances * seq_len, dtype=np.uint32).reshape(num_instances, seq_len)
    shards = []
    for k, start in enumerate(range(0, num_instances, per_shard)):
        name = f"train-{k:05d}.npy"
        np.save(root / name, data[start : start + per_shard])
        shards.append(
            {"file": name, "num_instances": len(data[start : start + per_shard]), "sha256": sha256_file(root / name)}
        )
    val = np.arange(5 * seq_len, dtype=np.uint32).reshape(5, seq_len) + 10**6
    np.save(root / "val-00000.npy", val)
    content = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "storage": "npy",
        "seq_len": seq_len,
        "dtype": "uint32",
        "vocab_size": 2**31,
        "eos_id": 7,
        "tokenizer": {"file": "tokenizer.json", "hash": "sha256:none", "source": "arange"},
        "splits": {
            "train": {"num_instances": num_instances, "shards": shards},
            "val": {
                "num_instances": 5,
                "shards": [
                    {"file": "val-00000.npy", "num_instances": 5, "sha256": sha256_file(root / "val-00000.npy")}
                ],
            },
        },
    }
    content["fingerprint"] = fingerprint_of(content)
    atomic_write_json(root / "manifest.json", content)
    return root


@pytest.fixture(scope="session")
def make_documents():
    """``make_documents(n, seed)``: random short documents (see :func:`_make_documents`)."""
    return _make_documents


@pytest.fixture(scope="session")
def write_jsonl():
    """``write_jsonl(path, docs, field="text")``: one JSON object per document."""
    return _write_jsonl


@pytest.fixture(scope="session")
def make_arange_dataset():
    """``make_arange_dataset(root, num_instances, seq_len, per_shard)``: see :func:`_make_arange_dataset`."""
    return _make_arange_dataset
