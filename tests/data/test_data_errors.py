"""Bad input gets a clear error that names the offending file or values."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mula_lightning.data import DataManifest, MulaDataModule, prepare
from mula_lightning.data.sources import discover_units, iter_documents


def _prep(inputs, out, tokenizer, **kw):
    return prepare([str(p) for p in inputs], str(out), tokenizer=str(tokenizer), workers=0, progress=False, **kw)


def test_empty_inputs(tmp_path, tiny_tokenizer, make_documents):
    """An empty file, an empty folder and a JSONL file without documents are refused, naming the path; an empty
    file among others in a folder is no document (and no lone EOS)."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_bytes(b"")
    (mixed / "b.txt").write_text(" ".join(make_documents(30, seed=2)))
    m = _prep([mixed], tmp_path / "o0", tiny_tokenizer, seq_len=4, val_fraction=0.0)
    assert m.content["num_documents"] == 1
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"input file .*empty\.txt' is empty"):
        _prep([tmp_path / "empty.txt"], tmp_path / "o1", tiny_tokenizer, seq_len=4)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match=r"input folder .*nothing' holds no files"):
        _prep([tmp_path / "nothing"], tmp_path / "o2", tiny_tokenizer, seq_len=4)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"input .*blank\.jsonl' holds no documents"):
        _prep([tmp_path / "blank.jsonl"], tmp_path / "o3", tiny_tokenizer, seq_len=4)


def test_unreadable_and_malformed_files(tmp_path, tiny_tokenizer, write_jsonl):
    """A missing path, a dangling link in a folder, an unreadable file, invalid JSON and a missing text field are
    reported with the file (and line)."""
    with pytest.raises(FileNotFoundError, match=r"input '.*missing\.jsonl' does not exist"):
        _prep([tmp_path / "missing.jsonl"], tmp_path / "o", tiny_tokenizer, seq_len=4)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world")
    os.symlink(tmp_path / "gone.txt", folder / "b.txt")
    with pytest.raises(OSError, match=r"cannot read input file '.*b\.txt'"):
        _prep([folder], tmp_path / "o", tiny_tokenizer, seq_len=4)
    if os.geteuid() != 0:  # root reads files whatever their mode
        locked = write_jsonl(tmp_path / "locked.jsonl", ["x"])
        locked.chmod(0)
        with pytest.raises(OSError, match=r"cannot read input file '.*locked\.jsonl'"):
            _prep([locked], tmp_path / "o", tiny_tokenizer, seq_len=4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        _prep([bad], tmp_path / "o", tiny_tokenizer, seq_len=4)
    other = write_jsonl(tmp_path / "other.jsonl", ["a document"], field="content")
    with pytest.raises(ValueError, match=r"other\.jsonl:1: no text field 'text' \(found \['content', 'id'\]\)"):
        _prep([other], tmp_path / "o", tiny_tokenizer, seq_len=4)


def test_vocabulary_overflowing_uint16(tmp_path, write_jsonl):
    """``dtype="uint16"`` with a vocabulary above 65,536 ids is refused naming both; unset, uint32 is chosen and
    ids above 65,535 survive the round trip."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    data = write_jsonl(tmp_path / "d.jsonl", [" ".join(f"w{i}" for i in range(69_990, 70_000))] * 4)
    with pytest.raises(
        ValueError, match=r"dtype uint16 holds ids below 65536, but tokenizer .*big\.json has a vocabulary of 70002 ids"
    ):
        _prep([data], tmp_path / "o16", tmp_path / "big.json", seq_len=4, dtype="uint16")
    m = _prep([data], tmp_path / "o32", tmp_path / "big.json", seq_len=4, val_fraction=0.0)
    assert m.dtype == np.uint32 and m.vocab_size == 70_002
    assert np.load(m.root / m.shards("train")[0]["file"]).max() == 70_001


def test_context_larger_than_the_data(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """A seq_len no input can fill is refused, naming every input with its token count."""
    data = write_jsonl(tmp_path / "small.jsonl", make_documents(3, seed=0))
    with pytest.raises(ValueError, match=r"seq_len \(100000\) is larger than every input.*small\.jsonl: \d+ tokens"):
        _prep([data], tmp_path / "o", tiny_tokenizer, seq_len=100_000)


def test_manifest_that_does_not_match_its_shards(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """A truncated shard, a missing shard, an edited manifest and a missing manifest are refused before any
    read, naming the file (through DataManifest and MulaDataModule alike)."""
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(80, seed=0))
    m = _prep([data], tmp_path / "ds", tiny_tokenizer, seq_len=8, shard_tokens=200)
    shard = m.root / m.shards("train")[1]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(ValueError, match=rf"shard .*{shard.name} is truncated: {size - 3} bytes on disk, .*{size}"):
        DataManifest.load(m.root)
    with pytest.raises(ValueError, match=shard.name):
        MulaDataModule(str(m.root)).setup("fit")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard .*{shard.name} listed in .* is missing"):
        DataManifest.load(m.root)
    content = json.loads((m.root / "manifest.json").read_text())
    content["seq_len"] = 16
    (m.root / "manifest.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match="fingerprint does not match"):
        DataManifest.load(m.root)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json not found.*did not finish"):
        DataManifest.load(tmp_path)


def test_bad_arguments_name_their_values(tmp_path, tiny_tokenizer, write_jsonl):
    """Contradictory or out-of-range arguments are refused before any work, naming the values."""
    data = write_jsonl(tmp_path / "d.jsonl", ["x"])
    with pytest.raises(ValueError, match="exactly one of tokenizer"):
        prepare([str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), train_tokenizer=500)
    with pytest.raises(ValueError, match=r"val_fraction \(1.5\)"):
        _prep([data], tmp_path / "o", tiny_tokenizer, val_fraction=1.5)
    with pytest.raises(ValueError, match=r"train_tokenizer vocab size \(100\) is below the smallest byte-level BPE"):
        prepare([str(data)], str(tmp_path / "o"), train_tokenizer=100, progress=False)
    with pytest.raises(FileNotFoundError, match=r"tokenizer '.*nope': no tokenizer\.json"):
        _prep([data], tmp_path / "o", tmp_path / "nope")


def test_optional_readers_say_what_to_install(tmp_path, make_documents):
    """Parquet and saved `datasets` inputs work when their library is importable, else name the package."""
    docs = make_documents(5, seed=4)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
        assert list(iter_documents(discover_units([str(tmp_path / "d.parquet")])[0])) == docs
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match=r"parquet input .*d\.parquet' needs pyarrow"):
            list(iter_documents(discover_units([str(tmp_path / "d.parquet")])[0]))
    try:
        import datasets

        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
        assert list(iter_documents(discover_units([str(tmp_path / "hf")])[0])) == docs
    except ImportError:
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "dataset_info.json").write_text("{}")
        with pytest.raises(ImportError, match=r"saved dataset .*hf' needs the `datasets` package"):
            list(iter_documents(discover_units([str(tmp_path / "hf")])[0]))


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    """`mula data prepare` turns a bad input into one error line naming the file and exit code 1."""
    from mula_lightning.cli import main

    code = main(["data", "prepare", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o"),
                 "--train-tokenizer", "300", "--progress", "false"])  # fmt: skip
    assert code == 1
    assert capsys.readouterr().err.strip().endswith(f"error: input {str(tmp_path / 'nope.jsonl')!r} does not exist")
