"""Mula model-only checkpoints: the weights and the config, nothing else (no optimizer, no trainer state).

A model-only checkpoint is a directory holding

* ``config.json``: the :class:`~mula_lightning.models.config.MulaConfig` as a JSON object (``config.to_dict()``,
  no ``model_type`` key, which is how it is told apart from a transformers directory);
* ``model.safetensors``: every parameter under its Mula name (``model.layers.0.mlp.experts.gate_up_proj``, ...),
  full (unsharded) tensors; with tied embeddings ``lm_head.weight`` is omitted and re-tied on load.

It is the format ``mula upcycle`` writes and reads, and the one a later reliability feature (persistent
model-only checkpoints) extends. Files are written to a temporary name and renamed into place, so a crash
during a save never leaves a half-written ``model.safetensors`` or ``config.json`` behind under the final name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.transformer import MulaForCausalLM
from mula_lightning.utils.io import atomic_write, atomic_write_text

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: the training data's ``{"eos_id", "vocab_size"}``, written with its ``tokenizer.json`` beside the weights, so that
#: an export or a further run of a model-only checkpoint knows the tokenizer it was trained with
DATA_NAME = "data.json"
TOKENIZER_NAME = "tokenizer.json"


def save_data_info(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` (``eos_id``, ``vocab_size``, ``tokenizer_json`` as ``MulaLM.data_info`` holds them) into a
    model-only directory: ``tokenizer.json`` and ``data.json``."""
    path = Path(path)
    atomic_write_text(path / TOKENIZER_NAME, data["tokenizer_json"])
    info = {"eos_id": int(data["eos_id"]), "vocab_size": int(data["vocab_size"])}
    atomic_write_text(path / DATA_NAME, json.dumps(info, indent=1, sort_keys=True))


def load_data_info(path: str | Path) -> dict[str, Any] | None:
    """The data info :func:`save_data_info` wrote into ``path``, or None (a checkpoint without a tokenizer)."""
    path = Path(path)
    if not (path / DATA_NAME).is_file() or not (path / TOKENIZER_NAME).is_file():
        return None
    try:
        info = json.loads((path / DATA_NAME).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / DATA_NAME}: not valid JSON ({err})") from err
    return {**info, "tokenizer_json": (path / TOKENIZER_NAME).read_text()}


#: the index of a model-only checkpoint whose weights span several files (transformers' layout and names)
INDEX_NAME = "model.safetensors.index.json"


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model-only checkpoint: ``model.safetensors``, or every file its index names
    (a checkpoint written by several ranks of a large model); empty when neither exists."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path / INDEX_NAME}: unreadable index ({err})") from err
        return [path / name for name in sorted(set(weight_map.values()))]
    return [path / WEIGHTS_NAME] if (path / WEIGHTS_NAME).is_file() else []


def is_model_only_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like a Mula model-only checkpoint (a config without ``model_type`` + weights)."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() or not ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()):
        return False
    try:
        values = json.loads((path / CONFIG_NAME).read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(values, dict) and "model_type" not in values


def load_config(path: str | Path) -> MulaConfig:
    """The ``MulaConfig`` of a model-only checkpoint, with errors that name the file and the bad fields."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing (not a Mula model-only checkpoint)")
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(values, dict) or "model_type" in values:
        raise ValueError(f"{file}: not a MulaConfig dict (a transformers config has a 'model_type' key)")
    known = set(MulaConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{file}: unknown MulaConfig fields {unknown}")
    return MulaConfig(**values)


def save_model_only(
    model_or_state: MulaForCausalLM | dict[str, torch.Tensor], path: str | Path, config: MulaConfig | None = None
) -> Path:
    """Write a model-only checkpoint directory.

    Args:
        model_or_state: a ``MulaForCausalLM`` or its state dict (full tensors, Mula names).
        path: the directory (created if missing; existing files of the same names are replaced atomically).
        config: the config of a state dict (taken from the model otherwise).

    Returns:
        The directory.
    """
    from safetensors.torch import save_file

    if isinstance(model_or_state, MulaForCausalLM):
        config = model_or_state.config if config is None else config
        state = model_or_state.state_dict()
    else:
        state = model_or_state
    if config is None:
        raise ValueError("save_model_only needs config= when given a state dict")
    with torch.device("meta"):
        expected = MulaForCausalLM(config).state_dict()
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items() if k in expected}
    wrong = {k: shapes for k, shapes in wrong.items() if shapes[0] != shapes[1]}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if wrong or missing or unexpected:
        raise ValueError(
            f"the state does not match its config ({config.name}): shape (got, expected) "
            f"{dict(list(wrong.items())[:4])}, "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}; an expert-parallel local model must be gathered "
            "into full tensors before a model-only save"
        )
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    def write_weights(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # safetensors writes 0600: a model-only checkpoint is for others to read

    atomic_write(path / WEIGHTS_NAME, write_weights)
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
    atomic_write_text(path / CONFIG_NAME, text)
    return path


def load_model_only(path: str | Path, device: torch.device | str | None = None, **overrides: Any) -> MulaForCausalLM:
    """Load a model-only checkpoint into a ``MulaForCausalLM``.

    Args:
        path: the directory written by :func:`save_model_only`.
        device: where the weights go (default: CPU).
        overrides: MulaConfig fields to change (e.g. ``moe_impl="fast"``); shapes must still match the file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = load_config(path)
    if overrides:
        config = MulaConfig(**{**config.to_dict(), **overrides})
    file = path / WEIGHTS_NAME
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"{file}: missing (a model-only checkpoint needs its weights)")
    state = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}: listed in {INDEX_NAME} but missing")
        try:
            state.update(load_file(str(file), device=str(device) if device is not None else "cpu"))
        except Exception as err:  # safetensors raises its own error types for truncated or corrupt files
            raise ValueError(f"{file}: cannot read safetensors file ({err})") from err
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = {k: (tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if k in state}
    wrong = {k: s for k, s in wrong.items() if s[0] != s[1]}
    if missing or unexpected or wrong:
        raise KeyError(
            f"{file}: does not match {CONFIG_NAME}: missing {missing[:8]}, unexpected {unexpected[:8]}, "
            f"shape (file, config) {dict(list(wrong.items())[:4])}"
        )
    model.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
