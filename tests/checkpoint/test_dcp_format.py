"""The shared sharded-checkpoint format (``checkpoint.dcp_format``): what both sharded strategies write and read."""

import pytest
import torch

from mula_lightning.checkpoint.dcp_format import METADATA_KEY, load_dcp, save_dcp, saved_keys


def test_round_trip_of_tensors_and_metadata(tmp_path):
    """Logical-key tensors come back into the caller's targets in place, the metadata (tensors and plain data) is
    returned, and the metadata item never stays among the targets."""
    path = tmp_path / "ckpt"
    model = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.arange(5.0)}
    save_dcp(path, {"model": model}, {"step": 7, "rng": torch.tensor([1, 2, 3])})
    assert saved_keys(path) == {"model", METADATA_KEY}
    targets = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    meta = load_dcp(path, targets)
    assert meta["step"] == 7 and torch.equal(meta["rng"], torch.tensor([1, 2, 3]))
    assert set(targets) == {"model"}
    assert all(torch.equal(targets["model"][k], v) for k, v in model.items())


def test_missing_keys_are_named_or_skipped(tmp_path):
    """A target the checkpoint lacks is named with what the checkpoint holds (strict), or dropped (not strict); a
    directory that is not a DCP checkpoint is named; the metadata key cannot be used for state."""
    path = tmp_path / "ckpt"
    save_dcp(path, {"model": {"w": torch.ones(2)}}, {})
    with pytest.raises(KeyError, match=r"has no \['optimizer'\] \(it holds \['metadata', 'model'\]\)"):
        load_dcp(path, {"model": {"w": torch.zeros(2)}, "optimizer": {"x": torch.zeros(1)}})
    targets = {"model": {"w": torch.zeros(2)}, "optimizer": {"x": torch.zeros(1)}}
    load_dcp(path, targets, strict=False)
    assert set(targets) == {"model"} and torch.equal(targets["model"]["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="not a torch.distributed.checkpoint directory"):
        load_dcp(tmp_path, {})
    with pytest.raises(ValueError, match="'metadata' is reserved"):
        save_dcp(tmp_path / "other", {METADATA_KEY: {"w": torch.ones(1)}}, {})


def test_views_are_handed_to_the_writer_without_copies(tmp_path):
    """Views of a flat buffer (fp32, fp64, bf16) reach DCP's writer as aliases whose storage is exactly their bytes
    (the writer would otherwise copy each one and keep the copies until the file closes); a non-contiguous view is
    passed as it is; everything reads back exactly."""
    from mula_lightning.checkpoint.dcp_format import NoCopySavePlanner, standalone_alias

    flat = {dt: torch.randn(64, dtype=torch.float64).to(dt) for dt in (torch.float32, torch.float64, torch.bfloat16)}
    views = {f"{dt}".split(".")[1]: buf[5:29].view(4, 6) for dt, buf in flat.items()}
    views["transposed"] = flat[torch.float32][:24].view(4, 6).t()
    for name, view in views.items():
        alias = standalone_alias(view)
        if name == "transposed":
            assert alias is view
            continue
        assert alias.data_ptr() == view.data_ptr() and alias.dtype == view.dtype and torch.equal(alias, view)
        assert alias.untyped_storage().nbytes() == view.nbytes, name

    handed = {}

    class Recording(NoCopySavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                handed[write_item.index.fqn] = data
            return data

    path = tmp_path / "ckpt"
    save_dcp(path, {"model": views}, {}, planner=Recording())
    for name, view in views.items():
        if name != "transposed":
            assert handed[f"model.{name}"].data_ptr() == view.data_ptr(), name
    targets = {"model": {k: torch.zeros_like(v) for k, v in views.items()}}
    load_dcp(path, targets)
    assert all(torch.equal(targets["model"][k], v) for k, v in views.items())


def _mula_model(**overrides):
    from mula_lightning.models import MulaConfig, MulaForCausalLM

    sizes = {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
             "intermediate_size": 16, "num_experts": 4, "top_k": 2}  # fmt: skip
    config = MulaConfig.from_name("mula-tiny-moe", **{**sizes, **overrides})
    return MulaForCausalLM(config)


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (dict(num_layers=3), r"tensors of this run are not in it \(model\.model\.layers\.2\."),
        (dict(num_experts=8), r"have other shapes \(model\.model\.layers\.0\.mlp\.(gate|experts)"),
        (dict(vocab_size=128), r"model\.model\.embed_tokens\.weight \(64, 16\) saved, \(128, 16\) here"),
    ],
    ids=["more-layers", "more-experts", "larger-vocabulary"],
)
def test_a_checkpoint_of_another_model_config_is_named(tmp_path, overrides, fragment):
    """Loading a checkpoint into a model of another config (a layer more, twice the experts, a larger vocabulary)
    fails before anything is read, naming the tensors the checkpoint lacks or holds in another shape, and the model
    config as the thing to compare (instead of DCP's first "Missing key")."""
    from mula_lightning.checkpoint.sharded import load_sharded_checkpoint, save_sharded_checkpoint
    from mula_lightning.parallel.topology import MoETopology

    save_sharded_checkpoint(tmp_path / "ckpt", {"model": _mula_model()}, MoETopology(1, 1))
    with pytest.raises(ValueError, match=fragment) as err:
        load_sharded_checkpoint(tmp_path / "ckpt", {"model": _mula_model(**overrides)}, MoETopology(1, 1))
    assert "was written for another model" in str(err.value) and "compare the model config" in str(err.value)
    load_sharded_checkpoint(tmp_path / "ckpt", {"model": _mula_model()}, MoETopology(1, 1))  # the same config loads
