"""``mula checkpoint convert --trust OLD NEW``: rewrite a checkpoint of the previous (pickled) format as data.

Checkpoints written before mula_lightning stopped pickling carry their metadata (the Trainer's loops, callbacks and
schedulers) as a ``pickle.dumps`` blob inside the DCP directory. Loaders now read data only
(:mod:`mula_lightning.utils.safe_load`): such a blob still loads when it holds plain values only; one that holds
tensors or objects is refused and the error names this command. Converting must import and call what the blob
names, which is exactly what a hostile file would abuse, so it happens only here, only with ``--trust``: the command
lists every global the blob names (read with ``pickletools``, nothing run), prints them, and unpickles with an
allow-list of exactly those.

Example::

    mula checkpoint convert --trust /ckpt/run1/dual/slot_a/state.ckpt /ckpt/run1-converted/state.ckpt

``OLD`` is a DCP directory (a sharded strategy's checkpoint or a DualCheckpoint slot's ``state.ckpt``). ``NEW``
gets the same tensors (full tensors, which any DP x EP layout loads again) and the metadata written as data. The
conversion runs in one process and holds the whole checkpoint in memory once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from mula_lightning.utils.safe_load import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    dumps_data,
    load_full_dcp,
    loads_data,
    pickle_globals,
    restricted_loads,
)

METADATA_KEY = "metadata"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mula checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", type=str, choices=["convert"], help="what to do")
    parser.add_argument("old", type=str, help="DCP directory written by an earlier mula_lightning")
    parser.add_argument("new", type=str, help="where the converted checkpoint goes (must not exist)")
    parser.add_argument("--trust", action="store_true", help="unpickle OLD's metadata (runs what it names)")
    return parser


def convert(old: str | Path, new: str | Path, trust: bool = False) -> dict[str, Any]:
    """Convert ``old`` into ``new`` (see the module docstring); returns the metadata written.

    Raises:
        PermissionError: without ``trust`` when the metadata needs the standard unpickler.
        FileExistsError: when ``new`` exists.
        UnsafeCheckpointError: when the trusted metadata holds objects that are not data even after conversion.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    old, new = Path(old), Path(new)
    if new.exists():
        raise FileExistsError(f"{new}: exists; choose a new directory")
    items = SafeFileSystemReader(str(old)).read_metadata().state_dict_metadata
    others = sorted(k for k, md in items.items() if isinstance(md, BytesStorageMetadata) and k != METADATA_KEY)
    if others:
        raise ValueError(f"{old}: non-tensor items {others} besides {METADATA_KEY!r}: not a mula_lightning checkpoint")
    tensors, raw = load_full_dcp(old)
    metadata: Any = {}
    if raw:
        try:
            metadata = loads_data(raw, old)
        except UnsafeCheckpointError as err:
            if not trust:
                raise PermissionError(f"{err.args[0].split(';')[0]}; pass --trust to unpickle it") from None
            named = pickle_globals(raw)
            print(f"mula checkpoint: trusting {old}: its metadata imports and calls {named}", flush=True)
            extra = {tuple(g.rsplit(".", 1)) for g in named}
            metadata = restricted_loads(raw, old, extra=extra)
    data = dumps_data(metadata)
    loads_data(data, new)  # refuse now, not at the next load, what is still not data (a custom object)
    new.mkdir(parents=True)
    dcp.save({**tensors, METADATA_KEY: data}, checkpoint_id=str(new), no_dist=True)
    return metadata


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mula checkpoint``."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        metadata = convert(args.old, args.new, args.trust)
    except (UnsafeCheckpointError, PermissionError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"mula checkpoint: {err}", file=sys.stderr)
        return 1
    keys = sorted(metadata) if isinstance(metadata, dict) else type(metadata).__name__
    print(f"mula checkpoint: {args.old} -> {args.new} (metadata entries {keys}, written as data)")
    return 0
