"""Input discovery: which files are read, in which order, and how each yields documents.

The Aurora paper tokenizes every *data file* separately: its documents are tokenized, joined with EOS and cut
into context-size instances, and only the tail shorter than one instance is lost per data file. Here that unit is
a :class:`Unit`:

- a JSONL file (one document per line, ``text_field`` holds the text), a parquet file (``text_field`` column) or
  a ``datasets`` dataset saved with ``save_to_disk`` (each split one unit) is one unit;
- plain-text files (any other extension) are one document each; the text files given directly, or found in one
  folder, form one unit in sorted path order, so a folder of many small files loses one tail, not one per file;
- with no input at all, the embedded corpus: this interpreter's standard-library ``.py`` sources (not
  ``site-packages``), sorted, decoded with ``errors="replace"``; real text that every machine has.

Empty files and empty texts are no documents (the standard library alone has dozens of empty ``__init__.py``);
an input with no bytes at all is an error.

``max_bytes`` caps the text read, so demos and tests run on a small, deterministic prefix: plain-text files are
capped first, by raw file size in input order (the last file is cut), and JSONL / parquet / dataset documents
share what is left, by UTF-8 size in input order (the last document is cut).

Every unit lists its files with their size and SHA-256 so the manifest records exactly what was read, and a
resumed run notices inputs that changed underneath it (its plan differs, so the unfinished work is discarded).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
EMBEDDED_CORPUS = "python-stdlib"


@dataclass
class Unit:
    """One data file of the paper: documents that are concatenated (EOS after each) and cut into instances.

    Args:
        kind: ``"text"`` (each path is one document), ``"jsonl"``, ``"parquet"`` or ``"hf_disk"``.
        name: how the unit is shown in messages and the manifest.
        paths: the files (for ``hf_disk``: the dataset folder and one split name in ``split``).
        text_field: JSON key / column holding the document text.
        split: the split of a ``DatasetDict`` saved to disk (``hf_disk`` only).
        byte_limit: for ``text`` units, the cap on raw bytes read from the last path (``None`` = all).
    """

    kind: str
    name: str
    paths: list[str]
    text_field: str = "text"
    split: str | None = None
    byte_limit: int | None = None
    files: list[dict] = field(default_factory=list)  # [{"path", "bytes", "sha256"}], filled by checksum_units


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else path.suffix.lower()


def stdlib_files() -> tuple[Path, list[Path]]:
    """The embedded corpus: the standard library's ``.py`` files, ``site-packages`` excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files = [p for p in files if p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _cap_text_files(paths: list[Path], budget: int | None) -> tuple[list[Path], int | None, int | None]:
    """Keep the prefix of ``paths`` whose raw sizes fit ``budget``; returns (paths, last-file limit, budget left)."""
    if budget is None:
        return paths, None, None
    kept: list[Path] = []
    for p in paths:
        if budget <= 0:
            break
        size = p.stat().st_size
        kept.append(p)
        if size > budget:
            return kept, budget, 0
        budget -= size
    return kept, None, budget


def discover_units(inputs: list[str] | None, text_field: str = "text", max_bytes: int | None = None) -> list[Unit]:
    """Resolve ``inputs`` (files and folders) into units, in a deterministic order.

    Args:
        inputs: paths given by the user; ``None`` or empty selects the embedded standard-library corpus.
        text_field: JSON key / parquet column / dataset column holding the text.
        max_bytes: cap on the bytes of text read in total; applied here to plain-text files (by file size) and
            while reading to the other kinds (by UTF-8 size of each document).

    Raises:
        FileNotFoundError: an input path does not exist.
        ValueError: an input, or all of them together, holds no readable file.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes ({max_bytes}) must be positive")
    if not inputs:
        root, files = stdlib_files()
        files, limit, _ = _cap_text_files(files, max_bytes)
        if not files:
            raise ValueError(f"the embedded corpus found no .py files under {root}")
        return [Unit("text", f"{EMBEDDED_CORPUS}:{root}", [str(p) for p in files], byte_limit=limit)]

    units: list[Unit] = []
    budget = max_bytes
    for raw in inputs:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"input {raw!r} does not exist")
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            units += _hf_disk_units(path, text_field)
            continue
        files = _list_files(path) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"input folder {raw!r} holds no files")
        texts = [p for p in files if _suffix(p) not in JSONL_SUFFIXES + PARQUET_SUFFIXES]
        for p in files:
            kind = "jsonl" if _suffix(p) in JSONL_SUFFIXES else "parquet" if _suffix(p) in PARQUET_SUFFIXES else None
            if kind:
                units.append(Unit(kind, str(p), [str(p)], text_field=text_field))
        if texts:
            texts, limit, budget = _cap_text_files(texts, budget)
            if texts:
                units.append(Unit("text", raw, [str(p) for p in texts], byte_limit=limit))
    return units


def _list_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` (recursively, hidden ones skipped), sorted by path."""
    files = [p for p in folder.rglob("*") if p.is_file() or p.is_symlink()]  # a broken link fails loudly later
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(files, key=lambda p: p.as_posix())


