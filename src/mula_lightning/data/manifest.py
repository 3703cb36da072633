"""The dataset manifest: what ``prepare`` wrote, checked against the shards on disk before anyone reads them.

``manifest.json`` is the last file ``prepare`` writes (atomically), so its presence means the dataset is complete.
It records the context size, dtype, vocabulary size, EOS id and tokenizer hash, the seed, the per-input file
checksums and, per split, every shard with its instance count and SHA-256. Its ``fingerprint`` (a hash of all
that) identifies the dataset: the sampler stores it with its position so a resume on other data fails loudly.

The model side uses two helpers: :meth:`DataManifest.resolve_vocab_size` (the model's ``vocab_size`` comes from
the manifest when the config leaves it unset, and a configured one must be large enough) and
:meth:`DataManifest.check_tokenizer` (a tokenizer whose hash differs from the data's is refused before training).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mula_lightning.utils.io import atomic_write

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "mula-token-shards"
MANIFEST_VERSION = 1


#: folder (inside a dataset) of the stamps of shards whose checksum was verified
VERIFIED_DIR = ".verified"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, flush it to disk, then rename it into place."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as sorted, indented JSON (byte-identical for equal content)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint_of(content: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a manifest without its ``fingerprint`` field."""
    body = {k: v for k, v in content.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def npy_header_size(path: str | os.PathLike) -> tuple[int, tuple[int, ...], np.dtype]:
    """(header bytes, shape, dtype) of a ``.npy`` file, read without touching its data."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        version = fmt.read_magic(f)
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, dtype = read_header(f)
        return f.tell(), shape, dtype


@dataclass
class DataManifest:
    """A loaded, verified ``manifest.json``.

    Args:
        root: the dataset folder.
        content: the parsed JSON.
        timings: seconds per step of the ``prepare`` call that returned this manifest (empty when loaded).
    """

    root: Path
    content: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step, set by the prepare call that wrote it
    #: shard files this object knows to match their checksums (verified here, or stamped and unchanged)
    verified: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, root: str | os.PathLike, verify: bool = True, checksums: bool = False) -> DataManifest:
        """Read ``<root>/manifest.json`` and (by default) check every shard against it.

        Args:
            root: the dataset folder written by ``prepare``.
            verify: check that every shard exists with the expected size, shape and dtype (cheap: headers only).
            checksums: also recompute every shard's SHA-256 (reads all data).

        Raises:
            FileNotFoundError: no manifest (an unfinished ``prepare`` leaves none) or a missing shard.
            ValueError: an unknown format/version, a fingerprint that does not match the content, or a shard
                that does not match the manifest (truncated, other shape or dtype, other checksum).
        """
        root = Path(root)
        path = root / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {root} is not a prepared dataset, or `mula data prepare` did not finish there"
            )
        content = json.loads(path.read_text())
        if content.get("format") != MANIFEST_FORMAT or content.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"{path}: format {content.get('format')!r} version {content.get('version')!r} is not "
                f"{MANIFEST_FORMAT!r} version {MANIFEST_VERSION}"
            )
        if fingerprint_of(content) != content.get("fingerprint"):
            raise ValueError(f"{path}: the fingerprint does not match the content (the manifest was edited)")
        manifest = cls(root, content)
        if verify:
            manifest.verify(checksums=checksums)
        return manifest

    def verify(self, checksums: bool = False) -> None:
        """Check every shard of every split against the manifest (see :meth:`load`)."""
        if self.storage != "npy":
            return
        for split in self.splits:
            for shard in self.shards(split):
                self._verify_shard(shard, checksums)

    def _verify_shard(self, shard: dict[str, Any], checksums: bool) -> None:
        path = self.root / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in {self.root / MANIFEST_NAME} is missing")
        expected_shape = (shard["num_instances"], self.seq_len)
        data_bytes = shard["num_instances"] * self.seq_len * self.dtype.itemsize
        size = path.stat().st_size
        try:
            header, shape, dtype = npy_header_size(path)
        except ValueError as e:
            raise ValueError(f"shard {path} is not a valid .npy file ({e}); re-run `mula data prepare`") from e
        if size != header + data_bytes:
            what = "truncated" if size < header + data_bytes else "longer than expected"
            raise ValueError(
                f"shard {path} is {what}: {size} bytes on disk, the manifest expects {header + data_bytes} "
                f"({shard['num_instances']} instances x {self.seq_len} tokens x {self.dtype.itemsize} bytes "
                f"+ {header} header bytes)"
            )
        if tuple(shape) != expected_shape or np.dtype(dtype) != self.dtype:
            raise ValueError(
                f"shard {path} holds {tuple(shape)} {np.dtype(dtype)}, the manifest says {expected_shape} {self.dtype}"
            )
        if checksums:
            if sha256_file(path) != shard["sha256"]:
                raise ValueError(f"shard {path}: SHA-256 differs from the manifest (the file is corrupt)")
            self.stamp(shard)

    def _stamp_key(self, shard: dict[str, Any]) -> dict[str, Any]:
        stat = (self.root / shard["file"]).stat()
        return {"sha256": shard["sha256"], "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def has_stamp(self, shard: dict[str, Any]) -> bool:
        """Whether this shard was verified (by ``prepare``, ``mula data verify`` or a run's start-up) and has not
        changed since: its stamp ``.verified/<file>.json`` matches the manifest's checksum, the size and the
        modification time (one ``stat`` and one small read)."""
        try:
            stamp = self.root / VERIFIED_DIR / f"{shard['file']}.json"
            return json.loads(stamp.read_text()) == self._stamp_key(shard)
        except (OSError, ValueError):
            return False

    def stamp(self, shard: dict[str, Any]) -> None:
        """Record that this shard matches its checksum (a read-only dataset folder keeps no stamp: the record then
        lives in this object only, see :attr:`verified`)."""
        self.verified.add(shard["file"])
        try:
            (self.root / VERIFIED_DIR).mkdir(exist_ok=True)
            atomic_write_json(self.root / VERIFIED_DIR / f"{shard['file']}.json", self._stamp_key(shard))
        except OSError:
            pass

    def verify_checksum_once(self, shard: dict[str, Any]) -> None:
        """Check one shard's SHA-256 against the manifest, unless it was already verified unchanged.

        Verified means: in :attr:`verified` (this object checked it, or a run's start-up did with
        :meth:`verify_checksums_once`; the set travels with the object into DataLoader workers), or a stamp
        ``.verified/<file>.json`` (checksum, size, modification time) that still matches. A file changed in place
        (same size, new content) has a new modification time and is hashed again.

        Raises:
            ValueError: the shard's SHA-256 differs from the manifest's (the file is corrupt).
        """
        if shard["file"] in self.verified or self.has_stamp(shard):
            self.verified.add(shard["file"])
            return
        path = self.root / shard["file"]
        found = sha256_file(path)
        if found != shard["sha256"]:
            raise ValueError(
                f"shard {path}: SHA-256 {found[:16]}... differs from the manifest's {shard['sha256'][:16]}... (the "
                "file is corrupt or was changed after `mula data prepare`); re-run `mula data prepare`"
            )
        self.stamp(shard)

    def verify_checksums_once(self) -> None:
        """Verify every shard that is not yet verified, each by one rank of the default process group (collective
        when one is initialised; one process otherwise).

        Cost per process at a run's start: one ``stat`` and one stamp read per shard (rank 0 lists the unverified
        shards and broadcasts the list); then shard ``i`` of that list is hashed by rank ``i mod world``, so over a
        whole job each unverified shard's bytes are read once for hashing, and none after ``prepare`` or
        ``mula data verify`` stamped them. A read-only folder (no stamps can be written) is verified this way at
        every start. Every rank raises the first mismatch found by any rank.
        """
        from mula_lightning.utils.dist import all_gather_object, broadcast_object, rank_world

        rank, world = rank_world()
        shards = [s for split in self.splits for s in self.shards(split)] if self.storage == "npy" else []
        pending = None
        if rank == 0:
            pending = [s["file"] for s in shards if s["file"] not in self.verified and not self.has_stamp(s)]
        pending = broadcast_object(pending)
        by_file = {s["file"]: s for s in shards}
        error = ""
        for i, name in enumerate(pending):
            if i % world != rank:
                continue
            try:
                self.verify_checksum_once(by_file[name])
            except (OSError, ValueError) as err:
                error = str(err)
                break
        errors = [e for e in all_gather_object(error) if e]
        if errors:
            raise ValueError(errors[0])
        self.verified.update(s["file"] for s in shards)

    # ---------------------------------------------------------------------------------------- accessors
    @property
    def fingerprint(self) -> str:
        return self.content["fingerprint"]

    @property
    def seq_len(self) -> int:
        return int(self.content["seq_len"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.content["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.content["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.content["eos_id"])

    @property
    def storage(self) -> str:
        return self.content["storage"]

    @property
    def splits(self) -> list[str]:
        return sorted(self.content["splits"])

    def num_instances(self, split: str) -> int:
        return int(self._split(split)["num_instances"])

    def shards(self, split: str) -> list[dict[str, Any]]:
        return list(self._split(split)["shards"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.content["splits"]:
            raise KeyError(f"dataset {self.root} has no split {split!r} (splits: {self.splits})")
        return self.content["splits"][split]

    @property
    def tokenizer_path(self) -> Path:
        """The copy of the tokenizer saved beside the data."""
        return self.root / self.content["tokenizer"]["file"]

    # ------------------------------------------------------------------------------- model-side helpers
    def resolve_vocab_size(self, configured: int | None = None, pad_to_multiple_of: int = 1) -> int:
        """The embedding size a model trained on this data should use.

        Args:
            configured: the model config's ``vocab_size``; ``None`` takes the manifest's.
            pad_to_multiple_of: round the manifest's size up (e.g. 64 or 128 for efficient matmuls).

        Raises:
            ValueError: ``configured`` is smaller than the data's vocabulary (ids would index past the table).
        """
        if configured is None:
            return -(-self.vocab_size // pad_to_multiple_of) * pad_to_multiple_of
        if configured < self.vocab_size:
            raise ValueError(
                f"model vocab_size ({configured}) is smaller than the vocabulary of the data in {self.root} "
                f"({self.vocab_size} ids, tokenizer {self.content['tokenizer']['hash']})"
            )
        return configured

    def check_tokenizer(self, tokenizer_or_path: Any) -> None:
        """Refuse a tokenizer (object, ``tokenizer.json`` or folder) that differs from the one the data used.

        Raises:
            ValueError: the hashes differ (message shows both).
        """
        from mula_lightning.data.tokenizer import load_tokenizer, tokenizer_hash

        tok = (
            load_tokenizer(tokenizer_or_path) if isinstance(tokenizer_or_path, str | os.PathLike) else tokenizer_or_path
        )
        found = tokenizer_hash(tok)
        if found != self.content["tokenizer"]["hash"]:
            raise ValueError(
                f"tokenizer mismatch: {tokenizer_or_path} hashes to {found}, but the data in {self.root} was "
                f"tokenized with {self.content['tokenizer']['hash']}"
            )
