"""MulaLM on one CPU process: the schedule, clipping after warm-up only, token-weighted validation, vocab and
layout checks that fail before any weight is allocated."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer

from mula_lightning.data import MulaDataModule
from mula_lightning.lightning_module import MulaLM
from mula_lightning.lr_schedule import warmup_cosine, warmup_stable_decay
from mula_lightning.models import MulaForCausalLM, init_weights

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32, num_experts=4, top_k=2)


def _trainer(tmp_path, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    return Trainer(**{**defaults, **kwargs})


def test_warmup_cosine_follows_the_paper_schedule():
    """Linear warm-up to the peak at step `warmup`, half a cosine to the minimum at `decay`, flat after."""
    peak, low = 4e-4, 4e-5
    assert warmup_cosine(0, 2500, 10000, peak, low) == pytest.approx(peak / 2500)
    assert warmup_cosine(1249, 2500, 10000, peak, low) == pytest.approx(peak / 2)
    assert warmup_cosine(2500, 2500, 10000, peak, low) == pytest.approx(peak)
    assert warmup_cosine(6250, 2500, 10000, peak, low) == pytest.approx((peak + low) / 2)
    assert warmup_cosine(10000, 2500, 10000, peak, low) == pytest.approx(low)
    assert warmup_cosine(50000, 2500, 10000, peak, low) == pytest.approx(low)
    rates = [warmup_cosine(s, 100, 1000, peak, low) for s in range(1000)]
    assert all(a <= b for a, b in zip(rates[:100], rates[1:101])) and all(
        a >= b for a, b in zip(rates[100:], rates[101:])
    )


class _RecordingLM(MulaLM):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.clipped_at: list[int] = []

    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clipped_at.append(self.trainer.global_step)
        super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_clipping_only_after_warmup_and_lr_schedule_is_applied(tiny_data, tmp_path):
    """With warmup_steps=3 the norm clip runs at optimizer steps 3, 4, 5 only; the logged lr follows the schedule."""
    lm = _RecordingLM(model="mula-tiny-moe", model_overrides=TINY, warmup_steps=3, decay_steps=6, lr=1e-3, min_lr=1e-4)
    trainer = _trainer(tmp_path, max_steps=6, limit_val_batches=0)
    trainer.fit(lm, MulaDataModule(str(tiny_data), micro_batch_size=2))
    assert lm.clipped_at == [3, 4, 5]
    last_lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    assert last_lr == pytest.approx(warmup_cosine(6, 3, 6, 1e-3, 1e-4))


def test_the_module_builds_the_schedule_it_is_given():
    """``MulaLM(lr_schedule="wsd", ...)`` drives its optimizer along :func:`warmup_stable_decay` step by step (2
    warm-up steps, the peak, a linear decay over the last half of 10 steps, ``min_lr`` after); an unknown schedule
    is refused at construction, naming it."""
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10,
                lr_schedule="wsd", decay_fraction=0.5, decay_shape="linear")  # fmt: skip
    lm.configure_model()
    scheduler = lm.configure_optimizers()["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(12):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([warmup_stable_decay(s, 2, 10, 1e-3, 1e-4, 0.5, "linear") for s in range(12)])
    assert rates[2:6] == [1e-3] * 4 and rates[10:] == pytest.approx([1e-4] * 2)
    with pytest.raises(ValueError, match="lr_schedule 'cosin' is not one of"):
        MulaLM(model="mula-tiny-moe", lr_schedule="cosin")


def test_validation_loss_is_the_mean_over_real_tokens(tiny_data, tmp_path):
    """Validation loss = sum of next-token NLL over the val split / its token count, padding rows excluded, and
    perplexity = exp(loss): checked against a direct computation with the same initial weights."""
    dm = MulaDataModule(str(tiny_data), micro_batch_size=2, val_micro_batch_size=5)  # 5 does not divide the split
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, seed=7)
    (result,) = _trainer(tmp_path).validate(lm, dm)

    dm2 = MulaDataModule(str(tiny_data))
    dm2.setup("validate")
    ref = init_weights(MulaForCausalLM(lm.config), seed=7).eval()
    tokens = torch.as_tensor(dm2.val_dataset.read(0, len(dm2.val_dataset)).astype("int64"))
    with torch.no_grad():
        nll = ref(tokens, labels=tokens, loss_reduction="sum").loss
    expected = (nll / (tokens.shape[0] * (tokens.shape[1] - 1))).item()
    assert result["val/loss"] == pytest.approx(expected, rel=1e-5)
    assert result["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-4)


def test_vocab_size_comes_from_the_data_and_a_small_one_is_refused(tiny_data, tmp_path):
    """vocab_size=None takes the manifest's 512; an explicit 100 (< 512) fails in setup, before configure_model."""
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY)
    _trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(lm, MulaDataModule(str(tiny_data), micro_batch_size=2))
    assert lm.config.vocab_size == 512 and lm.model.lm_head.weight.shape[0] == 512

    small = MulaLM(model="mula-tiny-moe", model_overrides=TINY, vocab_size=100)
    with pytest.raises(ValueError, match=r"vocab_size 100 of the model config is smaller than the vocabulary"):
        _trainer(tmp_path, max_steps=1).fit(small, MulaDataModule(str(tiny_data), micro_batch_size=2))
    assert small.model is None


