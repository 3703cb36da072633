"""Lazy, read-counting access to the weights of a dense checkpoint, for upcycling.

Online upcycling must not load a whole checkpoint on every rank only to keep a slice of it, so a dense source is
read tensor by tensor: a :class:`TensorStore` returns one tensor, or one slice of it, per call and counts what it
read. Safetensors files are read with ``pread``, the box asked for only
(:class:`~mula_lightning.models.safetensors_file.SafetensorsFile`).

Sources (:func:`open_dense_source`):

* a dense ``MulaForCausalLM`` or a Mula state dict (with its config);
* a transformers directory (``config.json`` with a ``model_type`` + ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``): Llama, or a dense Mula model exported as a one-expert OLMoE (fused
  ``mlp.experts.gate_up_proj`` (1, 2I, H), ``mlp.experts.down_proj`` (1, H, I));
* a Mula model-only checkpoint directory (:mod:`mula_lightning.models.checkpoint_io`).

Every source is checked up front: a MoE config, MoE tensors under a dense config, missing or misshapen FFN
tensors and unknown keys raise errors that name them, before anything is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mula_lightning.models.config import MulaConfig
from mula_lightning.models.safetensors_file import SafetensorsFile
from mula_lightning.models.transformer import MulaForCausalLM

Index = tuple[slice, ...] | None
_MOE_KEY = re.compile(r"(\.mlp\.(experts|gate)\.|\.block_sparse_moe\.)")


def index_bounds(index: Index, shape: tuple[int, ...], key: str) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of the box ``tensor[index]`` selects (``index`` a tuple of slices, possibly
    shorter than ``shape``, or None for the whole tensor); ``ValueError`` naming ``key`` for a strided slice, which no
    reader can address as one box."""
    out = []
    for dim, size in enumerate(shape):
        part = index[dim] if index is not None and dim < len(index) else slice(None)
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"{key}: only contiguous slices can be read, got step {step}")
        out.append((start, max(stop, start)))
    return out


