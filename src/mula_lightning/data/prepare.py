"""``prepare``: tokenize -> global shuffle -> shard, as in Section 4 of the Aurora paper.

Steps, each resumable (a re-run skips what a previous, interrupted run finished):

1. **Plan.** Resolve the inputs into units (``sources.py``), checksum every input file, load or train the
   tokenizer. The plan (settings + input checksums + tokenizer hash) is written to ``.work/plan.json``; a re-run
   with a different plan into the same folder is refused instead of mixing two datasets.
2. **Tokenize.** Every unit's documents are encoded in batches by worker processes (``tokenizer.py``) and joined
   with EOS after each document into ``.work/unit-NNNNN.bin``; its ``.json`` sidecar, written last, marks it done.
3. **Shuffle.** Unit *i* holds ``N_i = T_i // seq_len`` instances (its tail is dropped). One permutation of all
   ``N = sum(N_i)`` instances, drawn from ``seed``, is split into validation (its first ``round(N *
   val_fraction)`` entries) and training (the rest).
4. **Shard.** The permuted instances are gathered into ``train-NNNNN.npy`` / ``val-NNNNN.npy`` files of shape
   ``(instances, seq_len)`` that ranks memory-map and read contiguously (or into litdata chunks).
5. **Manifest.** ``manifest.json`` is written last; then ``.work`` is removed.

Every file is written to a temporary name and renamed into place, so a killed run never leaves a file that looks
finished but is not, and the output of an interrupted-then-resumed run is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mula_lightning.data import sources
from mula_lightning.data.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    DataManifest,
    atomic_write_bytes,
    atomic_write_json,
    fingerprint_of,
)
from mula_lightning.data.shards import InstanceReader, write_npy_split
from mula_lightning.data.tokenizer import (
    choose_dtype,
    encode_documents,
    find_eos_id,
    init_worker,
    load_tokenizer,
    tokenizer_hash,
    train_bpe,
    vocab_size_of,
)

WORK_DIR = ".work"
TOKENIZER_FILE = "tokenizer.json"
BATCH_CHARS = 1 << 18  # characters per worker call: amortises the call, keeps every worker busy on small inputs
BATCH_DOCS = 1024


def prepare(
    input: str | list[str] | None = None,
    output: str = "data/prepared",
    seq_len: int = 2048,
    tokenizer: str | None = None,
    train_tokenizer: int | None = None,
    seed: int = 1234,
    workers: int | None = None,
    val_fraction: float = 0.01,
    max_bytes: int | None = None,
    text_field: str = "text",
    dtype: Literal["uint16", "uint32"] | None = None,
    format: Literal["npy", "litdata"] = "npy",
    shard_tokens: int = 1 << 28,
    eos_token: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> DataManifest:
    """Tokenize, globally shuffle and shard text into fixed-length training instances.

    Args:
        input: text files, folders, JSONL / parquet files or ``datasets`` folders saved to disk; none selects the
            embedded corpus (this Python's standard-library sources).
        output: the dataset folder (created).
        seq_len: tokens per instance (the context size).
        tokenizer: a Hugging Face ``tokenizer.json`` or a folder holding one.
        train_tokenizer: instead, train a byte-level BPE of this vocabulary size on the input (saved beside data).
        seed: seed of the global permutation.
        workers: tokenizer processes; 0 encodes in this process; ``None`` uses up to 8 cores. Workers are
            spawned (safe next to torch's threads), and a spawned child re-imports the calling script's top
            level: keep heavy imports of a script that calls ``prepare`` under ``if __name__ == "__main__"``.
        val_fraction: share of instances held out for validation.
        max_bytes: read at most this many bytes of text (in input order), e.g. for demos and tests.
        text_field: JSON key / column with the document text.
        dtype: token dtype; ``None`` picks ``uint16`` when the vocabulary fits, else ``uint32``.
        format: ``"npy"`` memory-mappable shards, or ``"litdata"`` chunks for ``litdata.StreamingDataset``.
        shard_tokens: target tokens per shard file (rounded down to whole instances).
        eos_token: the end-of-document token of ``tokenizer`` when it cannot be found automatically.
        overwrite: replace a dataset of a different plan in ``output`` instead of refusing.
        progress: show a progress bar on stderr.

    Returns:
        The verified manifest of the dataset.

    Raises:
        ValueError: inconsistent arguments, empty inputs, a dtype too small for the vocabulary, a ``seq_len``
            larger than the data, or an ``output`` folder holding another dataset.
    """
    _check_arguments(tokenizer, train_tokenizer, seq_len, val_fraction, format)
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    out = Path(output)  # created only once the inputs and the tokenizer are known to be usable
    work = out / WORK_DIR
    clock = _Clock()

    # 1. plan: units, checksums, the plan record; a finished dataset of the same plan is returned as it is
    inputs = [input] if isinstance(input, str) else list(input or [])
    units = _discover_inputs(inputs, text_field, max_bytes)
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    plan = {
        "inputs": [{"name": u.name, "kind": u.kind, "split": u.split, "files": u.files} for u in units],
        "seq_len": seq_len,
        "seed": seed,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "text_field": text_field,
        "dtype": dtype,
        "storage": format,
        "shard_tokens": shard_tokens,
        "tokenizer": str(tokenizer) if given is not None else f"trained byte-level BPE, vocab {train_tokenizer}",
        "tokenizer_hash": tokenizer_hash(given) if given is not None else None,
        "eos_token": eos_token,
    }
    done, resuming = _check_existing(out, plan, overwrite)
    if done is not None:
        return done
    work.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(out)
    atomic_write_json(work / "plan.json", plan)
    tok = _resolve_tokenizer(out, units, given, resuming, train_tokenizer, max_bytes)
    vocab_size = vocab_size_of(tok)
    token_dtype = choose_dtype(vocab_size, dtype, f"tokenizer {plan['tokenizer']}")
    eos_id = find_eos_id(tok, tokenizer, eos_token)
    clock.lap("plan")

    # 2. tokenize
    stats = _tokenize_units(units, work, tok, eos_id, token_dtype, workers, max_bytes, progress)
    _check_stats(units, stats, seq_len, max_bytes)
    per_unit = [s["tokens"] // seq_len for s in stats]
    clock.lap("tokenize")

    # 3. shuffle, 4. shard
    split_ids = _shuffle_and_split(sum(per_unit), seq_len, val_fraction, seed)
    reader = InstanceReader(work, per_unit, seq_len, token_dtype)
    splits = _write_shards(out, split_ids, reader, format, seq_len, shard_tokens)

    # 5. manifest, written last
    content: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "storage": format,
        "seq_len": seq_len,
        "dtype": token_dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": {"file": TOKENIZER_FILE, "hash": tokenizer_hash(tok), "source": plan["tokenizer"]},
        "seed": seed,
        "val_fraction": val_fraction,
        "num_documents": sum(s["documents"] for s in stats),
        "num_tokens": sum(s["tokens"] for s in stats),
        "num_instances": sum(per_unit),
        "num_dropped_tokens": sum(s["tokens"] - n * seq_len for s, n in zip(stats, per_unit)),
        "inputs": [
            {"name": u.name, "documents": s["documents"], "tokens": s["tokens"], "instances": n}
            for u, s, n in zip(units, stats, per_unit)
        ],
        "splits": splits,
        "plan": plan,
    }
    content["fingerprint"] = fingerprint_of(content)
    atomic_write_json(out / MANIFEST_NAME, content)
    shutil.rmtree(work, ignore_errors=True)
    clock.lap("shuffle_and_shard")
    manifest = DataManifest.load(out)
    for split in manifest.splits if manifest.storage == "npy" else []:
        for shard in manifest.shards(split):  # hashed while written: a run's start-up never re-reads them
            manifest.stamp(shard)
    manifest.timings = clock.laps
    return manifest


def _check_arguments(tokenizer: Any, train_tokenizer: Any, seq_len: int, val_fraction: float, format: str) -> None:
    if (tokenizer is None) == (train_tokenizer is None):
        raise ValueError("give exactly one of tokenizer (a tokenizer.json or folder) and train_tokenizer (vocab size)")
    if seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must be positive")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction ({val_fraction}) must be in [0, 1)")
    if format not in ("npy", "litdata"):
        raise ValueError(f"format {format!r} must be 'npy' or 'litdata'")


def _discover_inputs(inputs: list[str], text_field: str, max_bytes: int | None) -> list:
    """Step 1a: the units of work with the checksums of their files; an input of nothing is an error."""
    units = sources.discover_units(inputs, text_field=text_field, max_bytes=max_bytes)
    sources.checksum_units(units)
    for unit in units:  # empty files inside a folder are skipped (no document); an input of nothing is an error
        if unit.kind != "hf_disk" and sum(f["bytes"] for f in unit.files) == 0:
            what = f"input file {unit.files[0]['path']!r}" if len(unit.files) == 1 else f"input {unit.name!r}"
            raise ValueError(f"{what} is empty (0 bytes)")
    return units


def _resolve_tokenizer(out: Path, units: list, given: Any, resuming: bool, vocab: int | None, max_bytes: int | None):
    """Step 1b: the given tokenizer, the one an interrupted run of this plan trained, or a newly trained BPE;
    saved beside the data either way."""
    if given is not None:
        tok = given
    elif resuming and (out / TOKENIZER_FILE).is_file():
        tok = load_tokenizer(out / TOKENIZER_FILE)  # trained by the interrupted run of this same plan
    else:
        budget = sources.budget_for(units, max_bytes)
        tok = train_bpe((doc for unit in units for doc in sources.iter_documents(unit, budget)), vocab)
    atomic_write_bytes(out / TOKENIZER_FILE, tok.to_str(pretty=True).encode())
    return tok


def _shuffle_and_split(total: int, seq_len: int, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Step 3: one permutation of all instances from ``seed``; its first ``round(N * val_fraction)`` entries (at
    least one when asked for and possible) are the validation split."""
    n_val = round(total * val_fraction)
    if val_fraction > 0 and n_val == 0 and total >= 2:
        n_val = 1
    if total - n_val < 1:
        raise ValueError(
            f"{total} instances of seq_len {seq_len} leave none for training after val_fraction {val_fraction}"
        )
    order = np.random.default_rng(seed).permutation(total)
    return {"train": order[n_val:], "val": order[:n_val]}


def _write_shards(
    out: Path, split_ids: dict[str, np.ndarray], reader: InstanceReader, format: str, seq_len: int, shard_tokens: int
) -> dict[str, Any]:
    """Step 4: the permuted instances of each split into ``.npy`` shards or litdata chunks."""
    if format == "npy":
        per_shard = max(1, shard_tokens // seq_len)
        return {name: write_npy_split(out, name, ids, reader, per_shard) for name, ids in split_ids.items()}
    from mula_lightning.data.litdata_io import write_litdata_split

    return {name: write_litdata_split(out, name, ids, reader, shard_tokens) for name, ids in split_ids.items()}


class _Clock:
    """Seconds spent per step of this call (``DataManifest.timings``; never written to disk, output stays
    byte-identical)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


# ------------------------------------------------------------------------------------------- plan helpers
def _check_existing(out: Path, plan: dict, overwrite: bool) -> tuple[DataManifest | None, bool]:
    """Decide what to do with what ``out`` already holds.

    A finished dataset of another plan is never replaced silently; the unfinished work of another plan (a run that
    failed or was killed, then the command was corrected) is only intermediate state and is discarded.

    Returns:
        (the finished dataset of this very plan or None, whether an interrupted run of this plan can be resumed).

    Raises:
        ValueError: ``out`` holds a finished dataset of another plan and ``overwrite`` is off.
    """
    if (out / MANIFEST_NAME).is_file():
        existing = json.loads((out / MANIFEST_NAME).read_text()).get("plan")
        if existing == plan:
            shutil.rmtree(out / WORK_DIR, ignore_errors=True)  # killed after the manifest, before the cleanup
            return DataManifest.load(out), False
        if not overwrite:
            changed = sorted(k for k in set(plan) | set(existing or {}) if plan.get(k) != (existing or {}).get(k))
            raise ValueError(
                f"{out} holds a dataset prepared with other settings (differs in: {', '.join(changed)}); "
                "choose another output folder or pass overwrite=True (--overwrite)"
            )
    elif (out / WORK_DIR / "plan.json").is_file():
        if json.loads((out / WORK_DIR / "plan.json").read_text()) == plan:
            return None, True
        print(f"prepare: discarding the unfinished run of other settings in {out / WORK_DIR}", file=sys.stderr)
    else:
        return None, False
    for p in out.iterdir():
        if p.name in (MANIFEST_NAME, TOKENIZER_FILE, WORK_DIR, "litdata") or p.name.startswith(("train-", "val-")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return None, False


def _remove_temporaries(out: Path) -> None:
    """Delete ``*.tmp-<pid>`` leftovers of a killed run (files and litdata folders)."""
    for folder in (out, out / WORK_DIR, out / "litdata"):
        if folder.is_dir():
            for p in folder.iterdir():
                if ".tmp-" in p.name:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()


# ---------------------------------------------------------------------------------------------- tokenize
class _Done:
    """A pseudo-result marking the end of a unit, queued in order behind the unit's last batch."""

    def __init__(self, unit_index: int, budget_used: int) -> None:
        self.value = (unit_index, budget_used, None)

    def get(self) -> tuple[int, int, None]:
        return self.value


def _batches(units, pending: list[int], budget):
    """Yield ``(task, characters)`` for the pending units: ``(unit, texts)`` batches, then a :class:`_Done`."""
    for i in pending:
        before = budget.left
        texts: list[str] = []
        chars = 0
        for doc in sources.iter_documents(units[i], budget):
            texts.append(doc)
            chars += len(doc)
            if chars >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                yield (i, texts), chars
                texts, chars = [], 0
        if texts:
            yield (i, texts), chars
        yield _Done(i, 0 if before is None else before - budget.left), 0


def _tokenize_units(units, work: Path, tok, eos_id: int, dtype: np.dtype, workers: int, max_bytes, progress: bool):
    """Encode every unit not already done into ``.work/unit-NNNNN.bin``; returns per-unit stats."""
    stats: dict[int, dict] = {}
    for i in range(len(units)):
        meta = work / f"unit-{i:05d}.json"
        if meta.is_file():
            s = json.loads(meta.read_text())
            if (work / f"unit-{i:05d}.bin").stat().st_size == s["tokens"] * dtype.itemsize:
                stats[i] = s
    pending = [i for i in range(len(units)) if i not in stats]
    budget = sources.budget_for(units, max_bytes)
    for i in sorted(stats):  # the byte budget is shared in input order: replay what finished units used
        if budget.left is not None:
            budget.left -= stats[i]["budget_bytes"]
    if stats:
        print(f"prepare: resuming, {len(stats)}/{len(units)} input units already tokenized", file=sys.stderr)
    if not pending:
        return [stats[i] for i in range(len(units))]

    total_bytes = sum(f["bytes"] for i in pending for f in units[i].files)
    bar = _progress_bar(min(total_bytes, max_bytes or total_bytes), progress)
    writers: dict[int, Any] = {}
    counts = {i: [0, 0] for i in pending}  # documents, tokens

    def handle(result) -> None:
        i, n_docs, ids = result
        if ids is None:  # a _Done: n_docs holds the budget bytes the unit used; publish tokens, then the sidecar
            f = writers.pop(i, None) or open(work / f"unit-{i:05d}.bin.tmp-{os.getpid()}", "wb")  # noqa: SIM115
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(f.name, work / f"unit-{i:05d}.bin")
            stats[i] = {"documents": counts[i][0], "tokens": counts[i][1], "budget_bytes": n_docs}
            atomic_write_json(work / f"unit-{i:05d}.json", stats[i])
            return
        if i not in writers:
            writers[i] = open(work / f"unit-{i:05d}.bin.tmp-{os.getpid()}", "wb")  # noqa: SIM115 (open across batches)
        writers[i].write(ids.tobytes())
        counts[i][0] += n_docs
        counts[i][1] += len(ids)

    tasks = _batches(units, pending, budget)
    pool = _start_pool(workers, tok, eos_id, dtype) if workers > 0 else None
    try:
        if pool is None:
            init_worker(tok.to_str(), eos_id, dtype.name)
        in_flight: deque = deque()
        for task, chars in tasks:
            if isinstance(task, _Done):
                in_flight.append(task)
            elif pool is None:
                handle(encode_documents(task))
            else:
                in_flight.append(pool.apply_async(encode_documents, (task,)))
            bar.update(chars)
            while in_flight and (len(in_flight) > 2 * workers + 2 or isinstance(in_flight[0], _Done)):
                handle(in_flight.popleft().get())
        while in_flight:
            handle(in_flight.popleft().get())
    finally:
        bar.close()
        for f in writers.values():  # only after an error: the unit's temporary is removed by the next run
            f.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return [stats[i] for i in range(len(units))]


def _start_pool(workers: int, tok, eos_id: int, dtype: np.dtype):
    """Spawned workers (no forked torch / thread state), each single-threaded in Rust (``RAYON_NUM_THREADS=1``)."""
    previous = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        return mp.get_context("spawn").Pool(
            workers, initializer=init_worker, initargs=(tok.to_str(), eos_id, dtype.name)
        )
    finally:
        if previous is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = previous


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not enabled, file=sys.stderr)


def _check_stats(units, stats: list[dict], seq_len: int, max_bytes: int | None) -> None:
    """Clear errors for inputs without documents and for a context longer than all the data."""
    for unit, s in zip(units, stats):
        if s["documents"] == 0 and max_bytes is None:  # with max_bytes, late inputs may be cut off entirely
            raise ValueError(f"input {unit.name!r} holds no documents")
    if all(s["tokens"] < seq_len for s in stats):
        sizes = ", ".join(f"{u.name}: {s['tokens']} tokens" for u, s in zip(units, stats))
        raise ValueError(f"seq_len ({seq_len}) is larger than every input: no instance can be cut ({sizes})")
