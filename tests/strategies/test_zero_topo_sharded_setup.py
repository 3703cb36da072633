"""zero_topo's sharded setup: a model built on the meta device is materialised by the engine one unit at a time, with
the values the whole-model path gives it, so that no rank holds the whole model at setup.

The reference for values is :func:`~mula_lightning.models.init_weights` (seed, name) on a real model; for training,
one process (the unsharded model on every rank's micro-batch, losses averaged, torch AdamW after global-norm
clipping) in float64, compared with :func:`~mula_lightning.testing.assert_parity`.
"""

import dataclasses

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.parallelize import parameter_initializer
from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
from mula_lightning.parallel.zero.layout import ZeroTopoLayout
from mula_lightning.testing import assert_parity, one_process_data_parallel, run_pooled_test
from mula_lightning.testing.fabric_run import clipped_fabric_steps

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CLIP, STEPS, T = 0.05, 4, 12
DTYPE = torch.float64
#: the 3-level layout (weights over GCD pairs) and ZeRO-3, on 4 processes
LAYOUTS_OF_4 = [dict(ranks_per_node=2, ranks_per_gpu=2), dict(ranks_per_node=4, weight_size=4, grad_size=4)]


def _config(**overrides):
    shape = dict(vocab_size=128, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=2, intermediate_size=16)
    return MulaConfig.from_name("mula-tiny-moe", **{**shape, "num_experts": 4, "top_k": 2, **overrides})


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, T), generator=g)


