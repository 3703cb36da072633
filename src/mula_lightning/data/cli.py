"""``mula data prepare`` / ``mula data verify``: the command-line face of :func:`mula_lightning.data.prepare`.

Examples::

    mula data prepare --output data/stdlib --seq-len 256 --train-tokenizer 4096 --max-bytes 20000000
    mula data prepare --input corpus/*.jsonl --output data/web --seq-len 2048 --tokenizer allenai/OLMoE/ --workers 16

Every option mirrors an argument of ``prepare`` (dashes for underscores); ``--config FILE`` reads them from YAML.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jsonargparse import ActionConfigFile, ArgumentParser

#: (flag, type, default, help) of every ``prepare`` argument, in the order ``--help`` shows them.
_OPTIONS = [
    (
        "--input",
        str,
        None,
        "text files, folders, JSONL / parquet files, `datasets` folders saved to "
        "disk (default: the embedded corpus, this Python's standard-library sources)",
    ),
    ("--output", str, "data/prepared", "dataset folder to write"),
    ("--seq-len", int, 2048, "tokens per training instance (context size)"),
    ("--tokenizer", str | None, None, "a Hugging Face tokenizer.json or a folder holding one"),
    ("--train-tokenizer", int | None, None, "train a byte-level BPE with this vocabulary size instead"),
    ("--seed", int, 1234, "seed of the global shuffle"),
    ("--workers", int | None, None, "tokenizer processes (0: in this process; default: up to 8 cores)"),
    ("--val-fraction", float, 0.01, "share of instances held out for validation"),
    ("--max-bytes", int | None, None, "read at most this many bytes of text (demos, tests)"),
    ("--text-field", str, "text", "JSON key / column holding the document text"),
    ("--dtype", str | None, None, "uint16 or uint32 (default: uint16 when the vocabulary fits)"),
    ("--format", str, "npy", "npy (memory-mapped shards) or litdata (StreamingDataset chunks)"),
    ("--shard-tokens", int, 1 << 28, "target tokens per shard file"),
    ("--eos-token", str | None, None, "the tokenizer's end-of-document token, if not found automatically"),
    ("--overwrite", bool, False, "replace a dataset of other settings in --output"),
    ("--progress", bool, True, "show a progress bar"),
]


def build_parser() -> ArgumentParser:
    """``mula data`` with its ``prepare`` and ``verify`` subcommands."""
    parser = ArgumentParser(prog="mula data", description="Prepare token shards for pretraining.")
    prepare_parser = ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    prepare_parser.add_argument("--config", action=ActionConfigFile, help="read the options from a YAML file")
    for flag, type_, default, help_ in _OPTIONS:
        kwargs = {"nargs": "+"} if flag == "--input" else {}
        prepare_parser.add_argument(flag, type=type_, default=default, help=help_, **kwargs)
    verify_parser = ArgumentParser(description="Check every shard of a prepared dataset: SHA-256 and token ids.")
    verify_parser.add_argument("data_dir", type=str, help="the dataset folder (holds manifest.json)")
    subcommands = parser.add_subcommands()
    subcommands.add_subcommand("prepare", prepare_parser, help="tokenize -> global shuffle -> memory-mapped shards")
    subcommands.add_subcommand("verify", verify_parser, help="re-hash every shard and check every token id")
    return parser


def verify(data_dir: str) -> str:
    """Re-hash every shard (ignoring verification stamps) and check every token id against the vocabulary.

    Returns:
        A one-line summary.

    Raises:
        FileNotFoundError, ValueError: naming the first shard that is missing, truncated, corrupt or holds an id
            outside the vocabulary.
    """
    from mula_lightning.data.dataset import TokenShardDataset
    from mula_lightning.data.manifest import DataManifest

    manifest = DataManifest.load(data_dir, checksums=True)
    tokens = 0
    for split in manifest.splits if manifest.storage == "npy" else []:
        dataset = TokenShardDataset(data_dir, split, manifest, verify_checksums=False)  # just hashed above
        step = max(1, (1 << 24) // max(1, manifest.seq_len))
        for start in range(0, len(dataset), step):
            tokens += dataset.read(start, min(len(dataset), start + step)).size
    return f"{manifest.root}: every shard matches its SHA-256; {tokens} token ids checked against {manifest.vocab_size}"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (without ``mula data``), run ``prepare`` and print a one-paragraph summary."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.subcommand == "verify":
        try:
            print(verify(args.verify.data_dir))
        except (ValueError, FileNotFoundError, OSError) as e:
            print(f"mula data verify: error: {e}", file=sys.stderr)
            return 1
        return 0
    options = {k: v for k, v in vars(args.prepare).items() if k not in ("config", "__path__")}
    from mula_lightning.data.prepare import prepare

    try:
        manifest = prepare(**options)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        print(f"mula data prepare: error: {e}", file=sys.stderr)
        return 1
    c = manifest.content
    print(
        f"prepared {manifest.root}: {c['num_documents']} documents, {c['num_tokens']} tokens -> "
        f"{manifest.num_instances('train')} train + {manifest.num_instances('val')} val instances of "
        f"{manifest.seq_len} tokens ({manifest.dtype.name}, vocab {manifest.vocab_size}, {manifest.storage})"
    )
    return 0
