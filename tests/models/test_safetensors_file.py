"""``SafetensorsFile``: any box of any tensor of a file written by ``safetensors`` itself, read with ``pread``, equals
that box of the saved tensor; damaged files raise errors that name them; nothing of the file stays mapped."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mula_lightning.models.safetensors_file import SafetensorsFile


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(7, 9, 5, generator=g),
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(40, generator=g).to(torch.float16),
        "f64": torch.randn(3, 4, 2, 6, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**50), 2**50, (11, 3), generator=g),
        "bool": torch.rand(5, 12, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (6, 6), generator=g, dtype=torch.uint8),
        "f8": torch.randn(8, 10, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(1.25),
        "empty": torch.empty(0, 3),
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_bounds(shape, g):
    bounds = []
    for size in shape:
        lo = int(torch.randint(0, size + 1, (1,), generator=g))
        bounds.append((lo, int(torch.randint(lo, size + 1, (1,), generator=g))))
    return bounds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_boxes_equal_the_saved_tensors(tmp_path, seed):
    """Whole tensors of eight dtypes, a scalar and an empty tensor, and random boxes of each (leading rows, inner
    columns, empty boxes), read from a file ``safetensors`` wrote, equal the saved values bit for bit (compared as
    bytes, so float8 and bool compare too)."""
    saved = _tensors(seed)
    save_file(saved, tmp_path / "model.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert set(f.keys()) == set(saved) and f.metadata == {"format": "pt"}
    g = torch.Generator().manual_seed(10 + seed)
    for key, value in saved.items():
        assert f.entries[key][1] == tuple(value.shape)
        whole = f.read(key)
        assert whole.dtype == value.dtype and torch.equal(_bytes(whole), _bytes(value)), key
        for _ in range(5):
            bounds = _random_bounds(value.shape, g)
            box = f.read(key, bounds)
            want = value[tuple(slice(lo, hi) for lo, hi in bounds)]
            assert box.shape == want.shape and torch.equal(_bytes(box), _bytes(want)), (key, bounds)
    f.close()


def test_nothing_of_the_file_stays_mapped(tmp_path):
    """After every tensor was read whole the file is not mapped into the process (``safe_open`` maps it for as long
    as it is open, and every page read counts as resident memory)."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(512, 512)}, path)
    f = SafetensorsFile(path)
    f.read("w")
    assert str(path) not in Path("/proc/self/maps").read_text()
    f.close()


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_damaged_files_raise_errors_that_name_them(tmp_path):
    """A file cut inside its data names the key that reaches past its end; one cut inside its header, one whose
    header is not JSON, an unknown dtype, a byte range that does not match the shape and a box outside the tensor
    are each refused with the file, the key and the values."""
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(8)}, good)
    raw = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match=r"cut.safetensors: truncated: '(a|b)' needs bytes"):
        SafetensorsFile(tmp_path / "cut.safetensors")
    (tmp_path / "head.safetensors").write_bytes(raw[:20])
    with pytest.raises(ValueError, match=r"head.safetensors: cannot read safetensors file \(truncated"):
        SafetensorsFile(tmp_path / "head.safetensors")
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(ValueError, match=r"json.safetensors: cannot read safetensors file \(header is not JSON"):
        SafetensorsFile(tmp_path / "json.safetensors")
    _write_raw(tmp_path / "dtype.safetensors", {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"'x' has dtype C64, not one of"):
        SafetensorsFile(tmp_path / "dtype.safetensors")
    _write_raw(tmp_path / "size.safetensors", {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"'x' of shape \(3,\) F32 holds bytes \[0, 8\), not 12"):
        SafetensorsFile(tmp_path / "size.safetensors")
    f = SafetensorsFile(good)
    with pytest.raises(ValueError, match=r"box \[\(0, 5\), \(0, 4\)\] outside 'a' of shape \(4, 4\)"):
        f.read("a", [(0, 5), (0, 4)])
    f.close()