def _storage_bytes(model):
    """Bytes of the distinct storages behind the model's parameters (a unit already chunked holds none)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta
    }
    return sum(storages.values())


@pytest.mark.parametrize("dense", [False, True], ids=["moe", "dense"])
def test_engine_materialises_one_unit_at_a_time_with_the_whole_model_values(dense):
    """One process, a meta model (MoE, or dense with tied embeddings): the initializer is called once per parameter;
    whenever it is called, the parameters alive hold at most one unit's flat buffer (the value is drawn straight
    into it; the units already chunked hold none: the whole model never exists); afterwards the model is real, its
    weight chunks equal those of an engine built on a real model initialised by ``init_weights``, and so do they and
    the moments after two AdamW steps. (With tied embeddings the engine on the real model used to free the head's
    weight before the head ran.)"""
    overrides = dict(num_experts=0, top_k=0, tie_word_embeddings=True) if dense else {}
    with torch.device("meta"):
        meta = MulaForCausalLM(_config(**overrides)).to(DTYPE)
    real = init_weights(MulaForCausalLM(_config(**overrides)), seed=3).to(DTYPE)
    draw = parameter_initializer(meta, seed=3)
    calls, alive = [], []

    def recording(param):
        calls.append(param.shape)
        alive.append(_storage_bytes(meta))
        return draw(param)

    params = len(list(meta.parameters()))
    engine = HierarchicalZeroAdamW(meta, ZeroTopoLayout(1, 1, 1), **HP, block_size=16, initializer=recording)
    largest = max(u.buf.numel for u in engine.units) * DTYPE.itemsize  # one unit's flat buffer, padding included
    assert len(engine.units) == len(real.model.layers) + 1
    assert len(calls) == params and max(alive) <= largest < _storage_bytes(real)
    assert not any(p.is_meta for p in meta.parameters())
    reference = HierarchicalZeroAdamW(real, ZeroTopoLayout(1, 1, 1), **HP, block_size=16)
    assert len(engine.units) == len(reference.units)
    for got, want in zip(engine.units, reference.units):
        assert torch.equal(got.primary, want.primary), got.index  # the initial values, bit for bit
    for step in range(2):
        for model, opt in ((meta, engine), (real, reference)):
            x = _batch(step, 0)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    for got, want in zip(engine.units, reference.units):
        for key in ("primary", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(got, key), getattr(want, key)), f"unit {got.index} {key}"


def test_foreign_meta_parameters_keep_the_whole_model_path():
    """``parameter_initializer`` declines (None) when a meta parameter cannot be drawn by name alone: one outside a
    Mula model, or a meta buffer other than a router's selection bias; a real model needs nothing drawn. A frozen
    parameter of a Mula model is drawn like the others (the engine shards it and never updates it)."""
    with torch.device("meta"):
        meta = MulaForCausalLM(_config())
    assert parameter_initializer(meta) is not None
    meta.model.norm.weight.requires_grad_(False)
    assert parameter_initializer(meta) is not None
    with torch.device("meta"):
        outside = torch.nn.ModuleDict({"lm": MulaForCausalLM(_config()), "extra": torch.nn.Linear(2, 2)})
        buffered = MulaForCausalLM(_config())
        buffered.register_buffer("scale", torch.ones(2))
    assert parameter_initializer(outside) is None and parameter_initializer(buffered) is None
    with torch.device("meta"):  # a router's selection bias has a known initial value: still one unit at a time
        biased = MulaForCausalLM(dataclasses.replace(_config(), bias_update_rate=0.01))
    assert parameter_initializer(biased) is not None
    assert parameter_initializer(init_weights(MulaForCausalLM(_config()))) is None
    with pytest.raises(ValueError, match="on the meta device"):
        with torch.device("meta"):
            model = MulaForCausalLM(_config())
        HierarchicalZeroAdamW(model, ZeroTopoLayout(1, 1, 1), **HP, block_size=16)


def _fabric_sharded(rank, world_size, sizes):
    from mula_lightning.strategies import FabricZeroTopoStrategy

    fabric = Fabric(
        accelerator="cpu", devices=world_size, strategy=FabricZeroTopoStrategy(block_size=16, **sizes),
        precision="64-true",
    )  # fmt: skip
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    assert all(p.is_meta for p in model.parameters())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    return clipped_fabric_steps(fabric, model, optimizer, _batch, rank, range(STEPS), CLIP)


def _reference(world_size):
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(DTYPE)
    return one_process_data_parallel(model, _batch, world_size, range(STEPS), CLIP, **HP)


@pytest.mark.distributed
@pytest.mark.parametrize("sizes", LAYOUTS_OF_4, ids=["3-level", "zero3"])
def test_fabric_setup_of_a_meta_model_is_sharded_and_trains_like_one_process(sizes):
    """``fabric.setup(model, AdamW)`` of a meta model on 4 processes (the 3-level layout and ZeRO-3): 4 clipped
    AdamW steps give every rank the losses one process computes on its micro-batches (float64)."""
    results = run_pooled_test(_fabric_sharded, 4, sizes=sizes, timeout=300)
    ref = _reference(4)
    for rank, losses in enumerate(results):
        expected = torch.tensor([s[rank] for s in ref], dtype=DTYPE)
        assert_parity(torch.tensor(losses, dtype=DTYPE), expected, reduction_len=3, dtype=torch.float32)


def _tiny_lm():
    """A LightningModule that builds the MoE model on the meta device in ``configure_model`` (Lightning imported in
    the rank process)."""
    from lightning.pytorch import LightningModule

    class TinyLM(LightningModule):
        def configure_model(self):
            with torch.device("meta"):
                self.model = MulaForCausalLM(_config())

        def training_step(self, batch, batch_idx):
            return self.model(batch, labels=batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(batch, labels=batch).loss, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), **HP)

    return TinyLM


def _trainer_fit_both_paths(rank, world_size):
    """Two fits of 2 accumulated steps: the sharded setup (the whole-model path made to raise) and the whole-model
    setup (the sharded one turned off); the full trained weights of each."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from mula_lightning.strategies import ZeroTopoStrategy, zero_topo

    TinyLM = _tiny_lm()

    def fit():
        trainer = Trainer(
            accelerator="cpu", devices=world_size, precision="64-true", max_steps=2, accumulate_grad_batches=2,
            strategy=ZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, block_size=16), gradient_clip_val=CLIP,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,
        )  # fmt: skip
        module = TinyLM()
        trainer.fit(module, DataLoader(torch.cat([_batch(s, rank) for s in range(4)]), batch_size=2))
        with trainer.strategy.engine.full_parameters():
            return {k: v.clone() for k, v in module.model.state_dict().items()}

    def whole_model_path(*args, **kwargs):
        raise AssertionError("the sharded setup materialised the whole model")

    whole, sharded_init = zero_topo._materialize_whole, zero_topo.ZeroTopoOptions._sharded_initializer
    zero_topo._materialize_whole = whole_model_path
    try:
        sharded = fit()
    finally:
        zero_topo._materialize_whole = whole
    zero_topo.ZeroTopoOptions._sharded_initializer = lambda self, module: None
    try:
        reference = fit()
    finally:
        zero_topo.ZeroTopoOptions._sharded_initializer = sharded_init
    return sharded, reference


