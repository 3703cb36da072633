"""``MulaLM(init_from=...)``: training starts from stored weights (config from the source, fresh optimizer) under one
process, ``epso`` with expert parallelism and ``zero_topo``; a vocabulary that does not fit is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from mula_lightning.lightning_module import MulaLM
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.models.checkpoint_io import save_model_only
from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict
from mula_lightning.parallel.zero.state_dict import full_model_state_dict
from mula_lightning.testing import run_pooled_test

SHAPE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=16)


def _source(tmp_path, vocab_size=96):
    config = MulaConfig.from_name("mula-tiny-moe", **{**SHAPE, "vocab_size": vocab_size, "num_experts": 4, "top_k": 2})
    model = init_weights(MulaForCausalLM(config), seed=11)
    return model, str(save_model_only(model, tmp_path / "weights"))


class _Capture(Callback):
    """The full weights and optimizer state when training starts (before the first step)."""

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        topology = getattr(strategy, "topology", None)
        engine = getattr(strategy, "engine", None)  # zero_topo frees the weights between steps: summon them
        with engine.full_parameters() if engine is not None else contextlib.nullcontext():
            if engine is not None:
                state = full_model_state_dict(engine, pl_module.model)  # its expert slices gathered
            elif topology is not None and topology.ep_size > 1:
                state = gather_expert_parallel_state_dict(pl_module.model, topology.ep_group)
            else:
                state = pl_module.model.state_dict()
            self.state = {k: v.detach().clone() for k, v in state.items()}
        self.step = trainer.global_step
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def _loader(vocab_size=96):
    ids = torch.randint(0, vocab_size, (8, 12), generator=torch.Generator().manual_seed(2))
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)


def _start(strategy, devices, path, **module_kwargs):
    capture = _Capture()
    module = MulaLM(init_from=path, model="mula-1b", lr=1e-3, min_lr=1e-4, warmup_steps=4, **module_kwargs)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _loader())
    return module.config, capture


def _assert_weights_of(state, source):
    expected = source.state_dict()
    assert set(state) == set(expected)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_one_process_starts_from_the_source_with_a_fresh_optimizer(tmp_path):
    """One device: the config comes from the source (``model="mula-1b"`` ignored), the weights when training starts
    are the source's bit for bit, global step 0 and the first warm-up learning rate (a fresh optimizer and schedule),
    and ``model_overrides`` that keep every shape apply."""
    source, path = _source(tmp_path)
    config, capture = _start("auto", 1, path, model_overrides={"capacity_factor": 2.0})
    assert config == MulaConfig(**{**source.config.to_dict(), "capacity_factor": 2.0, "moe_impl": "fast"})
    _assert_weights_of(capture.state, source)
    assert capture.step == 0 and capture.lr == pytest.approx(1e-3 / 4)


def _start_rank(rank, world_size, path, strategy_name):
    from mula_lightning.strategies import EPSOStrategy, ZeroTopoStrategy

    if strategy_name == "epso":
        strategy = EPSOStrategy(ep_size=2)
    else:
        ep = dict(ep_size=2) if strategy_name.endswith("ep2") else {}
        strategy = ZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, block_size=16, **ep)
    _, capture = _start(strategy, world_size, path)
    return capture.state


@pytest.mark.distributed
@pytest.mark.parametrize("strategy_name", ["epso", "zero_topo", "zero_topo ep2"])
def test_sharded_strategies_start_from_the_source(tmp_path, strategy_name):
    """2 processes under ``epso`` (EP=2: each rank reads its own experts) and ``zero_topo``, 4 under ``zero_topo`` with
    EP=2 (2 nodes x 2 GCDs: each expert slice's weight chunks read once by one of its two replicas): the gathered
    weights when training starts equal the source on every rank."""
    source, path = _source(tmp_path)
    world = 4 if strategy_name.endswith("ep2") else 2
    for state in run_pooled_test(_start_rank, world, path=path, strategy_name=strategy_name, timeout=240):
        _assert_weights_of(state, source)


def test_vocabulary_is_never_resized(tmp_path, tiny_data):
    """A ``vocab_size`` that differs from the source's is refused at construction; data whose vocabulary (512 ids)
    exceeds the source's 96 rows is refused with both sizes named, as is a fixed ``vocab_size`` smaller than the
    data's, instead of a silent resize."""
    from mula_lightning.data.manifest import DataManifest

    _, path = _source(tmp_path)
    with pytest.raises(ValueError, match=r"vocab_size \(128\) differs from the vocab_size of init_from .* \(96\)"):
        MulaLM(init_from=path, vocab_size=128)
    manifest = DataManifest.load(tiny_data)
    with pytest.raises(ValueError, match=r"vocab_size 96 of init_from .* smaller than .* \(512 ids\)"):
        MulaLM(init_from=path).resolve_vocab(manifest)
    fix = r"vocab_size 256 of the model config .* \(512 ids\).*set model.vocab_size to 512"
    with pytest.raises(ValueError, match=fix):
        MulaLM(model_overrides={"vocab_size": 256}).resolve_vocab(manifest)
    assert MulaLM(vocab_size=640).resolve_vocab(manifest) == 640  # a larger (padded) table is kept
    assert MulaLM().resolve_vocab(manifest) == 512  # a preset without a vocabulary takes the data's
