"""Which slot a save may overwrite: never the newest *valid* one, whatever the markers' steps say.

The scenario a review found (issue 35, item 1): slots at steps 8 and 10, the step-10 payload damaged in place; a
resume correctly falls back to step 8, and its first save must then overwrite the damaged step-10 slot, never the
step-8 one: killed at any phase of that save, the job must still be resumable.
"""

import datetime
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mula_lightning.checkpoint.slots import (
    SLOT_NAMES,
    choose_slot,
    read_marker,
    resolve_last,
    save_slot,
    slot_lineages,
    slot_step,
)

PHASES = ("begin", "cleared", "written", "agreed", "done")


def _write(path: Path, value: float) -> None:
    torch.save({"w": torch.full((256,), value)}, path)


def _prepare(dirpath: Path) -> None:
    """Step 8 in one slot, step 10 in the other, then the step-10 payload damaged in place (size unchanged)."""
    save_slot(dirpath, 8, lambda p: _write(p, 8.0), run_id="run-a")
    newest = save_slot(dirpath, 10, lambda p: _write(p, 10.0), run_id="run-a")
    payload = newest / "state.ckpt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))


def _rank(rank, world_size, port, dirpath, phase):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    slot = resolve_last(dirpath)  # the fallback: the step-8 slot

    def hook(name):
        if name == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        assert slot_step(slot) == 8
        # one writer of the one payload file, as a real collective writer has (two ranks rewriting the same file
        # race: torch.save's archive differs between processes, so the marker's checksum could name the other bytes)
        save_slot(dirpath, 9, lambda p: _write(p, 9.0) if rank == 0 else None, phase_hook=hook, run_id="run-a")
        code = 0
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


def _forked(dirpath, phase, world_size=2):
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, world_size, store.port, dirpath, phase)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


@pytest.mark.distributed
@pytest.mark.parametrize("phase", [*PHASES, None])
def test_save_after_a_fallback_resume_never_overwrites_the_only_valid_slot(tmp_path, phase):
    """2 forked ranks resume from step 8 (step 10 damaged) and save step 9, killed by SIGKILL at ``phase`` of that
    save (or not at all): the directory stays resumable, from step 8 until the new marker is down and from step 9
    after, and the step-9 save went into the damaged slot."""
    _prepare(tmp_path)
    damaged = max(SLOT_NAMES, key=lambda n: read_marker(tmp_path / n)["step"])
    codes = _forked(tmp_path, phase)
    assert codes == ([0, 0] if phase is None else [-signal.SIGKILL] * 2), codes
    slot = resolve_last(tmp_path)
    assert slot is not None
    expected = 9 if phase in ("done", None) else 8
    assert slot_step(slot) == expected
    assert torch.load(slot / "state.ckpt", weights_only=True)["w"][0] == float(expected)
    if expected == 9:
        assert slot.name == damaged


def test_choose_slot_without_knowledge_checks_payloads(tmp_path):
    """A process that resolved nothing (a fresh one) still keeps the newest valid slot: the damaged newest-marked
    slot is chosen for overwriting after every rank checked the payloads; with both valid, the older step is."""
    _prepare(tmp_path)
    damaged = max(SLOT_NAMES, key=lambda n: read_marker(tmp_path / n)["step"])
    from mula_lightning.checkpoint import slots

    slots._KNOWN_VALID.clear()
    assert choose_slot(tmp_path).name == damaged
    save_slot(tmp_path, 11, lambda p: _write(p, 11.0), run_id="run-b")
    slots._KNOWN_VALID.clear()
    older = min(SLOT_NAMES, key=lambda n: read_marker(tmp_path / n)["step"])
    assert choose_slot(tmp_path).name == older
    assert slot_lineages(tmp_path) == {older: (8, "run-a"), damaged: (11, "run-b")}
