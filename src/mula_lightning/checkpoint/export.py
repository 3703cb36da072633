"""``mula export CKPT --to hf DIR``: any of our checkpoints to a transformers directory, for evaluation tools.

Example::

    mula export /ckpt/run1/dual --to hf /eval/run1-hf                     # newest complete dual slot
    mula export /ckpt/run1/weights/step-00010000 --to hf /eval/step10k    # a model-only checkpoint
    mula export /ckpt/run1/dual/slot_a/state.ckpt --to hf /eval/a --config /ckpt/run1/weights/step-00010000

``CKPT`` may be a Mula model-only checkpoint (``config.json`` + ``model.safetensors``: the config comes with
it), a :class:`~mula_lightning.callbacks.DualCheckpoint` directory (its newest complete slot is used, checksums
verified), one slot, a DCP directory written by the ``epso`` strategy (any DP x EP layout: DCP reassembles the
full tensors; only the model's tensors are read, not the optimizer states) or a Lightning ``.ckpt`` file. Full
checkpoints written by ``mula fit`` carry the resolved model config and the training data's tokenizer under
``checkpoint["mula"]`` (:meth:`~mula_lightning.lightning_module.MulaLM.on_save_checkpoint`), so no ``--config`` is
needed; ``--config`` (a preset, a ``config.json`` or a model-only directory) overrides it, and is required for a
checkpoint of another LightningModule. The HF family (OLMoE, Mixtral, Llama) follows from the config
(:func:`mula_lightning.models.hf_convert.save_hf`).

With the tokenizer known, the export is ready for ``AutoTokenizer`` / ``generate``: ``tokenizer.json`` and
``tokenizer_config.json`` (EOS named, padding with EOS), ``eos_token_id`` / ``pad_token_id`` of the data in
``config.json`` and a ``generation_config.json`` that stops at EOS.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser

from mula_lightning.checkpoint.slots import STATE_NAME, resolve_last
from mula_lightning.utils.safe_load import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_full_dcp,
    load_torch_file,
    loads_data,
)

_ANCHOR = "model.embed_tokens.weight"
#: the checkpoint entry ``MulaLM`` writes: ``{"config": MulaConfig fields, "data": {eos_id, vocab_size,
#: tokenizer_json} or None}``
CHECKPOINT_KEY = "mula"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mula export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=str, help="model-only dir, DualCheckpoint dir, slot, DCP dir or .ckpt")
    parser.add_argument("--to", type=str, choices=["hf"], required=True, help="output format")
    parser.add_argument("out", type=str, help="output directory")
    parser.add_argument("--config", type=str, default=None, help="preset name, config.json or model-only dir")
    return parser


def _config_from(value: Any) -> Any:
    from mula_lightning.models import MulaConfig
    from mula_lightning.models.checkpoint_io import load_config

    if isinstance(value, MulaConfig):
        return value
    if isinstance(value, dict):
        return MulaConfig(**value)
    path = Path(str(value))
    if path.is_dir():
        return load_config(path)
    if path.is_file():
        values = json.loads(path.read_text())
        if "model_type" in values:
            raise ValueError(f"{path}: a transformers config; --config needs a Mula config.json or a preset name")
        return MulaConfig(**values)
    return MulaConfig.from_name(str(value))


def full_checkpoint_path(path: Path) -> Path:
    """A DualCheckpoint directory or slot -> its ``state.ckpt``; anything else unchanged."""
    if (path / "slot_a").is_dir() or (path / "slot_b").is_dir():
        slot = resolve_last(path)
        if slot is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint slot")
        return slot / STATE_NAME
    if (path / STATE_NAME).exists():
        return path / STATE_NAME
    return path


def stored_entry(path: str | Path) -> dict[str, Any] | None:
    """The ``checkpoint["mula"]`` entry (config and data info) of a full checkpoint, or None; a DCP directory's
    tensors are not read, a ``.ckpt`` file is memory-mapped."""
    path = full_checkpoint_path(Path(path))
    if path.is_file():
        extra = load_torch_file(path, mmap=True)
    elif (path / ".metadata").is_file():
        _, raw = load_full_dcp(path, skip=("",))  # every key starts with "": only the metadata item is read
        extra = loads_data(raw, path) if raw is not None else {}
    else:
        raise FileNotFoundError(f"{path}: not a checkpoint (no .metadata or .ckpt file)")
    value = extra.get(CHECKPOINT_KEY) if isinstance(extra, dict) else None
    return value if isinstance(value, dict) else None


def _read_full(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat tensors, extra entries) of a DCP directory (model tensors only) or a Lightning ``.ckpt`` file.

    Data only: the ``.ckpt`` file with ``weights_only=True``, the DCP directory with the safe reader and planner of
    :mod:`mula_lightning.utils.safe_load` (anything else is refused with :class:`UnsafeCheckpointError`).
    """
    if path.is_file():
        ckpt = load_torch_file(path)
        if not isinstance(ckpt, dict):
            raise ValueError(f"{path}: not a checkpoint (a torch file holding {type(ckpt).__name__}, not a dict)")
        state = ckpt.get("state_dict", ckpt)
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, ckpt
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no model-only files, slots, .metadata or .ckpt file)")
    tensors, raw = load_full_dcp(path, skip=("optimizer",))
    return tensors, loads_data(raw, path) if raw is not None else {}


def _strip_prefix(flat: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    prefix = model_prefix(flat, path)
    return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}


