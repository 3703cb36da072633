"""``prepare``: document order and EOS placement, determinism, resumability, and the ``mula data prepare`` CLI."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mula_lightning.data import DataManifest, prepare
from mula_lightning.data.sources import stdlib_files
from mula_lightning.data.tokenizer import load_tokenizer

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _instances_in_source_order(manifest: DataManifest) -> np.ndarray:
    """Undo the global shuffle: rows of all splits, sorted back by global instance id.

    The documented order: ``permutation(N)`` of ``default_rng(seed)``; its first ``n_val`` ids are validation.
    """
    empty = np.empty((0, manifest.seq_len), dtype=manifest.dtype)
    splits = {s: [np.load(manifest.root / sh["file"]) for sh in manifest.shards(s)] for s in ("val", "train")}
    order = np.random.default_rng(manifest.content["seed"]).permutation(manifest.content["num_instances"])
    rows = np.empty((len(order), manifest.seq_len), dtype=manifest.dtype)
    rows[order] = np.concatenate([empty, *splits["val"], *splits["train"]])
    return rows


def _same_tree(a: Path, b: Path) -> None:
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*"))
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*"))
    assert names_a == names_b
    for name in names_a:
        if (a / name).is_file() and not name.startswith(".verified/"):  # stamps hold each file's mtime
            assert filecmp.cmp(a / name, b / name, shallow=False), f"{name} differs"


def test_decoding_gives_documents_in_order_with_eos(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """Un-shuffled instances of each input file are its documents' tokens in order, EOS after each document;
    decoding them gives the documents' text back; only the tail shorter than seq_len is dropped per file."""
    docs = [make_documents(40, seed=s) for s in range(3)]
    inputs = [str(write_jsonl(tmp_path / "in" / f"part-{s}.jsonl", d)) for s, d in enumerate(docs)]
    m = prepare(inputs, str(tmp_path / "out"), seq_len=16, tokenizer=str(tiny_tokenizer), workers=0, progress=False)
    tok = load_tokenizer(tiny_tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    assert m.eos_id == eos and m.dtype == np.uint16 and m.vocab_size == 300
    rows = _instances_in_source_order(m)
    start = 0
    for unit_docs, info in zip(docs, m.content["inputs"]):
        expected = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [eos] for d in unit_docs])
        n = len(expected) // 16
        assert info["instances"] == n and info["tokens"] == len(expected) and info["documents"] == len(unit_docs)
        got = rows[start : start + n].reshape(-1)
        np.testing.assert_array_equal(got, expected[: n * 16])
        texts = [tok.decode(list(map(int, piece))) for piece in np.split(got, np.nonzero(got == eos)[0] + 1)[:-1]]
        assert [t.removesuffix("<|endoftext|>") for t in texts] == unit_docs[: len(texts)]
        assert len(texts) >= len(unit_docs) - 2
        start += n
    assert start == m.content["num_instances"] == m.num_instances("train") + m.num_instances("val")


def test_parallel_workers_match_in_process_and_rerun_is_a_noop(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """Two worker processes write byte-identical output to in-process encoding; a re-run with the same settings
    returns the finished dataset untouched; other settings into the same folder are refused by name."""
    inputs = [str(write_jsonl(tmp_path / "in" / f"p{s}.jsonl", make_documents(60, seed=s))) for s in range(3)]
    kw = dict(seq_len=8, tokenizer=str(tiny_tokenizer), shard_tokens=400, progress=False)
    serial = prepare(inputs, str(tmp_path / "serial"), workers=0, **kw)
    parallel = prepare(inputs, str(tmp_path / "parallel"), workers=2, **kw)
    _same_tree(tmp_path / "serial", tmp_path / "parallel")
    assert len(serial.shards("train")) > 1
    mtime = (tmp_path / "serial" / "manifest.json").stat().st_mtime_ns
    again = prepare(inputs, str(tmp_path / "serial"), workers=0, **kw)
    assert again.fingerprint == serial.fingerprint == parallel.fingerprint
    assert (tmp_path / "serial" / "manifest.json").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match=r"other settings \(differs in: seed, seq_len\)"):
        prepare(inputs, str(tmp_path / "serial"), workers=0, **{**kw, "seq_len": 4}, seed=5)
    other = prepare(inputs, str(tmp_path / "serial"), workers=0, overwrite=True, **{**kw, "seq_len": 4})
    assert other.seq_len == 4 and not list((tmp_path / "serial").glob("*.tmp-*"))


