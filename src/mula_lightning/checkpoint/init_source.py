"""Start training from existing weights: what ``MulaLM(init_from=PATH)`` (``--model.init_from``) reads, and how.

Sources, recognised by what the path holds:

* **model-only** (a Mula ``config.json`` without ``model_type`` + ``model.safetensors``): what
  :class:`~mula_lightning.callbacks.ModelOnlyCheckpoint` and ``mula upcycle`` write. Read tensor by tensor from the
  memory-mapped file; an expert tensor is sliced to the reading rank's experts (``get_slice``), so under expert
  parallelism no rank copies experts it does not own.
* **transformers** (a ``config.json`` with ``model_type``: OLMoE, Mixtral, Llama, Qwen MoE): each tensor, expert
  slice or range converted to Mula names as it is read (:class:`~mula_lightning.models.hf_store.HfStore`; Hub-style
  per-expert tensors are read for the experts asked for only).
* **full checkpoint** written by ``mula fit``: a :class:`~mula_lightning.callbacks.DualCheckpoint` directory (its
  newest complete slot), one slot, a DCP directory of a sharded strategy or a Lightning ``.ckpt``. Only the model's
  tensors are read (the optimizer states stay on disk): the run starts with a fresh optimizer and schedule. The
  config is the one ``MulaLM`` stored under ``checkpoint["mula"]``. A DCP directory is read one tensor, expert slice
  or flat range at a time (:class:`~mula_lightning.checkpoint.dcp_store.DcpStore`), whatever layout wrote it; a
  ``.ckpt`` is memory-mapped.

The model config always comes from the source (:func:`init_source_config` reads only the config file or the
checkpoint's metadata, so ``MulaLM.__init__`` stays cheap). Weights are read by the ranks that initialise (one per
shard under ``epso``, which then broadcasts; under ``zero_topo`` each weight chunk by one of the ranks that keep it,
only its element range (:meth:`InitWeights.read_range`), then broadcast to them; every rank under plain DDP, whose
wrapper broadcasts rank 0's anyway) through :class:`InitWeights`, which checks every name and shape against the
model before the first copy. Everything is read as data (:mod:`mula_lightning.utils.safe_load`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mula_lightning.checkpoint.dcp_store import DcpStore
from mula_lightning.checkpoint.export import full_checkpoint_path, model_prefix, stored_entry
from mula_lightning.models.checkpoint_io import WEIGHTS_NAME, is_model_only_dir, load_config
from mula_lightning.models.config import MulaConfig
from mula_lightning.models.hf_store import HfStore
from mula_lightning.models.transformer import MulaForCausalLM, init_buffer
from mula_lightning.models.upcycle_source import DictStore, SafetensorsStore, TensorStore
from mula_lightning.parallel.tensor_pieces import flat_range_boxes
from mula_lightning.utils.safe_load import load_torch_file

__all__ = ["InitWeights", "init_source_config", "init_source_kind"]

MODEL_ONLY, TRANSFORMERS, FULL = "model-only", "transformers", "full checkpoint"


def init_source_kind(path: str | Path) -> str:
    """``"model-only"``, ``"transformers"`` or ``"full checkpoint"``.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a directory that holds none of the three.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"init_from {path}: no such file or directory")
    if is_model_only_dir(path):
        return MODEL_ONLY
    if path.is_dir() and (path / "config.json").is_file() and _json(path / "config.json").get("model_type"):
        return TRANSFORMERS
    full = full_checkpoint_path(path)
    if full.is_file() or (full / ".metadata").is_file():
        return FULL
    if path.is_dir() and (path / "config.json").is_file() and not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"init_from {path}: config.json without {WEIGHTS_NAME} (the weights are missing)")
    raise FileNotFoundError(
        f"init_from {path}: not a model-only checkpoint (config.json + {WEIGHTS_NAME}), a transformers directory "
        "(config.json with model_type + safetensors), a DualCheckpoint directory or slot, a DCP directory or a .ckpt"
    )


def _json(file: Path) -> dict[str, Any]:
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(values, dict):
        raise ValueError(f"{file}: not a JSON object")
    return values


def init_source_config(path: str | Path) -> MulaConfig:
    """The ``MulaConfig`` of the model stored at ``path`` (no tensor is read, except from a ``.ckpt`` file).

    Raises:
        FileNotFoundError: see :func:`init_source_kind`.
        ValueError: a full checkpoint that holds no config (one not written by ``MulaLM``), or an unreadable config.
    """
    path = Path(path)
    kind = init_source_kind(path)
    if kind == MODEL_ONLY:
        return load_config(path)
    if kind == TRANSFORMERS:
        import transformers

        from mula_lightning.models.hf_convert import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True))
    stored = stored_entry(path)
    config = stored.get("config") if stored else None
    if not isinstance(config, dict):
        raise ValueError(
            f"init_from {path}: the checkpoint holds no model config (written by another LightningModule?); "
            "export its weights as a model-only checkpoint with mula export / save_model_only, or start from a "
            "checkpoint written by mula fit"
        )
    return MulaConfig(**config)