class TensorStore:
    """Named tensors read one at a time; ``reads`` lists every (key, shape read) in order."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, tuple[int, ...]]] = []
        self.bytes_read = 0

    @property
    def keys_read(self) -> list[str]:
        """Distinct keys read, in first-read order."""
        return list(dict.fromkeys(k for k, _ in self.reads))

    def keys(self) -> set[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, key: str, index: Index) -> torch.Tensor:
        raise NotImplementedError

    def read(self, key: str, index: Index = None) -> torch.Tensor:
        """The tensor ``key``, or ``tensor[index]`` (a tuple of slices), as a new tensor."""
        t = self._read(key, index)
        self.reads.append((key, tuple(t.shape)))
        self.bytes_read += t.numel() * t.element_size()
        return t


class DictStore(TensorStore):
    """An in-memory state dict (reads are copies, so the upcycled model never aliases the dense one)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.state = state

    def keys(self) -> set[str]:
        return set(self.state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def _read(self, key: str, index: Index) -> torch.Tensor:
        t = self.state[key].detach()
        return (t if index is None else t[index]).clone()


class SafetensorsStore(TensorStore):
    """A directory of ``model.safetensors`` or index-listed shards; each file opened (its header parsed and checked,
    :class:`~mula_lightning.models.safetensors_file.SafetensorsFile`) once, on its first read, and kept open:
    reading a checkpoint of thousands of per-expert tensors then parses each header once, not once per tensor.
    Reads copy the bytes of the box asked for with ``pread`` (nothing stays mapped); :meth:`close` closes the
    files."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            self.weight_map = dict.fromkeys(self._open("model.safetensors").keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def _open(self, name: str) -> SafetensorsFile:
        """The open file ``name`` of the directory (opened on first use, then kept)."""
        opened = self._files.get(name)
        if opened is None:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"{file}: listed in the index but missing")
            opened = self._files[name] = SafetensorsFile(file)
        return opened

    def _entry(self, key: str) -> tuple[str, tuple[int, ...], int]:
        opened = self._open(self.weight_map[key])
        if key not in opened.entries:
            raise KeyError(f"{opened.path}: no tensor {key!r}, which the index lists in it")
        return opened.entries[key]

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def entries(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every key's shape and safetensors dtype name (``"F32"``, ``"BF16"``, ...), from the headers alone (no
        tensor data): for planning reads of a checkpoint of many files and keys."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for key in self.weight_map:
            dtype, shape, _ = self._entry(key)
            out[key] = (shape, dtype)
        return out

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key)[1]

    def _read(self, key: str, index: Index) -> torch.Tensor:
        shape = self._entry(key)[1]
        bounds = None if index is None else index_bounds(index, shape, key)
        return self._open(self.weight_map[key]).read(key, bounds)

    def close(self) -> None:
        for opened in self._files.values():
            opened.close()
        self._files.clear()


@dataclass
class DenseSource:
    """A dense model's config and its weights, with the FFN readable by intermediate-neuron range.

    Attributes:
        config: the dense ``MulaConfig``.
        store: where the tensors come from (counts reads).
        origin: a short description for messages and provenance.
        fused_single_expert: the FFN is stored as a one-expert OLMoE (transformers export of q/k-norm models).
    """

    config: MulaConfig
    store: TensorStore
    origin: str
    fused_single_expert: bool = False

    def ffn_keys(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp"
        if self.fused_single_expert:
            return [f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"]
        return [f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"]

    def read_ffn(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate rows (N, H), up rows (N, H) and down columns (H, N) of intermediate neurons ``[lo, hi)``."""
        keys, inter, rows = self.ffn_keys(layer), self.config.intermediate_size, slice(lo, hi)
        if self.fused_single_expert:
            gate = self.store.read(keys[0], (slice(0, 1), rows))[0]
            up = self.store.read(keys[0], (slice(0, 1), slice(inter + lo, inter + hi)))[0]
            return gate, up, self.store.read(keys[1], (slice(0, 1), slice(None), rows))[0]
        gate, up = self.store.read(keys[0], (rows,)), self.store.read(keys[1], (rows,))
        return gate, up, self.store.read(keys[2], (slice(None), rows))

    def read(self, key: str) -> torch.Tensor:
        return self.store.read(key)

    def check(self) -> None:
        """Raise, naming what is wrong, unless this is a complete dense checkpoint of ``config``."""
        c = self.config
        if c.is_moe:
            raise ValueError(
                f"{self.origin} is a MoE checkpoint (num_experts={c.num_experts}, top_k={c.top_k}); upcycling "
                "needs a dense one"
            )
        keys = self.store.keys()
        if not self.fused_single_expert:
            moe_keys = sorted(k for k in keys if _MOE_KEY.search(k))
            if moe_keys:
                raise ValueError(
                    f"{self.origin} has a dense config but MoE tensors {moe_keys[:4]}: a MoE checkpoint given as dense"
                )
        with torch.device("meta"):
            dense_keys = set(MulaForCausalLM(c).state_dict())
        other = {k for k in dense_keys if ".mlp." not in k}
        if c.tie_word_embeddings:
            other.discard("lm_head.weight")
        ffn = {i: self.ffn_keys(i) for i in range(c.num_layers)}
        missing_ffn = {i: [k for k in ks if k not in keys] for i, ks in ffn.items()}
        missing_ffn = {i: ks for i, ks in missing_ffn.items() if ks}
        if missing_ffn:
            raise KeyError(f"{self.origin}: missing FFN tensors of layers {sorted(missing_ffn)}: {missing_ffn}")
        missing = sorted(other - keys)
        if missing:
            raise KeyError(f"{self.origin}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        allowed = other | {k for ks in ffn.values() for k in ks} | {"lm_head.weight"}
        if self.fused_single_expert:
            allowed |= {f"model.layers.{i}.mlp.gate.weight" for i in range(c.num_layers)}
        unexpected = sorted(k for k in keys - allowed if not k.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise KeyError(f"{self.origin}: unexpected tensors {unexpected[:8]} for a dense {c.name!r} config")
        h, i_ = c.hidden_size, c.intermediate_size
        want = [(2 * i_, h), (h, i_)] if self.fused_single_expert else [(i_, h), (i_, h), (h, i_)]
        for layer, ks in ffn.items():
            for key, shape in zip(ks, want):
                got = self.store.shape(key)
                got = got[1:] if self.fused_single_expert and got[:1] == (1,) else got
                if tuple(got) != shape:
                    raise ValueError(f"{self.origin}: {key} has shape {tuple(got)}, expected {shape} (layer {layer})")


def open_dense_source(obj: Any, config: MulaConfig | None = None) -> DenseSource:
    """A checked :class:`DenseSource` for a model, a state dict (with ``config``) or a checkpoint directory."""
    if isinstance(obj, MulaForCausalLM):
        src = DenseSource(obj.config, DictStore(obj.state_dict()), f"MulaForCausalLM {obj.config.name!r}")
    elif isinstance(obj, dict):
        if config is None:
            raise ValueError("upcycling a state dict needs its dense config (config=MulaConfig(...))")
        src = DenseSource(config, DictStore(obj), f"state dict of {config.name!r}")
    elif isinstance(obj, (str, Path)):
        src = _open_directory(Path(obj))
    else:
        raise TypeError(f"cannot upcycle a {type(obj).__name__}: give a MulaForCausalLM, a state dict or a directory")
    src.check()
    return src


def _open_directory(path: Path) -> DenseSource:
    from mula_lightning.models import checkpoint_io

    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (neither a transformers nor a Mula model-only directory)")
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    if "model_type" not in values:
        return DenseSource(checkpoint_io.load_config(path), SafetensorsStore(path), f"Mula checkpoint {path}")
    import transformers

    from mula_lightning.models.hf_convert import config_from_hf

    hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    config = config_from_hf(hf_config)
    fused = hf_config.model_type == "olmoe" and not config.is_moe
    origin = f"{hf_config.model_type} directory {path}"
    return DenseSource(config, SafetensorsStore(path), origin, fused_single_expert=fused)