@pytest.mark.distributed
def test_trainer_fit_sets_up_sharded_and_trains_bit_identical_to_the_whole_model_setup():
    """``Trainer.fit`` with ``zero_topo`` on 2 processes and a LightningModule that builds its model on the meta device
    in ``configure_model``: setup never takes the whole-model path, and after 2 accumulated, clipped steps the full
    weights equal, bit for bit, those of a fit whose setup materialised the whole model first."""
    for sharded, reference in run_pooled_test(_trainer_fit_both_paths, 2, timeout=300):
        assert sharded.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(sharded[key], value), key


def _init_from_rank(rank, world_size, path, layout):
    from mula_lightning.checkpoint.init_source import InitWeights
    from mula_lightning.parallel.parallelize import weights_initializer
    from mula_lightning.strategies import FabricZeroTopoStrategy

    weights = InitWeights(path)
    lay = ZeroTopoLayout(world_size, **layout)
    with torch.device("meta"):
        model = MulaForCausalLM(_config())
    initializer = weights_initializer(model, weights, rank, world_size, replica_groups=lay.weight_replica_groups())
    engine = HierarchicalZeroAdamW(model, lay, **HP, block_size=16, initializer=initializer)
    initializer.close()
    weight = lay.positions(rank).weight
    in_chunk = 0  # parameter elements inside this rank's weight chunks
    for u in engine.units:
        lo, hi = weight * u.nw, (weight + 1) * u.nw
        in_chunk += sum(max(0, min(hi, s.end) - max(lo, s.start)) for s in u.buf.slots)
    with engine.full_parameters():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    read = weights.store.bytes_read
    # the same through the strategy: Fabric with init_from set on it
    strategy = FabricZeroTopoStrategy(block_size=16, **layout)
    strategy.init_from = path
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        net = MulaForCausalLM(_config())
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    with fabric.strategy.engine.full_parameters():
        via_fabric = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
    return state, read, in_chunk, via_fabric


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, source", [(LAYOUTS_OF_4[0], "dcp"), (LAYOUTS_OF_4[1], "model-only")], ids=["3-level-dcp", "zero3"]
)
def test_init_from_reads_each_weight_chunk_once_and_broadcasts_it_to_its_replicas(tmp_path, layout, source):
    """init_from under the sharded setup (4 processes; the 3-level layout from a DCP checkpoint, ZeRO-3 from a
    model-only directory): the ranks that keep the same weight chunk (one per weight group) read it together exactly
    once, each a part, and nobody reads anything else (bytes read per replica group = that chunk's parameter bytes,
    over the job = the source once); the engine's weights equal the source bit for bit, directly and through Fabric
    with the strategy's init_from. (Each tensor used to be read whole by one rank and broadcast to every rank.)"""
    import torch.distributed.checkpoint as dcp

    from mula_lightning.models.checkpoint_io import save_model_only

    reference = init_weights(MulaForCausalLM(_config()), seed=7)
    if source == "dcp":
        path = str(tmp_path / "dcp")
        dcp.save({f"model.{k}": v for k, v in reference.state_dict().items()}, checkpoint_id=path, no_dist=True)
    else:
        path = str(save_model_only(reference, tmp_path / "weights"))
    total = sum(v.numel() * v.element_size() for k, v in reference.state_dict().items())
    results = run_pooled_test(_init_from_rank, 4, path=path, layout=layout, timeout=300)
    lay = ZeroTopoLayout(4, **layout)
    assert sum(read for _, read, _, _ in results) == total
    for ranks in lay.weight_replica_groups():
        chunk_bytes = results[ranks[0]][2] * 4  # float32 source
        assert all(results[r][2] == results[ranks[0]][2] and results[r][1] > 0 for r in ranks)
        assert sum(results[r][1] for r in ranks) == chunk_bytes, (ranks, [results[r][1] for r in ranks])
    for state, _, _, via_fabric in results:
        for k, v in reference.state_dict().items():
            assert torch.equal(state[k], v) and torch.equal(via_fabric[k], v), k