def _resolve_config(path: Path, extra: dict[str, Any], config: Any) -> Any:
    """The model config: ``config`` when given, else the one the checkpoint carries (``mula fit``'s entry, or the
    LightningModule's hyper-parameters); a clear error when there is none."""
    stored = extra.get(CHECKPOINT_KEY) if isinstance(extra.get(CHECKPOINT_KEY), dict) else {}
    if config is None:
        config = stored.get("config")
    if config is None:
        hparams = extra.get("hyper_parameters") or {}
        config = hparams.get("config") if isinstance(hparams, dict) else None
    if config is None:
        raise ValueError(
            f"{path}: the checkpoint holds no model config; pass --config (a preset name, a config.json or a "
            "model-only directory); checkpoints written by mula fit carry it"
        )
    return _config_from(config)


def _dcp_extra(path: Path) -> dict[str, Any]:
    """The metadata item of a DCP directory (no tensor is read)."""
    _, raw = load_full_dcp(path, skip=("",))  # every key starts with "": only the metadata item is read
    extra = loads_data(raw, path) if raw is not None else {}
    return extra if isinstance(extra, dict) else {}


def model_prefix(keys: Any, path: Path) -> str:
    """The key prefix of the Mula model's tensors in a full checkpoint (``"model."`` for ``MulaLM``'s), found from the
    embedding's key; ``KeyError`` naming some keys when there is none."""
    anchors = [k for k in keys if k.endswith(_ANCHOR)]
    if not anchors:
        raise KeyError(f"{path}: no Mula model tensors (no key ending in {_ANCHOR!r}) among {sorted(keys)[:6]}")
    return anchors[0][: -len(_ANCHOR)]


def export_to_hf(checkpoint: str | Path, out: str | Path, config: Any = None) -> tuple[Path, int, dict | None]:
    """Write any of our checkpoints as a transformers directory; returns ``(out, parameters, data info)``.

    A sharded (DCP) checkpoint is streamed one tensor at a time (:mod:`mula_lightning.checkpoint.hf_stream`: the
    peak is about the largest tensor, whatever the model's size); model-only directories and ``.ckpt`` files are
    read whole, as they were written by one process.
    """
    from mula_lightning.checkpoint.hf_stream import export_dcp_to_hf
    from mula_lightning.models.hf_convert import save_hf

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    from mula_lightning.models.checkpoint_io import is_model_only_dir

    if not is_model_only_dir(path):
        path = full_checkpoint_path(path)
        if path.is_dir() and (path / ".metadata").is_file():
            extra = _dcp_extra(path)
            resolved = _resolve_config(path, extra, config)
            keys = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
            out_dir, parameters = export_dcp_to_hf(path, Path(out), resolved, model_prefix(keys, path))
            stored = extra.get(CHECKPOINT_KEY) if isinstance(extra.get(CHECKPOINT_KEY), dict) else {}
            return out_dir, parameters, stored.get("data")
    model, data = read_checkpoint(checkpoint, config)
    return save_hf(model, out), sum(p.numel() for p in model.parameters()), data


def load_any(checkpoint: str | Path, config: Any = None) -> Any:
    """A ``MulaForCausalLM`` with the full weights of any of our checkpoints (see the module docstring)."""
    return read_checkpoint(checkpoint, config)[0]


def read_checkpoint(checkpoint: str | Path, config: Any = None) -> tuple[Any, dict[str, Any] | None]:
    """(model, data info) of any of our checkpoints; data info is the training data's ``eos_id``, ``vocab_size``
    and ``tokenizer_json`` when the checkpoint holds them (``mula fit`` checkpoints do), else None."""
    from mula_lightning.checkpoint.hf_stream import check_against_config
    from mula_lightning.models import MulaForCausalLM
    from mula_lightning.models.checkpoint_io import is_model_only_dir, load_data_info, load_model_only

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if is_model_only_dir(path):
        return load_model_only(path), load_data_info(path)
    path = full_checkpoint_path(path)
    flat, extra = _read_full(path)
    stored = extra.get(CHECKPOINT_KEY) if isinstance(extra.get(CHECKPOINT_KEY), dict) else {}
    config = _resolve_config(path, extra, config)
    state = _strip_prefix(flat, path)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_against_config(path, config, {k: tuple(v.shape) for k, v in state.items()})
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, stored.get("data")


def write_tokenizer(out: Path, data: dict[str, Any], vocab_size: int) -> int:
    """The training tokenizer beside an HF export, with the data's EOS as ``eos_token_id`` / ``pad_token_id``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``, and sets the special ids of
    ``config.json``; returns the EOS id.

    Raises:
        ValueError: when the data's EOS id or vocabulary does not fit the model's ``vocab_size``.
    """
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

    eos_id, data_vocab = int(data["eos_id"]), int(data["vocab_size"])
    if not 0 <= eos_id < vocab_size or data_vocab > vocab_size:
        raise ValueError(
            f"the training data (vocabulary {data_vocab}, EOS id {eos_id}) does not fit the model's vocab_size "
            f"({vocab_size})"
        )
    eos_token = Tokenizer.from_str(data["tokenizer_json"]).id_to_token(eos_id)
    (out / "tokenizer.json").write_text(data["tokenizer_json"])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": eos_token,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config_path = out / "config.json"
    values = json.loads(config_path.read_text())
    values.update(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    config_path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(out))
    return eos_id


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mula export``."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        out, parameters, data = export_to_hf(args.checkpoint, args.out, args.config)
    except UnsafeCheckpointError as err:  # one line, no traceback: nothing of the file ran, nothing was written
        print(f"mula export: {err}", file=sys.stderr)
        return 1
    tokenizer = "no tokenizer in the checkpoint"
    if data is not None:
        vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
        tokenizer = f"tokenizer, EOS id {write_tokenizer(out, data, vocab_size)}"
    print(f"mula export: {args.checkpoint} -> {out} ({args.to}, {parameters} parameters, {tokenizer})")
    return 0
