"""Checkpoint files written with O_DIRECT: the file holds exactly the bytes written, in order, for any sizes of
writes (smaller than a block, across the buffer, empty), whenever it is looked at through ``fileno`` (before an
fsync) and after more writes; the same when the file system refuses O_DIRECT at open or at a write, and when it is
switched off; DCP checkpoints written this way are byte-identical to buffered ones and load."""

import errno
import fcntl
import mmap
import os
import random

import pytest
import torch

from mula_lightning.checkpoint import direct_writes
from mula_lightning.checkpoint.dcp_format import load_dcp, save_dcp
from mula_lightning.checkpoint.direct_writes import ALIGNMENT, BUFFER_BYTES, DirectFileWriter, open_for_writing


def _write_pieces(path, seed):
    """Writes pieces of many sizes through a DirectFileWriter, looking at the file through ``fileno`` between some of
    them; returns the writer's ``direct`` flag and the bytes written."""
    rng = random.Random(seed)
    sizes = [
        0,
        1,
        ALIGNMENT - 1,
        ALIGNMENT,
        ALIGNMENT + 1,
        3 * BUFFER_BYTES // 2,
        BUFFER_BYTES,
        17,
        2 * BUFFER_BYTES + 5,
    ]
    sizes += [rng.randrange(1, 200_000) for _ in range(20)]
    rng.shuffle(sizes)
    expected = bytearray()
    with DirectFileWriter(path) as out:
        for i, size in enumerate(sizes):
            piece = rng.randbytes(size)
            kind = i % 3  # bytes, a memoryview of another format, a tensor's bytes
            data = (
                piece
                if kind == 0
                else memoryview(bytearray(piece))
                if kind == 1
                else torch.frombuffer(bytearray(piece) or bytearray(1), dtype=torch.uint8)[:size].numpy()
            )
            assert out.write(data) == size
            expected += piece
            assert out.tell() == len(expected)
            if i % 4 == 1:  # as before an fsync: the file must now hold every byte written so far
                os.fsync(out.fileno())
                assert path.read_bytes() == expected
        direct = out.direct
    return direct, bytes(expected)


def _supports_direct(tmp_path):
    """Whether this file system takes an O_DIRECT open and an aligned direct write (some take the open only)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGNMENT) as block:
            return os.pwrite(fd, block, 0) == ALIGNMENT
    except OSError:
        return False
    finally:
        os.close(fd)


def test_file_holds_exactly_the_bytes_written(tmp_path):
    """Any sequence of write sizes gives the same file as the bytes written (at every ``fileno`` and after close),
    through O_DIRECT wherever the file system takes it (the flag is on the open file)."""
    path = tmp_path / "f.bin"
    direct, expected = _write_pieces(path, seed=1)
    assert path.read_bytes() == expected
    assert direct == _supports_direct(tmp_path)


def test_direct_flag_is_on_the_file(tmp_path):
    """The descriptor really carries O_DIRECT (so the bytes bypass the page cache) where the file system allows it."""
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    with DirectFileWriter(tmp_path / "f.bin") as out:
        out.write(b"x" * 10)
        assert fcntl.fcntl(out.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 10


def test_refused_at_open_writes_buffered(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT at open (EINVAL, as tmpfs before Linux 6.6) gets the same file, buffered."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_writes.os, "open", refusing_open)
    direct, expected = _write_pieces(tmp_path / "f.bin", seed=2)
    assert not direct
    assert (tmp_path / "f.bin").read_bytes() == expected


def test_refused_at_a_write_switches_to_buffered(tmp_path, monkeypatch):
    """A device that takes O_DIRECT at open but refuses a write's alignment (EINVAL) gets the file finished buffered,
    the same bytes, the refused write included."""
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real_pwrite = os.pwrite
    refused = []

    def refusing_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= BUFFER_BYTES:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_writes.os, "pwrite", refusing_pwrite)
    direct, expected = _write_pieces(tmp_path / "f.bin", seed=3)
    assert refused and not direct
    assert (tmp_path / "f.bin").read_bytes() == expected


def test_switched_off_by_environment(tmp_path, monkeypatch):
    """``MULA_CHECKPOINT_DIRECT_IO=0`` gives a plain buffered file."""
    monkeypatch.setenv("MULA_CHECKPOINT_DIRECT_IO", "0")
    with open_for_writing(tmp_path / "f.bin") as out:
        assert not isinstance(out, DirectFileWriter)
        out.write(b"abc")
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_write_errors_name_the_file(tmp_path):
    """A write that fails (here: a closed file; a full disk raises OSError the same way) names the file."""
    out = DirectFileWriter(tmp_path / "f.bin")
    out.close()
    with pytest.raises(ValueError, match="f.bin"):
        out.write(b"x")


def test_dcp_checkpoint_same_bytes_as_buffered(tmp_path, monkeypatch):
    """A DCP checkpoint written through direct writes has the same data files, byte for byte, as one written
    buffered, and loads the same tensors and metadata."""
    g = torch.Generator().manual_seed(4)
    state = {"model": {"w": torch.randn(1000, 700, generator=g), "b": torch.randn(33, generator=g).double()}}
    save_dcp(tmp_path / "direct", state, {"step": 3})
    monkeypatch.setenv("MULA_CHECKPOINT_DIRECT_IO", "0")
    save_dcp(tmp_path / "buffered", state, {"step": 3})
    data = sorted(p.name for p in (tmp_path / "buffered").glob("*.distcp"))
    assert data and data == sorted(p.name for p in (tmp_path / "direct").glob("*.distcp"))
    for name in data:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "buffered" / name).read_bytes()
    targets = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    assert load_dcp(tmp_path / "direct", targets) == {"step": 3}
    for key, value in state["model"].items():
        assert torch.equal(targets["model"][key], value)