def test_model_side_helpers(tmp_path, tiny_tokenizer, make_documents, write_jsonl):
    """The manifest gives the model its vocab size (refusing a too-small one) and detects a tokenizer mismatch."""
    inputs = [str(write_jsonl(tmp_path / "a.jsonl", make_documents(30, seed=1)))]
    m = prepare(inputs, str(tmp_path / "out"), seq_len=8, tokenizer=str(tiny_tokenizer), workers=0, progress=False)
    assert m.resolve_vocab_size(None) == 300 and m.resolve_vocab_size(None, pad_to_multiple_of=64) == 320
    assert m.resolve_vocab_size(4096) == 4096
    with pytest.raises(ValueError, match=r"model vocab_size \(256\) is smaller .* \(300 ids"):
        m.resolve_vocab_size(256)
    m.check_tokenizer(tiny_tokenizer)
    m.check_tokenizer(m.tokenizer_path)  # the copy saved beside the data is the same tokenizer
    from mula_lightning.data.tokenizer import train_bpe

    other = train_bpe(make_documents(50, seed=3), 280)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        m.check_tokenizer(other)


def test_embedded_corpus_through_the_mula_cli(tmp_path, capsys):
    """`mula data prepare` with no --input reads the standard library (sorted, capped by --max-bytes) and trains a
    byte-level BPE saved beside the data; the first instance decodes to the start of the first stdlib file."""
    from mula_lightning.cli import main

    out = tmp_path / "stdlib"
    argv = ["data", "prepare", "--output", str(out), "--seq-len", "64", "--train-tokenizer", "400"]
    argv += ["--max-bytes", "150000", "--workers", "0", "--val-fraction", "0", "--progress", "false"]
    assert main(argv) == 0
    assert "prepared" in capsys.readouterr().out
    m = DataManifest.load(out)
    root, files = stdlib_files()
    assert m.content["inputs"][0]["name"].startswith("python-stdlib:")
    used = m.content["plan"]["inputs"][0]["files"]
    assert [f["path"] for f in used] == [str(p) for p in files[: len(used)]]
    assert sum(f["bytes"] for f in used[:-1]) < 150_000 <= sum(f["bytes"] for f in used)
    tok = load_tokenizer(out / "tokenizer.json")
    first = _instances_in_source_order(m)[0]
    assert files[0].read_text(errors="replace").startswith(tok.decode(list(map(int, first))))


def _cli(out: Path, inputs: list[str], tokenizer_vocab: int) -> list[str]:
    code = "import sys; from mula_lightning.cli import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, "data", "prepare", "--input", *inputs, "--output", str(out),
            "--seq-len", "8", "--train-tokenizer", str(tokenizer_vocab), "--workers", "0", "--shard-tokens", "2048",
            "--progress", "false"]  # fmt: skip


def test_kill_mid_run_then_rerun_is_byte_identical(tmp_path, make_documents, write_jsonl):
    """SIGKILL during tokenization and again during sharding, then re-running, gives byte-identical files to one
    uninterrupted run (tokenizer included): finished steps are reused, temporaries never look finished."""
    inputs = [str(write_jsonl(tmp_path / "in" / f"p{s:02d}.jsonl", make_documents(150, seed=s))) for s in range(24)]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(_cli(ref, inputs, 320), env=env, check=True, capture_output=True, timeout=300)

    for marker in (killed / ".work" / "unit-00003.json", killed / "train-00004.npy"):
        proc = subprocess.Popen(_cli(killed, inputs, 320), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, f"prepare finished before {marker.name} could be interrupted"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
        assert not (killed / "manifest.json").exists()
    result = subprocess.run(_cli(killed, inputs, 320), env=env, capture_output=True, text=True, check=True, timeout=300)
    assert "resuming" in result.stderr
    _same_tree(ref, killed)