def _hf_disk_units(path: Path, text_field: str) -> list[Unit]:
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        return [Unit("hf_disk", f"{path}[{s}]", [str(path)], text_field=text_field, split=s) for s in sorted(splits)]
    return [Unit("hf_disk", str(path), [str(path)], text_field=text_field)]


def _hash_file(path: Path) -> dict:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise OSError(f"cannot read input file {str(path)!r}: {e.strerror or e}") from e
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def checksum_units(units: list[Unit]) -> None:
    """Fill ``unit.files`` with the size and SHA-256 of every file the unit reads (a clear error if unreadable)."""
    for unit in units:
        if unit.kind == "hf_disk":
            root = Path(unit.paths[0]) / (unit.split or "")
            files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
        else:
            files = [Path(p) for p in unit.paths]
        unit.files = [_hash_file(p) for p in files]


class _Budget:
    """Bytes of text still allowed by ``max_bytes`` across JSONL / parquet / dataset units (shared, in order)."""

    def __init__(self, max_bytes: int | None) -> None:
        self.left = max_bytes

    def take(self, text: str) -> str | None:
        if self.left is None:
            return text
        if self.left <= 0:
            return None
        data = text.encode("utf-8")
        if len(data) > self.left:
            text = data[: self.left].decode("utf-8", errors="ignore")
            self.left = 0
            return text
        self.left -= len(data)
        return text


def budget_for(units: list[Unit], max_bytes: int | None) -> _Budget:
    """The shared budget for non-text units: ``max_bytes`` minus what the capped text units already use."""
    if max_bytes is None:
        return _Budget(None)
    used = 0
    for u in units:
        if u.kind == "text":
            sizes = [os.path.getsize(p) for p in u.paths]
            used += sum(sizes[:-1]) + (u.byte_limit if u.byte_limit is not None else sizes[-1])
    return _Budget(max(max_bytes - used, 0))


def iter_documents(unit: Unit, budget: _Budget | None = None) -> Iterator[str]:
    """Yield the documents of ``unit`` in order.

    Raises:
        OSError: a file cannot be read (message names it).
        ValueError: a JSONL line is not valid JSON or lacks ``text_field`` (message names file and line).
        ImportError: parquet without ``pyarrow`` or a saved dataset without ``datasets``.
    """
    budget = budget or _Budget(None)
    if unit.kind == "text":
        for i, p in enumerate(unit.paths):
            limit = unit.byte_limit if i == len(unit.paths) - 1 else None
            try:
                with open(p, "rb") as f:
                    data = f.read() if limit is None else f.read(limit)
            except OSError as e:
                raise OSError(f"cannot read input file {p!r}: {e.strerror or e}") from e
            if data:  # an empty file is no document (the standard library has many empty __init__.py)
                yield data.decode("utf-8", errors="replace")
        return
    for text in _iter_structured(unit):
        if not text:
            continue
        taken = budget.take(text)
        if taken is None:
            return
        yield taken


def _iter_structured(unit: Unit) -> Iterator[str]:
    if unit.kind == "jsonl":
        yield from _iter_jsonl(unit.paths[0], unit.text_field)
    elif unit.kind == "parquet":
        yield from _iter_parquet(unit.paths[0], unit.text_field)
    elif unit.kind == "hf_disk":
        yield from _iter_hf_disk(unit.paths[0], unit.split, unit.text_field)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r} for {unit.name}")


def _iter_jsonl(path: str, text_field: str) -> Iterator[str]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    try:
        f = opener(path, "rt", encoding="utf-8", errors="replace")
    except OSError as e:
        raise OSError(f"cannot read input file {path!r}: {e.strerror or e}") from e
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no text field {text_field!r} (found {keys}); set text_field")
            yield str(record[text_field])


def _iter_parquet(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading parquet input {path!r} needs pyarrow: pip install pyarrow") from e
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {pf.schema_arrow.names}); set text_field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield "" if text is None else str(text)


def _iter_hf_disk(path: str, split: str | None, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"reading the saved dataset {path!r} needs the `datasets` package: pip install datasets"
        ) from e
    ds = datasets.load_from_disk(path)
    if split is not None:
        ds = ds[split]
    if text_field not in ds.column_names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {ds.column_names}); set text_field")
    for start in range(0, len(ds), 1024):
        for text in ds[start : start + 1024][text_field]:
            yield "" if text is None else str(text)
