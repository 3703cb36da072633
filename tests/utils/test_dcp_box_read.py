"""Loading part of a stored DCP chunk reads that part's bytes only, and gives exactly the stored values.

The reference is the tensor that was saved: every box read through :class:`SafeFileSystemReader` (which serves
tensor requests with :func:`~mula_lightning.utils.dcp_box_read.read_box`) must equal the same box of it, for stored
tensors of several dtypes, a non-contiguous one, a scalar and an empty one. The bytes are counted at the file.
"""

import contextlib
import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from mula_lightning.parallel.tensor_pieces import TensorPieces
from mula_lightning.utils.dcp_box_read import DamagedCheckpointError
from mula_lightning.utils.safe_load import SafeFileSystemReader, dcp_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _stored(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "matrix": torch.randn(96, 80, generator=g),
        "transposed": torch.randn(40, 24, generator=g).t(),  # saved with its strides
        "bf16": torch.randn(6, 10, 12, generator=g).to(torch.bfloat16),
        "fp64": torch.randn(300, generator=g, dtype=torch.float64),
        "ints": torch.randint(-(2**40), 2**40, (17, 5), generator=g),
        "mask": torch.rand(9, 4, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


def _random_box(shape, g):
    offsets, lengths = [], []
    for size in shape:
        start = int(torch.randint(0, size + 1, (1,), generator=g))
        offsets.append(start)
        lengths.append(int(torch.randint(0, size - start + 1, (1,), generator=g)))
    return tuple(offsets), tuple(lengths)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_boxes_of_every_stored_tensor_equal_the_saved_values(tmp_path, seed):
    """Whole tensors and random boxes (empty ones included) of tensors saved by one process, of six dtypes, one
    saved non-contiguous, a scalar and an empty tensor, loaded into boxes of fresh targets, equal the saved values
    bit for bit."""
    saved = _stored(seed)
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    whole = {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in saved.items()}
    dcp_load(whole, tmp_path, no_dist=True)
    for key, value in saved.items():
        assert torch.equal(whole[key], value), key
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(6):
        targets, expected = {}, {}
        for key, value in saved.items():
            if value.dim() == 0:
                continue
            offsets, lengths = _random_box(value.shape, g)
            out = torch.empty(lengths, dtype=value.dtype)
            targets[key] = TensorPieces(value.shape, [(offsets, out)])
            expected[key] = (out, value[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])
        dcp_load(targets, tmp_path, no_dist=True)
        for key, (out, want) in expected.items():
            assert torch.equal(out, want), key


class _CountingStream(io.RawIOBase):
    """A file stream that counts the bytes read through it."""

    def __init__(self, stream, counter: list[int]) -> None:
        super().__init__()
        self.stream, self.counter = stream, counter

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, *args):
        return self.stream.seek(*args)

    def tell(self) -> int:
        return self.stream.tell()

    def readinto(self, buffer) -> int:
        got = self.stream.readinto(buffer)
        self.counter[0] += got
        return got

    def read(self, size=-1):
        data = self.stream.read(size)
        self.counter[0] += len(data)
        return data


def _counting(reader, counter):
    opened = reader.fs.create_stream

    @contextlib.contextmanager
    def create_stream(path, mode):
        with opened(path, mode) as stream:
            yield _CountingStream(stream, counter)

    reader.fs.create_stream = create_stream
    return reader


def test_a_box_reads_its_own_bytes_not_the_stored_chunk(tmp_path):
    """Ten rows of a 1 MiB tensor stored whole cost their 40 KiB plus the item's zip headers and pickle (under
    16 KiB); torch's own reader reads the whole stored chunk for the same request (what this replaces)."""
    saved = {"w": torch.randn(256, 1024)}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    read = {}
    for name, reader_type in (("box", SafeFileSystemReader), ("torch", FileSystemReader)):
        counter = [0]
        out = torch.empty(10, 1024)
        reader = _counting(reader_type(str(tmp_path)), counter)
        dcp.load({"w": TensorPieces((256, 1024), [((200, 0), out)])}, storage_reader=reader, no_dist=True)
        assert torch.equal(out, saved["w"][200:210]), name
        read[name] = counter[0]
    assert read["box"] <= 10 * 1024 * 4 + 16 * 1024, read
    assert read["torch"] >= 256 * 1024 * 4, read


def test_a_contiguous_box_is_read_into_its_destination(tmp_path, monkeypatch):
    """A row range (and a whole 1-D chunk's part) of a contiguous stored tensor, loaded into a contiguous destination
    of the stored dtype, is read straight into it: ``read_box`` returns the destination itself, with the stored
    values; a column box (not one run of bytes), a destination of another dtype and a non-contiguous destination get
    a box-sized buffer and a copy, with the same values."""
    from mula_lightning.utils import dcp_box_read

    g = torch.Generator().manual_seed(3)
    saved = {"w": torch.randn(64, 48, generator=g), "v": torch.randn(500, generator=g, dtype=torch.float64)}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    direct = []
    real = dcp_box_read.read_box
    monkeypatch.setattr(
        dcp_box_read,
        "read_box",
        lambda *a, into=None, **k: direct.append((box := real(*a, into=into, **k)) is into) or box,
    )
    rows, part = torch.empty(10, 48), torch.empty(123, dtype=torch.float64)
    cols, other_dtype = torch.empty(64, 5), torch.empty(10, 48, dtype=torch.float64)
    strided = torch.empty(48, 10).t()
    cases = [
        (rows, "w", (20, 0), saved["w"][20:30], True),
        (part, "v", (77,), saved["v"][77:200], True),
        (cols, "w", (0, 40), saved["w"][:, 40:45], False),
        (other_dtype, "w", (20, 0), saved["w"][20:30].double(), False),
        (strided, "w", (3, 0), saved["w"][3:13], False),
    ]
    for out, key, offsets, expected, straight in cases:
        direct.clear()
        shape = saved[key].shape
        dcp.load({key: TensorPieces(shape, [(offsets, out)])}, storage_reader=SafeFileSystemReader(str(tmp_path)),
                 no_dist=True)  # fmt: skip
        assert torch.equal(out, expected), (key, offsets)
        assert direct == [straight], (key, offsets, direct)


def test_a_damaged_byte_order_record_is_named(tmp_path):
    """A record whose byte-order member holds neither ``little`` nor ``big`` (a damaged file) raises
    ``DamagedCheckpointError`` naming the file and the item when a box of it is asked for."""
    dcp.save({"w": torch.randn(16, 8)}, checkpoint_id=str(tmp_path), no_dist=True)
    data = next(tmp_path.glob("*.distcp"))
    raw = data.read_bytes()
    at = raw.index(b"byteorder") + len(b"byteorder")
    at = raw.index(b"little", at)
    data.write_bytes(raw[:at] + b"xxxxxx" + raw[at + 6 :])
    out = torch.empty(4, 8)
    with pytest.raises(DamagedCheckpointError, match=r"\.distcp \(item 'w' at byte \d+\): .*(byte order|endianness)"):
        dcp_load({"w": TensorPieces((16, 8), [((2, 0), out)])}, tmp_path, no_dist=True)


def test_a_truncated_data_file_is_named(tmp_path):
    """A data file cut inside a tensor's bytes, and one cut inside its zip record's directory, raise an error that
    names the file and the item, instead of returning partial values, whether the whole stored chunk or a box of it
    is asked for."""
    dcp.save({"w": torch.randn(128, 128)}, checkpoint_id=str(tmp_path), no_dist=True)
    (data,) = Path(tmp_path).glob("*.distcp")
    size = data.stat().st_size
    for keep in (size // 2, size - 100):
        copy = tmp_path / f"cut{keep}"
        copy.mkdir()
        (copy / ".metadata").write_bytes((tmp_path / ".metadata").read_bytes())
        (copy / data.name).write_bytes(data.read_bytes()[:keep])
        for target in (torch.empty(128, 128), TensorPieces((128, 128), [((64, 0), torch.empty(8, 128))])):
            with pytest.raises(DamagedCheckpointError, match=rf"{data.name} \(item 'w' at byte 0\)"):
                dcp_load({"w": target}, copy, no_dist=True)


def test_records_that_cannot_be_addressed_are_loaded_whole_and_narrowed(tmp_path, monkeypatch):
    """Where a record gives no storage offset (an older torch) the box comes from the whole stored chunk, narrowed,
    as torch's reader does: the same values, with the whole chunks read."""
    from mula_lightning.utils import dcp_box_read

    saved = _stored(3)
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    monkeypatch.setattr(dcp_box_read, "read_box", lambda *args, **kwargs: None)
    g = torch.Generator().manual_seed(7)
    targets, expected = {}, {}
    for key, value in saved.items():
        offsets, lengths = _random_box(value.shape, g)
        out = torch.empty(lengths, dtype=value.dtype)
        targets[key] = TensorPieces(value.shape, [(offsets, out)]) if value.dim() else out
        expected[key] = (out, value[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])
    counter = [0]
    reader = _counting(SafeFileSystemReader(str(tmp_path)), counter)
    dcp_load(targets, tmp_path, no_dist=True, reader=reader)
    for key, (out, want) in expected.items():
        assert torch.equal(out, want), key
    assert counter[0] >= sum(v.numel() * v.element_size() for v in saved.values())