@pytest.mark.parametrize(
    "strategy_name, ep_size, message",
    [
        ("epso", 3, r"num_experts of mula-tiny-moe \(4\) must be divisible by ep_size \(3\)"),
        ("epso", 2, r"number of processes \(devices x nodes\) \(1\) must be divisible by ep_size \(2\)"),
        ("zero_topo", 3, r"ep_size \(3\) must divide the ranks of a node \(1\)"),
        ("zero_topo", 2, r"ep_size \(2\) must divide the ranks of a node \(1\)"),
    ],
)
def test_ep_size_that_does_not_fit_fails_before_building(tiny_data, tmp_path, ep_size, message, strategy_name):
    """epso with ep_size 3 (does not divide 4 experts) or 2 (does not divide 1 process), zero_topo with either (its
    expert-parallel group must fit in a node, here of one process): a ValueError naming the values, and no model was
    built."""
    from mula_lightning.strategies import EPSOStrategy, ZeroTopoStrategy

    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY)
    strategy = EPSOStrategy(ep_size=ep_size) if strategy_name == "epso" else ZeroTopoStrategy(ep_size=ep_size)
    trainer = _trainer(tmp_path, max_steps=1, strategy=strategy)
    with pytest.raises(ValueError, match=message):
        trainer.fit(lm, MulaDataModule(str(tiny_data), micro_batch_size=2))
    assert lm.model is None


def test_unknown_model_override_is_refused():
    """A misspelt MulaConfig field in model_overrides names the field."""
    with pytest.raises(ValueError, match="num_expert"):
        MulaLM(model="mula-tiny-moe", model_overrides={"num_expert": 4})


def test_global_batch_must_match_the_trainers_accumulation(tiny_data, tmp_path):
    """global_batch_size 8 with micro-batch 2 on one rank needs 4 accumulated micro-batches; the Trainer's 1 is
    refused in setup with the value to set."""
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY)
    dm = MulaDataModule(str(tiny_data), micro_batch_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches is 1; set it to 4"):
        _trainer(tmp_path, max_steps=1).fit(lm, dm)
    assert lm.model is None
    _trainer(tmp_path, max_steps=1, accumulate_grad_batches=4, limit_val_batches=0).fit(lm, dm)


def test_model_may_be_a_config_object():
    """A MulaConfig (e.g. converted from HF) is accepted; overrides and moe_impl apply on top of it."""
    from mula_lightning.models import MulaConfig

    base = MulaConfig.from_name("mula-tiny-moe", **TINY)
    lm = MulaLM(model=base, model_overrides={"top_k": 1})
    assert lm.config.top_k == 1 and lm.config.moe_impl == "fast" and lm.config.hidden_size == 32
    with pytest.raises(ValueError, match="topk"):
        MulaLM(model=base, model_overrides={"topk": 1})


def test_lr_zero_is_a_frozen_run_not_a_division_by_zero(tiny_data, tmp_path):
    """``lr: 0`` (a run that only checks that weights load) trains 3 steps at learning rate 0: the schedule gives 0
    at every step and no weight moves (AdamW's decoupled decay is scaled by the rate too)."""
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, warmup_steps=2, lr=0.0, min_lr=0.0)
    trainer = _trainer(tmp_path, max_steps=3, limit_val_batches=0)
    data = MulaDataModule(str(tiny_data), micro_batch_size=2)
    lm.configure_model()
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    trainer.fit(lm, data)
    assert trainer.global_step == 3
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [0.0]
    assert all(torch.equal(v, before[k]) for k, v in lm.model.state_dict().items())


def test_single_device_adamw_takes_the_fused_kernel_and_updates_like_the_default():
    """On CPU parameters the optimizer MulaLM configures runs torch's fused AdamW, and three steps of it (with weight
    decay, two parameter groups) leave the parameters torch's default AdamW leaves, to float64 rounding; parameters on
    the meta device (the sharded strategies' models before they materialise them) get the default, which accepts
    them."""
    from mula_lightning.lightning_module import single_device_adamw

    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in start] for _ in range(3)]
    results = []
    for build in (single_device_adamw, torch.optim.AdamW):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = build([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}], **hyper)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        results.append((optimizer, params))
    (fused, mine), (default, reference) = results
    assert fused.defaults["fused"] is True and not default.defaults.get("fused")
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert not torch.equal(a, start[0] if a.shape == start[0].shape else start[1])  # they moved
    meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    assert not single_device_adamw([meta], **hyper).defaults.get("fused")
    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, decay_steps=10)
    lm.configure_model()
    assert lm.configure_optimizers()["optimizer"].defaults["fused"] is True