class InitWeights:
    """The weights of ``path`` for a model of config ``config``, read one (logical) parameter at a time.

    ``read(config, name, rows)`` returns the full tensor of the Mula parameter ``name`` (its single-device name), or
    rows ``rows`` of it (an expert slice). The source is opened on the first read and checked once per config:
    every parameter of ``MulaForCausalLM(config)`` must be in the source with its shape, else ``ValueError`` naming
    the first offenders. ``store.bytes_read`` counts what was read.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.kind = init_source_kind(self.path)
        self._store: TensorStore | None = None
        self._checked: set[str] = set()

    @property
    def store(self) -> TensorStore:
        if self._store is None:
            self._store = self._open()
        return self._store

    def _open(self) -> TensorStore:
        if self.kind == MODEL_ONLY:
            return SafetensorsStore(self.path)
        if self.kind == TRANSFORMERS:  # converted per tensor on read: nobody loads the whole directory
            return HfStore(self.path, init_source_config(self.path))
        path = full_checkpoint_path(self.path)
        if path.is_dir():  # a sharded checkpoint: each tensor (or part of one) read when asked for
            return DcpStore(path)
        ckpt = load_torch_file(path, mmap=True)  # a .ckpt: memory-mapped, the pages of what is read come in
        state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
        if not isinstance(state, dict):
            raise ValueError(f"{path}: not a checkpoint (a torch file holding {type(ckpt).__name__}, not a dict)")
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        prefix = model_prefix(tensors, path)
        return DictStore({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})

    def check(self, config: MulaConfig) -> None:
        """Every parameter of ``MulaForCausalLM(config)`` is in the source with its shape (else ``ValueError``)."""
        key = json.dumps(config.to_dict(), sort_keys=True)
        if key in self._checked:
            return
        with torch.device("meta"):
            expected = {n: tuple(p.shape) for n, p in MulaForCausalLM(config).named_parameters()}
        have = self.store.keys()
        missing = [n for n in expected if n not in have]
        wrong = []
        for n, shape in expected.items():
            if n in have and (got := self.store.shape(n)) != shape:
                wrong.append(f"{n}: source {got} vs model {shape}")
        if missing or wrong:
            raise ValueError(
                f"init_from {self.path} ({self.kind}) does not fit the model config {config.name!r}: "
                + "; ".join([f"missing {missing[:4]}"] * bool(missing) + wrong[:4])
            )
        self._checked.add(key)

    def read(self, config: MulaConfig, name: str, rows: slice | None = None) -> torch.Tensor:
        """Parameter ``name`` of the source (rows ``rows`` of it when given), checked against ``config`` first."""
        self.check(config)
        if rows is None:
            return self.store.read(name)
        return self.store.read(name, (rows,))

    def read_range(self, config: MulaConfig, name: str, out: torch.Tensor, start: int) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of the flattened parameter ``name``, written into the 1-D
        ``out`` (cast to its dtype), checked against ``config`` first: a ZeRO weight chunk reads only its part.

        A sharded checkpoint loads the range straight into ``out``; the other sources read the few boxes that cover
        it (partial leading row, whole rows, partial trailing row), so only the range's bytes are read.
        """
        self.check(config)
        store = self.store
        if isinstance(store, DcpStore):
            return store.read_range(name, out, start)
        for offset, (offsets, sizes) in flat_range_boxes(store.shape(name), start, start + out.numel()):
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            out[offset - start : offset - start + math.prod(sizes)].copy_(store.read(name, box).reshape(-1))
        return out

    def read_buffer(self, config: MulaConfig, name: str) -> torch.Tensor | None:
        """Buffer ``name`` of the source (a router's selection bias), or None where the source has none (a dense or
        upcycled source, a model trained without the bias: the buffer then starts at its initial value)."""
        self.check(config)
        return self.store.read(name) if name in set(self.store.keys()) else None

    @torch.no_grad()
    def load_into(self, model: MulaForCausalLM) -> MulaForCausalLM:
        """Copy the source into every parameter of a single-device ``model`` (allocated, any dtype and device), and
        into its buffers where the source holds them (their initial values where it does not)."""
        for name, param in model.named_parameters():
            param.copy_(self.read(model.config, name))
        for name, buffer in model.named_buffers():
            value = self.read_buffer(model.config, name)
            buffer.copy_(value if value is not None else init_buffer(name, buffer.shape))
        return model
