"""Export a sharded (DCP) checkpoint to a transformers directory one tensor at a time.

Why: ``mula export`` of a 220B checkpoint must not need the model's size in host memory. DCP reads any single
logical tensor of a checkpoint, whatever layout wrote it (it gathers the overlapping chunks from the files), so the
exporter reads the model's tensors one by one and streams each into its safetensors file: the peak is about one
tensor (two for the one conversion that joins two: a dense MLP exported as a one-expert OLMoE) plus the reader's
buffers, measured by ``benchmarks/memory.py --export``.

The safetensors files are written directly in their format (an 8-byte little-endian header length, a JSON header
of dtype / shape / byte range per tensor padded to 8 bytes, then the raw bytes in header order): the header needs
only the shapes, known from DCP's metadata before any tensor is read, so each file is written front to back
without holding its tensors. ``safetensors.torch.save_file`` needs every tensor of a file at once, and torch's
Hugging Face storage writer and consolidation work on checkpoints saved through that writer, not on the DCP
directories the strategies write; the file names and index are transformers' (:func:`plan_shards`,
:func:`shard_names`, :func:`write_shard_index`, shared with the in-memory export).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mula_lightning.models.hf_keys import SAFETENSORS_DTYPE_NAMES
from mula_lightning.utils.safe_load import SafeFileSystemReader, dcp_load

__all__ = ["SAFETENSORS_DTYPES", "check_against_config", "export_dcp_to_hf", "write_safetensors_streaming"]

SAFETENSORS_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPE_NAMES.items()}


def write_safetensors_streaming(
    path: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file of ``entries`` (name, shape, dtype), asking ``produce(name)`` for each tensor in
    order and dropping it once written. Raises ``ValueError`` when a produced tensor differs from its entry."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in entries:
                tensor = produce(name)
                if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise ValueError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                del tensor, data
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    os.chmod(path, 0o644)


def _hf_sources(config: Any, mula: dict[str, tuple[tuple[int, ...], torch.dtype]]):
    """For every transformers tensor: (name, shape, dtype, Mula keys it is made of, how to make it).

    Built from :func:`~mula_lightning.models.hf_convert.mula_to_hf_state_dict` on meta tensors (names, shapes and
    dtypes) and checked against it, so the streamed export and the in-memory one cannot drift apart.
    """
    from mula_lightning.models.hf_convert import mula_to_hf_state_dict

    meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in mula.items()}
    planned = mula_to_hf_state_dict(meta, config)
    out = []
    for name, value in planned.items():
        source = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")  # Qwen2-MoE's name for Mula's
        if source in mula and tuple(value.shape) == mula[source][0]:
            out.append((name, tuple(value.shape), value.dtype, [source], lambda t: t[0]))
            continue
        prefix, _, leaf = name.rpartition(".experts.")  # a dense MLP exported as a one-expert OLMoE
        if leaf == "gate_up_proj":
            sources = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
            make = lambda t: torch.cat([t[0], t[1]], dim=0).unsqueeze(0)  # noqa: E731
        elif leaf == "down_proj":
            sources, make = [f"{prefix}.down_proj.weight"], lambda t: t[0].unsqueeze(0)
        elif name.endswith(".mlp.gate.weight"):  # the one expert's router row: zeros
            shape, dtype = tuple(value.shape), value.dtype
            sources, make = [], lambda t, shape=shape, dtype=dtype: torch.zeros(shape, dtype=dtype)
        else:
            raise KeyError(f"{name}: no streaming rule for this transformers tensor")
        out.append((name, tuple(value.shape), value.dtype, sources, make))
    return out


def check_against_config(path: Path, config: Any, got: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The config's tensor names and shapes (a tied head left out); raises ``ValueError`` naming the first
    differences when ``got`` (the checkpoint's model tensors, a tied head left out) does not match them."""
    from mula_lightning.models import MulaForCausalLM

    with torch.device("meta"):
        model = MulaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if got != expected:
        wrong = {
            k: (got.get(k), expected.get(k)) for k in sorted(set(got) | set(expected)) if got.get(k) != expected.get(k)
        }
        raise ValueError(
            f"{path}: does not match config {config.name!r}: (checkpoint, config) {dict(list(wrong.items())[:4])}"
        )
    return expected


def export_dcp_to_hf(
    path: Path,
    out: Path,
    config: Any,
    prefix: str,
    max_shard_bytes: int = 5 * 2**30,
    part: tuple[int, int] = (0, 1),
) -> tuple[Path, int]:
    """Stream the model tensors under ``prefix`` of the DCP directory ``path`` into a transformers directory ``out``
    (config.json, safetensors files, index); returns ``(out, parameters)``. Checks names and shapes against
    ``config`` first, naming the mismatches, before any file is written.

    Args:
        part: ``(rank, world)``: write only the files ``i`` with ``i % world == rank`` (and, on rank 0, the index
            and config), so that the ranks of a job write an export in parallel.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mula_lightning.models.hf_convert import hf_export_config, plan_shards, shard_names, write_shard_index

    items = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    stored = {
        k[len(prefix) :]: (tuple(md.size), md.properties.dtype)
        for k, md in items.items()
        if isinstance(md, TensorStorageMetadata) and k.startswith(prefix)
    }
    if config.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    expected = check_against_config(path, config, {k: shape for k, (shape, _) in stored.items()})
    plan = _hf_sources(config, stored)
    by_name = {name: (shape, dtype, sources, make) for name, shape, dtype, sources, make in plan}

    def read(key: str) -> torch.Tensor:
        shape, dtype = stored[key]
        target = {prefix + key: torch.empty(shape, dtype=dtype)}
        dcp_load(target, path, strict=True, no_dist=True)
        return target[prefix + key]

    def produce(name: str) -> torch.Tensor:
        _, _, sources, make = by_name[name]
        return make([read(k) for k in sources])

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [(name, math.prod(shape) * dtype.itemsize) for name, shape, dtype, _, _ in plan]
    shards = plan_shards(sizes, max_shard_bytes)
    rank, world = part
    for i, (keys, file_name) in enumerate(zip(shards, shard_names(len(shards)))):
        if i % world == rank:
            entries = [(k, by_name[k][0], by_name[k][1]) for k in keys]
            write_safetensors_streaming(out / file_name, entries, produce)
    if rank == 0:
        write_shard_index(out, shards, sum(n for _, n in sizes))
        hf_export_config(config).save_pretrained(str(out))
    return out, sum(math.prod(shape) for shape in expected.values())