def _chunk_draws(rank, world_size, layout):
    """Engine setup of a meta model on this rank: the element ranges its initializer drew, the units' weight-chunk
    ranges, and whether each chunk equals the chunk of an engine built on a real model (``init_weights``)."""
    from mula_lightning.parallel.parallelize import ParameterInitializer

    class Recording(ParameterInitializer):
        def __call__(self, param):
            raise AssertionError(f"the whole value of {self.table[id(param)][1]} was asked for")

        def fill_many_(self, requests):
            drawn.extend((self.table[id(param)][1], start, out.numel()) for param, out, start in requests)
            return super().fill_many_(requests)

    # a big vocabulary: the root unit (embeddings and head) is several initializer blocks, cut by the chunks
    config = _config(vocab_size=40_000, hidden_size=64)
    lay = ZeroTopoLayout(world_size, **layout)
    with torch.device("meta"):
        meta = MulaForCausalLM(config)
    drawn = []
    table = parameter_initializer(meta, seed=5).table
    engine = HierarchicalZeroAdamW(meta, lay, **HP, block_size=16, initializer=Recording(table, seed=5))
    reference = HierarchicalZeroAdamW(init_weights(MulaForCausalLM(config), seed=5), lay, **HP, block_size=16)
    equal = [torch.equal(u.primary, r.primary) for u, r in zip(engine.units, reference.units)]
    chunks = [(u.nw, u.buf.numel) for u in engine.units]
    weight = lay.positions(rank).weight
    in_chunk = 0  # parameter elements (not padding) inside this rank's weight chunks
    for u in engine.units:
        lo, hi = weight * u.nw, (weight + 1) * u.nw
        in_chunk += sum(max(0, min(hi, s.end) - max(lo, s.start)) for s in u.buf.slots)
    return drawn, chunks, equal, in_chunk


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS_OF_4, ids=["3-level", "zero3"])
def test_each_rank_draws_only_its_weight_chunk(layout):
    """4 processes, a meta model whose root unit spans several initializer blocks: no rank asks for a parameter's
    whole value; the elements each rank draws are exactly its weight chunk of every unit (1/2 of the model in the
    3-level layout, 1/4 under ZeRO-3), never a whole unit; and every chunk equals, bit for bit, the chunk the engine
    cuts from a real model initialised by ``init_weights``. (Drawing a unit whole before cutting it cost one unit
    above the rank's share at setup.)"""
    results = run_pooled_test(_chunk_draws, 4, layout=layout, timeout=300)
    weight_size = ZeroTopoLayout(4, **layout).weight_size
    for rank, (drawn, chunks, equal, in_chunk) in enumerate(results):
        assert all(equal), f"rank {rank}: chunks differ from the whole-model path: {equal}"
        kept = sum(nw for nw, _ in chunks)
        assert kept * weight_size == sum(numel for _, numel in chunks)
        assert 0 < sum(count for _, _, count in drawn) == in_chunk <= kept  # padding is zero, never drawn
        assert max(count for _, _, count in drawn) < max(numel for _, numel in chunks)


def _validate_sharded(rank, world_size, path):
    """Fit 2 steps and save (``trainer.save_checkpoint``); then ``Trainer.validate`` of a fresh meta model from that
    checkpoint, with the whole-model path made to raise. Returns (the loss validation logged, the fitted model's loss
    on the same batch computed with its full parameters)."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from mula_lightning.strategies import ZeroTopoStrategy, zero_topo

    TinyLM = _tiny_lm()

    def trainer(**kwargs):
        return Trainer(
            accelerator="cpu", devices=world_size, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            strategy=ZeroTopoStrategy(ranks_per_node=2, ranks_per_gpu=2, block_size=16), **kwargs,
        )  # fmt: skip

    fitted = TinyLM()
    fit = trainer(max_steps=2)
    fit.fit(fitted, DataLoader(torch.cat([_batch(s, rank) for s in range(2)]), batch_size=2))
    fit.save_checkpoint(path)
    x = _batch(9, 0)
    with fit.strategy.engine.full_parameters(), torch.no_grad():
        expected = fitted.model(x, labels=x).loss.item()

    def whole_model_path(*args, **kwargs):
        raise AssertionError("validation materialised the whole model")

    whole, zero_topo._materialize_whole = zero_topo._materialize_whole, whole_model_path
    try:
        check = trainer()
        metrics = check.validate(TinyLM(), DataLoader(x, batch_size=2), ckpt_path=path, verbose=False)
    finally:
        zero_topo._materialize_whole = whole
    return metrics[0]["val_loss"], expected, check.strategy.engine is not None


@pytest.mark.distributed
def test_trainer_validate_sets_up_sharded_and_reads_the_checkpoint(tmp_path):
    """``Trainer.validate`` with ``zero_topo`` (2 processes, a model built on the meta device in ``configure_model``,
    ``ckpt_path`` of a fitted run): the module is sharded by the engine, never materialised whole (before, every
    evaluation took the whole-model path), and the validation loss equals the fitted model's on the same batch."""
    for val_loss, expected, sharded in run_pooled_test(_validate_sharded, 2, path=str(tmp_path / "ckpt"), timeout=300):
        assert sharded
        assert abs(val_loss - expected) <= 1e-6 * abs(expected), (val_loss, expected)
