"""Checkpoints are data: every loader of a user-supplied file refuses a hostile payload without running it.

The payload is an object whose unpickling calls ``open(marker, "w")``: if any loader unpickled it with the standard
unpickler, the marker file would exist. Each test hands one loader the payload in one place a checkpoint can carry
it and checks that the marker is never created and that the message names the file and the refused type.
"""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from mula_lightning.checkpoint.dcp_format import load_dcp
from mula_lightning.checkpoint.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from mula_lightning.checkpoint.slots import RNG_NAME, load_rng
from mula_lightning.cli import main as mula
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.models.checkpoint_io import load_model_only, save_model_only
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.utils.safe_load import UnsafeCheckpointError, loads_data, pickle_globals, restricted_loads


class _Hostile:
    """Unpickling this creates ``marker`` (a stand-in for ``os.system``); it pickles as the global ``io.open``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Holder(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


def _model():
    return MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=1))


def _refused(err, path):
    text = str(err)
    assert str(path) in text and "io.open" in text, text  # the payload's global: builtins.open pickles as io.open


@pytest.mark.parametrize("where", ["hyper_parameters", "state_dict_value", "plain_pickle"])
def test_mula_export_refuses_a_hostile_ckpt_in_one_line(tmp_path, capsys, where):
    """`mula export evil.ckpt`: hyper-parameters, a state-dict value or a plain pickle file holding the payload:
    exit code 1, one line naming the file and `io.open`, no marker, no output directory."""
    marker, ckpt, out = tmp_path / "marker", tmp_path / "evil.ckpt", tmp_path / "out"
    if where == "hyper_parameters":
        torch.save({"state_dict": {}, "hyper_parameters": {"x": _Hostile(marker)}}, ckpt)
    elif where == "state_dict_value":
        torch.save({"state_dict": {"w": _Hostile(marker)}}, ckpt)
    else:
        ckpt.write_bytes(pickle.dumps({"state_dict": {}, "x": _Hostile(marker)}))
    assert mula(["export", str(ckpt), "--to", "hf", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    _refused(err, ckpt)
    assert not marker.exists() and not out.exists()


def test_rng_file_of_a_slot_is_refused(tmp_path):
    """A DualCheckpoint slot whose per-rank RNG file holds the payload: refused, named, not run."""
    marker = tmp_path / "marker"
    torch.save({"python": _Hostile(marker)}, tmp_path / RNG_NAME.format(rank=0))
    with pytest.raises(UnsafeCheckpointError) as err:
        load_rng(tmp_path)
    _refused(err.value, tmp_path / RNG_NAME.format(rank=0))
    assert not marker.exists()


def _sharded(path, metadata_item=None, metadata_file=None):
    """A sharded-strategy DCP checkpoint; optionally with a replaced metadata item or ``.metadata`` file."""
    save_sharded_checkpoint(path, {"state_dict": _Holder(_model())}, MoETopology(1, 1), {"step": 3})
    if metadata_item is not None:  # rewrite the directory with this object as its metadata entry
        tensors = {"w": torch.zeros(2)}
        for f in path.iterdir():
            f.unlink()
        dcp.save({**tensors, "metadata": metadata_item}, checkpoint_id=str(path), no_dist=True)
    if metadata_file is not None:
        (path / ".metadata").write_bytes(metadata_file)


@pytest.mark.parametrize("where", ["metadata_item", "legacy_metadata_blob", "dcp_metadata_file"])
def test_dcp_loaders_refuse_hostile_metadata(tmp_path, capsys, where):
    """A DCP directory carrying the payload as its metadata item (new or legacy pickled form) or as DCP's own
    ``.metadata`` file: the EPSO strategies' loader, the shared DCP format loader (zero_topo's) and `mula export`
    all refuse it."""
    marker, path = tmp_path / "marker", tmp_path / "ckpt"
    if where == "metadata_item":
        _sharded(path, metadata_item=_Hostile(marker))
    elif where == "legacy_metadata_blob":
        _sharded(path, metadata_item=pickle.dumps({"step": _Hostile(marker)}))
    else:
        _sharded(path, metadata_file=pickle.dumps(_Hostile(marker)))
    with pytest.raises(UnsafeCheckpointError) as err:
        load_sharded_checkpoint(path, {"state_dict": _Holder(_model())}, MoETopology(1, 1), strict=False)
    _refused(err.value, path)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_dcp(path, {}, strict=False)
    _refused(err.value, path)
    assert mula(["export", str(path), "--to", "hf", str(tmp_path / "out"), "--config", "mula-tiny-moe"]) == 1
    _refused(capsys.readouterr().err, path)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_model_only_checkpoint_with_a_pickle_in_place_of_its_files(tmp_path):
    """Model-only and HF export files are 0644 (safetensors writes 0600). A model-only directory whose safetensors
    file or config.json is a pickle payload: refused as unreadable (safetensors and JSON never unpickle), the file
    named, nothing run."""
    marker = tmp_path / "marker"
    path = save_model_only(_model(), tmp_path / "weights")
    assert mula(["export", str(path), "--to", "hf", str(tmp_path / "hf")]) == 0
    for written in (path / "model.safetensors", tmp_path / "hf" / "model.safetensors"):  # readable by others
        assert oct(written.stat().st_mode & 0o777) == oct(0o644), written
    (path / "model.safetensors").write_bytes(pickle.dumps(_Hostile(marker)))
    with pytest.raises(ValueError, match="model.safetensors: cannot read safetensors file"):
        load_model_only(path)
    save_model_only(_model(), path)
    (path / "config.json").write_bytes(pickle.dumps(_Hostile(marker)))
    with pytest.raises((ValueError, UnicodeDecodeError)):
        load_model_only(path)
    assert not marker.exists()


def _legacy(path, metadata):
    """A checkpoint of the previous format: the metadata entry is a ``pickle.dumps`` blob."""
    save_sharded_checkpoint(path, {"state_dict": _Holder(_model())}, MoETopology(1, 1))
    tensors = _flat(path)
    for f in path.iterdir():
        f.unlink()
    dcp.save({**tensors, "metadata": pickle.dumps(metadata)}, checkpoint_id=str(path), no_dist=True)


def _flat(path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mula_lightning.utils.safe_load import SafeFileSystemReader

    items = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in items.items() if isinstance(m, TensorStorageMetadata)}
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in tensors.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def test_legacy_checkpoints_load_when_plain_and_convert_once_with_trust(tmp_path, capsys):
    """A checkpoint of the previous format loads when its metadata is plain values; one whose metadata holds a
    tensor is refused with the conversion command, `mula checkpoint convert` refuses it without --trust, and with
    --trust writes a checkpoint that loads (same weights, same metadata) and says what it trusted."""
    plain = tmp_path / "plain"
    _legacy(plain, {"step": 3, "loops": {"fit_loop": {"epoch": 1}}})
    target = {"state_dict": _Holder(_model()), "step": 0}
    assert load_sharded_checkpoint(plain, target, MoETopology(1, 1)) == {"loops": {"fit_loop": {"epoch": 1}}}
    assert target["step"] == 3

    old, new = tmp_path / "old", tmp_path / "new"
    _legacy(old, {"step": 5, "callbacks": {"best": torch.tensor(0.25)}})
    with pytest.raises(UnsafeCheckpointError, match="mula checkpoint convert --trust OLD NEW"):
        load_sharded_checkpoint(old, {"state_dict": _Holder(_model())}, MoETopology(1, 1))
    assert mula(["checkpoint", "convert", str(old), str(new)]) == 1
    assert "pass --trust" in capsys.readouterr().err and not new.exists()
    assert mula(["checkpoint", "convert", "--trust", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert f"trusting {old}" in out and "torch._utils._rebuild_tensor_v2" in out  # it says what it trusts
    target = {"state_dict": _Holder(_model()), "step": 0}
    rest = load_sharded_checkpoint(new, target, MoETopology(1, 1))
    assert target["step"] == 5 and torch.equal(rest["callbacks"]["best"], torch.tensor(0.25))
    expected = _flat(old)
    got = target["state_dict"].model.state_dict()
    assert all(torch.equal(got[k.removeprefix("state_dict.model.")], v) for k, v in expected.items())


def test_plain_blobs_read_and_unknown_globals_are_named():
    """The allow-list unpickler builds containers, torch sizes and dtypes; any other global is refused by name;
    pickle_globals lists what a stream names without running it."""
    value = {"a": [1, 2.5, "x", None], "b": (torch.Size([2, 3]), torch.bfloat16), "c": {1, 2}}
    assert restricted_loads(pickle.dumps(value), "blob") == value
    buffer = io.BytesIO()
    torch.save({"t": torch.arange(3)}, buffer)
    assert torch.equal(loads_data(buffer.getvalue(), "blob")["t"], torch.arange(3))
    with pytest.raises(UnsafeCheckpointError, match=r"blob: refused to load 'posix.system'|'nt.system'"):
        restricted_loads(pickle.dumps(os.system), "blob")
    assert pickle_globals(pickle.dumps({"f": os.system, "t": torch.Size([1])})) == sorted(
        [f"{os.system.__module__}.system", "torch.Size"]
    )
