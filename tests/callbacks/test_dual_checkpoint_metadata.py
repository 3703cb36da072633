"""Checkpoint metadata is plain data: what DualCheckpoint saves under ``epso`` and ``zero_topo`` loads again through
the safe reader, and what cannot be made plain fails the save that writes it, naming the entry (never the resume
after the next failure)."""

import dataclasses
import datetime
import enum
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from mula_lightning.callbacks import DualCheckpoint
from mula_lightning.lightning_module import MulaLM
from mula_lightning.models import MulaConfig
from mula_lightning.testing import DistributedTestError, run_pooled_test
from mula_lightning.utils.plain_data import UnloadableCheckpointValue, check_plain_data, to_plain_data
from mula_lightning.utils.safe_load import dumps_data, loads_data


class _Color(enum.Enum):
    RED = "red"


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
        intermediate_size=8, num_experts=4, top_k=2,
    )  # fmt: skip


def test_dumps_data_normalises_configs_paths_numpy_enums_dates_and_reads_back_safely():
    """A MulaConfig, a Path, NumPy scalars and arrays, an enum, a datetime, a frozenset and a namedtuple-like tuple
    are stored as plain values that ``loads_data`` (weights_only) reads; the config comes back as its fields."""
    config = _config()
    value = {
        "config": config,
        "where": Path("/data/run"),
        "scale": np.float32(0.5),
        "count": np.int64(7),
        "array": np.arange(3),
        "color": _Color.RED,
        "when": datetime.datetime(2026, 11, 24, 12, 0),
        "tags": frozenset({"a"}),
        "nested": [{"p": Path("x")}, (np.bool_(True),)],
        "tensor": torch.ones(2),
    }
    back = loads_data(dumps_data(value), "test")
    assert MulaConfig(**back["config"]) == config
    assert back["where"] == "/data/run" and back["scale"] == 0.5 and back["count"] == 7
    assert type(back["count"]) is int and torch.equal(back["array"], torch.arange(3))
    assert back["color"] == "red" and back["when"] == "2026-11-24T12:00:00" and back["tags"] == {"a"}
    assert back["nested"] == [{"p": "x"}, (True,)] and torch.equal(back["tensor"], torch.ones(2))


class _Opaque:
    pass


def test_a_value_the_reader_refuses_fails_at_save_naming_its_key():
    """An object that cannot be made plain (a user class, a function) raises at ``dumps_data`` with the key path in
    the message; ``check_plain_data`` names the same entry without serialising tensors."""
    with pytest.raises(UnloadableCheckpointValue, match=r"'callbacks\.Mine\.obj'.*_Opaque"):
        dumps_data({"callbacks": {"Mine": {"ok": 1, "obj": _Opaque()}}})
    with pytest.raises(UnloadableCheckpointValue, match=r"'hp\.fn\[1\]'"):
        check_plain_data(to_plain_data({"hp": {"fn": [1, len]}, "state_dict": {"w": torch.zeros(3)}}))
    assert dataclasses.is_dataclass(_config())  # the normalisation of dataclasses is what the config relies on


class _StatefulCallback(Callback):
    """Callback state with values the safe reader refuses unless normalised (a Path, NumPy scalars)."""

    def __init__(self, root, opaque=False):
        self.root, self.opaque, self.loaded = Path(root), opaque, None

    def state_dict(self):
        state = {"where": self.root / "x", "best": np.float64(1.5), "seen": np.int32(3)}
        if self.opaque:
            state["handle"] = _Opaque()
        return state

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


class _LM(MulaLM):
    def __init__(self):
        super().__init__(model=_config(), warmup_steps=1, lr=1e-2)
        self.hparams.update(data_dir=Path("/data/tokens"), temperature=np.float32(0.7), color=_Color.RED)


def _fit(rank, world_size, root, strategy, max_steps, resume=False, opaque=False):
    from mula_lightning.strategies import EPSOStrategy, ZeroTopoStrategy

    torch.manual_seed(3)
    ids = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(8)]
    data = [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in ids]
    stateful = _StatefulCallback(root, opaque)
    dual = DualCheckpoint(f"{root}/dual", every_n_train_steps=2)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_steps=max_steps, callbacks=[dual, stateful],
        strategy=EPSOStrategy(ep_size=2) if strategy == "epso" else ZeroTopoStrategy(block_size=16),
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(_LM(), DataLoader(data, batch_size=None), ckpt_path="last" if resume else None)
    return dual.resumed_from is not None, stateful.loaded, trainer.global_step


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["epso", "zero_topo"])
def test_typed_config_path_and_numpy_hyperparameters_save_and_resume(tmp_path, strategy):
    """``MulaLM(model=MulaConfig(...))`` with a Path, a NumPy scalar and an enum in its hyper-parameters and a
    callback whose state holds a Path and NumPy scalars: 2 ranks save at step 2 and resume from it to step 4
    (before the normalisation the resume was refused: "refused to load ...MulaConfig"). The callback gets its state
    back as plain values."""
    run_pooled_test(_fit, 2, root=str(tmp_path), strategy=strategy, max_steps=2, timeout=240)
    results = run_pooled_test(_fit, 2, root=str(tmp_path), strategy=strategy, max_steps=4, resume=True, timeout=240)
    for resumed, loaded, step in results:
        assert resumed and step == 4
        assert loaded == {"where": str(tmp_path / "x"), "best": 1.5, "seen": 3}


@pytest.mark.distributed
def test_callback_state_the_reader_would_refuse_fails_at_the_first_save(tmp_path):
    """A callback state holding an object the safe reader refuses: the first save fails on every rank, naming the
    entry, and leaves no marker (the run stops at the save, not at the resume after the next failure)."""
    with pytest.raises(DistributedTestError, match=r"callbacks\..*handle"):
        run_pooled_test(_fit, 2, root=str(tmp_path), strategy="epso", max_steps=2, opaque=True, timeout=240)
    assert not list((tmp_path / "dual").rglob("COMPLETE.json"))
