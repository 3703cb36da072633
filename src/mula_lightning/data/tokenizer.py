"""Tokenizers for ``prepare``: load a Hugging Face ``tokenizer.json``, train a byte-level BPE, encode in workers.

Encoding is the throughput bottleneck of preparing data. Each worker process holds one fast (Rust) tokenizer and
encodes a *batch* of documents per call with ``encode_batch_fast`` (no offsets are computed), then joins the ids
with EOS after each document into one flat array of the output dtype, so one pickled numpy array, not a list of
Python ints per document, travels back to the main process. Workers run with ``RAYON_NUM_THREADS=1``: W workers
use W cores, and the 1-vs-2-worker benchmark measures what it says.

Training sets ``RAYON_NUM_THREADS=1`` too (the issue's determinism rule): the BPE trainer's parallel word
counting can break ties between equally frequent merges differently run to run, and an interrupted ``prepare``
must re-run to byte-identical output.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

#: The EOS token of tokenizers trained by ``--train-tokenizer``.
TRAINED_EOS = "<|endoftext|>"
#: EOS spellings looked for in a given tokenizer when its folder does not name one.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
UINT16_LIMIT = 1 << 16


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a folder holding one.

    Raises:
        FileNotFoundError: neither the file nor ``<folder>/tokenizer.json`` exists.
        ValueError: the file is not a valid tokenizer (message names it).
    """
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r}: no tokenizer.json found (give the file or its folder)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"tokenizer file {str(file)!r} could not be loaded: {e}") from e


def find_eos_id(tokenizer, tokenizer_path: str | os.PathLike | None = None, eos_token: str | None = None) -> int:
    """The id of the end-of-document token.

    Looks, in order, at ``eos_token`` when given, the ``eos_token`` of ``tokenizer_config.json`` beside the
    tokenizer, then the usual spellings in :data:`EOS_CANDIDATES`.

    Raises:
        ValueError: no EOS token can be found (message lists what was tried).
    """
    tried: list[str] = []
    if eos_token is None and tokenizer_path is not None:
        p = Path(tokenizer_path)
        config = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text()).get("eos_token")
            eos_token = value.get("content") if isinstance(value, dict) else value
    for token in ([eos_token] if eos_token else []) + list(EOS_CANDIDATES):
        tried.append(token)
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"tokenizer {tokenizer_path or ''} has no EOS token (tried {tried}); pass eos_token=")


def vocab_size_of(tokenizer) -> int:
    """Ids the model must embed: one more than the largest id, added tokens included."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON: two tokenizers with one hash encode text identically."""
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def choose_dtype(vocab_size: int, dtype: str | None, tokenizer_name: str = "tokenizer") -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``; an explicit ``dtype`` is checked, never silently widened.

    Raises:
        ValueError: ``dtype`` cannot hold ``vocab_size`` ids, or is not ``uint16`` / ``uint32``.
    """
    if dtype is None:
        return np.dtype(np.uint16 if vocab_size <= UINT16_LIMIT else np.uint32)
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"dtype {dtype!r} must be 'uint16' or 'uint32'")
    if dtype == "uint16" and vocab_size > UINT16_LIMIT:
        raise ValueError(
            f"dtype uint16 holds ids below {UINT16_LIMIT}, but {tokenizer_name} has a vocabulary of {vocab_size} "
            "ids; use dtype uint32 (or leave dtype unset)"
        )
    return np.dtype(dtype)


#: 256 byte symbols + the end-of-document token: the smallest vocabulary :func:`train_bpe` can train
MIN_TRAINED_VOCAB = 257


def train_bpe(documents: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization) with :data:`TRAINED_EOS` as id 0.

    ``RAYON_NUM_THREADS=1`` is set for this process first so that training is deterministic; it only takes
    effect if the process has not used a parallel ``tokenizers`` call yet (``prepare`` trains before encoding,
    and its encoders are separate processes).

    Raises:
        ValueError: ``vocab_size`` is smaller than the 256 byte symbols plus EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_TRAINED_VOCAB:
        raise ValueError(
            f"train_tokenizer vocab size ({vocab_size}) is below the smallest byte-level BPE: {MIN_TRAINED_VOCAB} = "
            f"256 byte symbols (so that any text encodes) + 1 end-of-document token {TRAINED_EOS!r}; train "
            f"{MIN_TRAINED_VOCAB} or more, and give the model at least as many embedding rows (a model smaller than "
            f"{MIN_TRAINED_VOCAB} rows needs a tokenizer of its own: --tokenizer PATH)"
        )
    os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


# ---------------------------------------------------------------------------------------------- worker side
_WORKER: dict = {}


def init_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    """Pool initializer: build this process's tokenizer once (the JSON string pickles cheaply)."""
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), eos_id=eos_id, dtype=np.dtype(dtype))


def encode_documents(task: tuple[int, list[str]]) -> tuple[int, int, np.ndarray]:
    """Encode one batch of documents: returns (unit index, document count, ids with EOS after each document)."""
    unit_index, texts = task
    tokenizer, eos_id, dtype = _WORKER["tokenizer"], _WORKER["eos_id"], _WORKER["dtype"]
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    start = 0
    for enc, end in zip(encodings, ends):
        out[start : end - 1] = enc.ids
        start = int(end)
    out[ends - 1] = eos_id
    return unit_index, len(texts), out
