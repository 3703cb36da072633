"""``mula export CKPT --to hf DIR`` from a model-only checkpoint and from a dual-slot epso (DCP) checkpoint."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mula_lightning.checkpoint.sharded import save_sharded_checkpoint
from mula_lightning.checkpoint.slots import save_slot
from mula_lightning.cli import main as mula
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.checkpoint_io import save_model_only
from mula_lightning.models.hf_convert import mula_to_hf_state_dict
from mula_lightning.parallel.topology import MoETopology

OVERRIDES = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=8,
                 num_experts=4, top_k=2)  # fmt: skip


def _model():
    return init_weights(MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", **OVERRIDES)), seed=3)


def _assert_hf_dir(out, model):
    expected = mula_to_hf_state_dict(model.state_dict(), model.config)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert (out / "config.json").is_file()


def test_export_model_only_checkpoint_to_hf(tmp_path):
    """A model-only checkpoint carries its config: the HF directory holds exactly its weights, HF-named."""
    model = _model()
    save_model_only(model, tmp_path / "weights")
    assert mula(["export", str(tmp_path / "weights"), "--to", "hf", str(tmp_path / "hf")]) == 0
    _assert_hf_dir(tmp_path / "hf", model)


class _Holder(nn.Module):
    """Stands for a LightningModule: the Trainer's epso checkpoint keys are ``state_dict.model.<mula key>``."""

    def __init__(self, model):
        super().__init__()
        self.model = model


def test_export_dual_checkpoint_directory_needs_and_uses_a_config(tmp_path, capsys):
    """A DualCheckpoint directory of epso DCP checkpoints: the newest slot's model tensors are exported (not the
    older slot's); without --config the one-line error (exit code 1, no traceback) says a full checkpoint written
    by another module holds no config."""
    old, new = _model(), _model()
    with torch.no_grad():
        new.lm_head.weight.add_(1.0)
    topo = MoETopology(1, 1)
    for step, model in ((1, old), (2, new)):
        save_slot(
            tmp_path / "dual", step, lambda p, m=model: save_sharded_checkpoint(p, {"state_dict": _Holder(m)}, topo)
        )
    assert mula(["export", str(tmp_path / "dual"), "--to", "hf", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "holds no model config; pass --config" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    args = ["export", str(tmp_path / "dual"), "--to", "hf", str(tmp_path / "hf"), "--config", "mula-tiny-moe"]
    with pytest.raises(ValueError, match="does not match config"):  # the preset alone has other sizes
        mula([*args, "--debug"])  # --debug: the exception itself, for bug reports
    assert not (tmp_path / "x").exists() and not (tmp_path / "hf").exists()
    save_model_only(old, tmp_path / "weights")  # a model-only directory supplies the config
    args[-1] = str(tmp_path / "weights")
    assert mula(args) == 0
    _assert_hf_dir(tmp_path / "hf", new)
