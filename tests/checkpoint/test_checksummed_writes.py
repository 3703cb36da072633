"""Checksums (xxh3_64) recorded while a DCP checkpoint is written: they equal the files' own, the slot's marker takes
them without reading the files back (a corrupted file is still caught at resume; a marker of the CRC32 format still
verifies), and torch's zip CRC32s are skipped only inside the writing thread and restored after it; such files load
through every reader path."""

import io
import json
import threading
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mula_lightning.checkpoint import slots
from mula_lightning.checkpoint.checksummed_writes import active_recorder, recording_checksums, zip_crc32_skipped
from mula_lightning.checkpoint.dcp_format import load_dcp, save_dcp
from mula_lightning.checkpoint.slots import MARKER_NAME, file_checksum, read_marker, resolve_last, save_slot
from mula_lightning.parallel.tensor_pieces import TensorPieces
from mula_lightning.utils.safe_load import SafeFileSystemReader


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(5, generator=g).double()}}


def _zip_crcs(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return [info.CRC for info in zipfile.ZipFile(io.BytesIO(buffer.getvalue())).infolist()]


def test_recorded_checksums_are_the_files_own(tmp_path):
    """Every file ``save_dcp`` writes inside ``recording_checksums`` (data files and ``.metadata``, recorded under
    its final name) has a recorded size and xxh3_64 equal to the file's; a file whose size changed afterwards, or one
    never recorded, gives None; outside the block nothing is recorded; the checkpoint loads unchanged."""
    state = _state(0)
    with recording_checksums() as recorder:
        assert active_recorder() is recorder
        save_dcp(tmp_path / "ckpt", state, {"step": 3})
    assert active_recorder() is None
    files = sorted(p for p in (tmp_path / "ckpt").iterdir() if p.is_file())
    assert any(p.name == ".metadata" for p in files) and any(p.name.startswith("__0_") for p in files)
    assert len(recorder) == len(files)
    for path in files:
        assert recorder.checksum(path) == file_checksum(path), path.name
    data = next(p for p in files if p.name.startswith("__0_"))
    with open(data, "ab") as f:
        f.write(b"x")
    assert recorder.checksum(data) is None and recorder.checksum(tmp_path / "nope") is None
    for name in ("ckpt", "plain"):  # written without and with torch's zip CRC32s
        if name == "plain":
            save_dcp(tmp_path / name, state, {"step": 3})
        target = {"model": {"w": torch.zeros(300, 7), "b": torch.zeros(5, dtype=torch.float64)}}
        assert load_dcp(tmp_path / name, target)["step"] == 3
        assert all(torch.equal(target["model"][k], state["model"][k]) for k in state["model"])


def test_a_checkpoint_written_without_zip_crc32s_loads_any_box(tmp_path):
    """Records written inside a slot's write (no zip CRC32) are read by the box reader (a row range, a column box:
    what a resume at another layout asks for) and by whole-chunk loads, with the saved values."""
    state = _state(5)
    with recording_checksums():
        save_dcp(tmp_path / "ckpt", state, {})
    rows, cols = torch.empty(20, 7), torch.empty(300, 2)
    targets = {"model.w": TensorPieces((300, 7), [((40, 0), rows)]), "model.b": torch.empty(5, dtype=torch.float64)}
    dcp.load(targets, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    dcp.load({"model.w": TensorPieces((300, 7), [((0, 5), cols)])},
             storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)  # fmt: skip
    assert torch.equal(rows, state["model"]["w"][40:60]) and torch.equal(cols, state["model"]["w"][:, 5:7])
    assert torch.equal(targets["model.b"], state["model"]["b"])


def test_zip_crc32s_are_skipped_only_inside_the_block_and_thread():
    """``torch.save`` writes zip records with a CRC32 outside the block and without inside it; another thread saving
    meanwhile keeps its CRC32s (torch's config is thread-local); a nested block restores what the outer one set."""
    value = torch.arange(10.0)
    assert all(_zip_crcs(value))
    seen = []
    with zip_crc32_skipped():
        with zip_crc32_skipped():
            assert not any(_zip_crcs(value))
        assert not any(_zip_crcs(value))
        thread = threading.Thread(target=lambda: seen.append(_zip_crcs(value)))
        thread.start()
        thread.join()
    assert all(seen[0]) and all(_zip_crcs(value))


def test_a_slot_takes_the_recorded_checksums_and_still_catches_corruption(tmp_path, monkeypatch):
    """``save_slot`` of a DCP write reads back only the files it did not record (the RNG file): the marker's xxh3_64
    values equal the files'; a byte flipped in a data file afterwards makes the slot invalid at resume."""
    read_back = []
    real = slots.file_checksum
    monkeypatch.setattr(slots, "file_checksum", lambda path, *a: read_back.append(path.name) or real(path, *a))
    slot = save_slot(tmp_path, 4, lambda path: save_dcp(path, _state(1), {"step": 4}))
    assert read_back == ["rng_rank0.pt"]
    files = read_marker(slot)["files"]
    assert {rel: info["xxh3_64"] for rel, info in files.items()} == {rel: real(slot / rel) for rel in files}
    assert resolve_last(tmp_path) is not None
    data = next(slot / rel for rel in files if "__0_" in rel)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(slots.CheckpointIntegrityError, match="xxh3_64 .*corrupt"):
        resolve_last(tmp_path)


def test_a_marker_of_the_crc32_format_still_verifies(tmp_path):
    """A slot whose marker holds CRC32s (format 1, every slot written before xxh3_64) resolves when its files match
    them and is refused, naming CRC32's field and the file, when a byte changed; a marker entry with no checksum at
    all is refused by name."""
    slot = save_slot(tmp_path, 2, lambda path: save_dcp(path, _state(3), {"step": 2}))
    marker_file = slot / MARKER_NAME
    marker = json.loads(marker_file.read_text())
    marker["format_version"] = 1
    for rel, info in marker["files"].items():
        del info["xxh3_64"]
        info["crc32"] = zlib.crc32((slot / rel).read_bytes())
    marker_file.write_text(json.dumps(marker))
    assert resolve_last(tmp_path) == slot
    data = next(slot / rel for rel in marker["files"] if "__0_" in rel)
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(slots.CheckpointIntegrityError, match=r"__0_.*crc32 .*corrupt"):
        resolve_last(tmp_path)
    del marker["files"][data.relative_to(slot).as_posix()]["crc32"]
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(slots.CheckpointIntegrityError, match="holds no checksum"):
        resolve_last(tmp_path)


def test_checksums_follow_a_directory_moved_into_place(tmp_path):
    """A save through ``save_replacing`` (a strategy's own save: written to ``<path>.partial``, then renamed over
    ``path``) leaves every file's recorded checksum under its final name, equal to the file's."""
    from mula_lightning.checkpoint.replace_dir import save_replacing

    with recording_checksums() as recorder:
        save_replacing(tmp_path / "ckpt", lambda target: save_dcp(target, _state(2), {"step": 1}))
    files = [p for p in (tmp_path / "ckpt").iterdir() if p.is_file()]
    assert files and len(recorder) == len(files)
    assert all(recorder.checksum(p) == file_checksum(p) for p in files)