def test_muon_trains_the_layers_matrices_and_adamw_the_rest(tiny_data, tmp_path):
    """``MulaLM(optimizer="muon")`` builds one MuonAdamW (Muon: the layers' matrices, experts included; AdamW:
    embeddings, head, norms, routers) driven by the schedule; after three Trainer steps it holds a Nesterov momentum per
    Muon matrix and Adam moments per AdamW tensor; an unknown optimizer is refused, naming
    it."""
    from mula_lightning.optim.muon import MuonAdamW

    lm = MulaLM(model="mula-tiny-moe", model_overrides=TINY, optimizer="muon", warmup_steps=1, lr=1e-3)
    trainer = _trainer(tmp_path, max_steps=3, limit_val_batches=0)
    trainer.fit(lm, MulaDataModule(str(tiny_data), micro_batch_size=2))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in lm.named_parameters()}
    muon, adamw = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert any("experts.gate_up_proj" in n for n in muon) and any("q_proj" in n for n in muon)
    assert any("mlp.gate.weight" in n for n in adamw) and any("embed_tokens" in n for n in adamw)
    for p in optimizer.param_groups[0]["params"]:
        assert set(optimizer.state[p]) == {"momentum_buffer"}
    for p in optimizer.param_groups[1]["params"]:
        assert set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="optimizer 'lion' must be one of"):
        MulaLM(model="mula-tiny-moe", optimizer="lion")


def _balance_windows(rank, world_size, data):
    """Fit two steps of two accumulated micro-batches at global-batch scope; per step, the token counts every router
    holds when the optimizer steps."""
    from lightning.pytorch.callbacks import Callback

    from mula_lightning.data import MulaDataModule
    from mula_lightning.moe.router import Router
    from mula_lightning.strategies import EPSOStrategy

    class Probe(Callback):
        def __init__(self):
            self.tokens = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            routers = [m for m in pl_module.modules() if isinstance(m, Router)]
            self.tokens.append(sorted({int(r.balance_window[-1]) for r in routers}))

    probe = Probe()
    lm = MulaLM(model="mula-tiny-moe", model_overrides={**TINY, "balance_scope": "global_batch"}, warmup_steps=1)
    strategy = EPSOStrategy(ep_size=2) if world_size > 1 else "auto"
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, accumulate_grad_batches=2,
                      max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])  # fmt: skip
    trainer.fit(lm, MulaDataModule(data, micro_batch_size=2))
    return probe.tokens


@pytest.mark.distributed
def test_global_batch_balance_counts_every_rank_and_restarts_each_window(tiny_data):
    """``balance_scope="global_batch"`` under the Trainer: when the optimizer steps, every router's running count
    holds the window's two micro-batches of 2 x 32 tokens on this rank alone (one device), and on both expert-parallel
    ranks under ``epso`` EP 2 (each reads its own batch): the group is the strategy's, the count restarts with each
    accumulation window."""
    from mula_lightning.testing import run_pooled_test

    assert _balance_windows(0, 1, str(tiny_data)) == [[2 * 2 * 32]] * 2
    for tokens in run_pooled_test(_balance_windows, 2, data=str(tiny_data), timeout=300):
        assert tokens == [[2 * 2 * 2 * 32]] * 2


@pytest.mark.parametrize(
    "processes, seq_len, overrides, fragment",
    [
        (4, 30, {}, r"2 x cp = 4 equal chunks; the sequence length 30"),
        (3, 32, {}, r"cp x tp \(2 x 1 = 2\) must divide the ranks of a pipeline stage \(3"),
        (4, 32, {"balance_scope": "global_batch"}, r"balance_scope 'global_batch' would count each rank's chunks"),
    ],
    ids=["length", "processes", "scope"],
)
def test_a_context_parallel_layout_that_does_not_fit_is_named_before_building(processes, seq_len, overrides, fragment):
    """``mula fit``'s layout check names a sequence length that does not split into 2 x cp chunks, processes that
    cp does not divide and a balance scope that would count a rank's chunks only, before any process starts."""
    from mula_lightning.lightning_module import check_layout
    from mula_lightning.models import MulaConfig
    from mula_lightning.strategies import EPSOStrategy

    config = MulaConfig.from_name("mula-tiny-moe", **overrides)
    with pytest.raises(ValueError, match=fragment):
        check_layout(config, EPSOStrategy(cp_size=2, ep_size=1), processes, seq_len)


def test_sequence_parallelism_beside_context_parallelism_needs_each_ranks_tokens_to_split():
    """CP 2 x TP 4 with SP on 8 processes: 36 tokens cut into 4 chunks of 9, but each rank's 18 do not split over
    the 4 TP ranks: named before any process starts; 48 tokens pass."""
    from mula_lightning.lightning_module import check_layout
    from mula_lightning.models import MulaConfig
    from mula_lightning.strategies import EPSOStrategy

    config, strategy = MulaConfig.from_name("mula-tiny-moe"), EPSOStrategy(cp_size=2, tp_size=4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"each rank's 18 tokens \(seq_len 36 / cp_size 2\) over tp_size \(4\)"):
        check_layout(config, strategy, 8, 36)
    check_layout(config, strategy, 8, 48)
