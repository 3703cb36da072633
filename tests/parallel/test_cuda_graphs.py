"""CUDA graphs for a training micro-batch (``epso``'s ``cuda_graphs=True``), on the CPU: the captured callable never
reads the device from the host (run on the meta device, where every host read raises; with the Triton kernels, under
a counter of host reads), the replacing forward gives the plain forward's losses, gradients and router loads (with an
eager stand-in for the capture that keeps CUDA's static-output semantics), alone and under ``Trainer`` + ``epso``, and
every case a capture cannot serve is refused in one line. The capture itself needs a GPU: ``benchmarks/gpu_check.py``
runs it under CUDA's sync debug mode."""

import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from mula_lightning.lightning_module import MulaLM
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.activation_checkpointing import apply_activation_checkpointing
from mula_lightning.parallel.cuda_graphs import (
    GraphedTrainingForward,
    _TrainingLoss,
    graph_refusal,
    install_cuda_graphs,
)
from mula_lightning.parallel.topology import MoETopology
from mula_lightning.strategies import EPSOStrategy, FabricEPSOStrategy
from mula_lightning.testing import counting_host_reads, run_pooled_test


def _config(**overrides):
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=16,
                num_experts=4, top_k=2, max_seq_len=64, moe_impl="fast")  # fmt: skip
    base.update(overrides)
    return MulaConfig.from_name("mula-tiny-moe", **base)


VARIANTS = {
    "moe": {},
    "shared experts, expert bias, sequence loss": dict(
        shared_experts=1, expert_bias=True, bias_update_rate=0.01, seq_aux_loss_coef=0.001, score_function="sigmoid"
    ),  # fmt: skip
    "dense": dict(num_experts=0, top_k=0),
    "top-1, every layer checkpointed": dict(top_k=1, checkpoint="full"),
    "experts and attention checkpointed": dict(checkpoint=["moe", "attention", "norm"]),
}


def _meta_model(overrides):
    overrides = dict(overrides)
    checkpoint = overrides.pop("checkpoint", None)
    with torch.device("meta"):
        model = MulaForCausalLM(_config(**overrides))
    if checkpoint:
        apply_activation_checkpointing(model, checkpoint)
    return model.to(torch.bfloat16).train()  # the GPU's training dtype (torch's grouped GEMM takes bf16 there)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_captured_step_reads_nothing_on_the_host(variant):
    """The callable a capture records (forward with the fused head + loss, then backward to every parameter) runs on
    meta tensors, which have no data: any ``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero`` or boolean mask
    (each a host synchronisation on a GPU, and a capture error) would raise here."""
    model = _meta_model(VARIANTS[variant])
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    flat = _TrainingLoss(model)(ids, ids)
    (flat[0] + flat[1]).backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_meta_run_catches_a_host_read():
    """The meta run above can fail: capacity-limited routing reads the number of routed rows on the host."""
    model = _meta_model(dict(capacity_factor=1.0))
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        _TrainingLoss(model)(ids, ids)


class StaticOutputCapture:
    """An eager stand-in for ``make_graphed_callables`` with its output semantics: one warm-up call, then every call
    returns the same output tensors, overwritten in place (as a replay overwrites the graph's static outputs)."""

    def __init__(self):
        self.static = None
        self.calls = 0
        self.backward_pending = False  # a replay whose backward has not run (CUDA keeps one set of activations)
        self.overwrites = 0  # replays while one was pending: on a GPU they overwrite the activations it reads

    def __call__(self, adapter, sample_args):
        adapter(*sample_args)  # the warm-up: its router loads must not count

        def done(grads):
            self.backward_pending = False

        def replay(*args):
            self.calls += 1
            self.overwrites += self.backward_pending
            self.backward_pending = True
            flat = adapter(*args)
            torch.autograd.graph.register_multi_grad_hook([t for t in flat if t.requires_grad], done, mode="any")
            if self.static is None:
                self.static = [t.detach().clone() for t in flat]
            for s, t in zip(self.static, flat):
                s.copy_(t.detach())
            # the outputs alias the static tensors (values), and carry the forward's graph for the backward
            return tuple(_Alias.apply(t, s) for t, s in zip(flat, self.static))

        return replay


class _Alias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, static):
        return static.view_as(static)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _float64_model(**overrides):
    torch.manual_seed(0)
    return init_weights(MulaForCausalLM(_config(**overrides)), seed=0).double().train()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_replacing_forward_matches_the_model():
    """Two accumulated micro-batches through the replacing forward give the plain model's losses, MoE statistics,
    gradients and expert-bias loads (float64); the returned loss and loads survive the next replay overwriting the
    static outputs; the warm-up adds no load; other shapes and evaluation run eagerly; the state dict is unchanged."""
    overrides = dict(expert_bias=True, bias_update_rate=0.01, score_function="sigmoid", shared_experts=1)
    plain, graphed = _float64_model(**overrides), _float64_model(**overrides)
    keys = list(graphed.state_dict())
    capture = StaticOutputCapture()
    wrapper = GraphedTrainingForward(graphed, capture=capture)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (2, 16), generator=gen) for _ in range(2)]
    outs = {}
    for name, model in (("plain", plain), ("graphed", graphed)):
        outs[name] = []
        for ids in batches:
            out = model(ids, labels=ids, return_logits=False)
            (out.loss + out.aux_loss).backward()
            outs[name].append(out)
    assert capture.calls == 2 and wrapper.replays == 2 and wrapper.eager_calls == 0
    for a, b in zip(outs["plain"], outs["graphed"]):
        torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=1e-12)
        torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=0, atol=1e-12)
        assert len(b.moe_aux) == len(a.moe_aux) == 2
        for x, y in zip(a.moe_aux, b.moe_aux):
            torch.testing.assert_close(y.tokens_per_expert, x.tokens_per_expert)
            torch.testing.assert_close(y.load_balance_loss, x.load_balance_loss, rtol=0, atol=1e-12)
    first_loss = outs["graphed"][0].loss.item()
    assert first_loss != outs["graphed"][1].loss.item()  # the first micro-batch's loss was not overwritten
    torch.testing.assert_close(_grads(graphed), _grads(plain), rtol=0, atol=1e-12)
    loads = [r.pending_load for r in _routers(graphed)]
    torch.testing.assert_close(loads, [r.pending_load for r in _routers(plain)], rtol=0, atol=0)
    for s in capture.static:  # a third replay would overwrite these: the loads kept must not change
        s.zero_()
    torch.testing.assert_close([r.pending_load for r in _routers(graphed)], loads, rtol=0, atol=0)

    longer = torch.randint(0, 96, (2, 24), generator=gen)
    graphed(longer, labels=longer, return_logits=False)
    assert wrapper.eager_calls == 1  # another shape: the class's forward
    graphed.eval()
    with torch.no_grad():
        out = graphed(batches[0], labels=batches[0])
    assert out.logits is not None and wrapper.eager_calls == 2 and wrapper.replays == 2
    assert list(graphed.state_dict()) == keys
    wrapper.uninstall()
    assert "forward" not in graphed.__dict__


def test_two_forwards_before_one_backward_run_the_second_eagerly():
    """Review item 6 (issue 71): the graphs keep one set of activations, so a replay before the previous replay's
    backward would overwrite what that backward reads (a Fabric or manual loop running two micro-batches' forwards,
    then one backward of their sum). The second forward runs eagerly with one warning naming the pattern, no replay
    overwrites a pending one, the gradients equal the plain model's (float64), and the forward after the backward
    replays again; a replay's loss dropped without a backward does not keep the next forward eager."""
    plain, graphed = _float64_model(), _float64_model()
    capture = StaticOutputCapture()
    wrapper = GraphedTrainingForward(graphed, capture=capture)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 96, (2, 16), generator=gen) for _ in range(3)]
    for model in (plain, graphed):
        expected = pytest.warns(UserWarning, match="several forwards before one backward")
        with expected if model is graphed else nullcontext():
            first, second = (model(ids, labels=ids, return_logits=False) for ids in batches[:2])
        (first.loss + first.aux_loss + second.loss + second.aux_loss).backward()
        third = model(batches[2], labels=batches[2], return_logits=False)
        (third.loss + third.aux_loss).backward()
    assert capture.overwrites == 0
    assert wrapper.replays == 2 and wrapper.eager_calls == 1
    torch.testing.assert_close(_grads(graphed), _grads(plain), rtol=0, atol=1e-12)
    graphed(batches[0], labels=batches[0], return_logits=False)  # dropped: no backward will come
    graphed(batches[1], labels=batches[1], return_logits=False)
    assert wrapper.replays == 4 and capture.overwrites == 1  # replayed (the dropped one's activations are free)


def _routers(model):
    from mula_lightning.moe.balancing import expert_bias_routers

    return expert_bias_routers(model)


def test_capture_refused_with_hooks():
    """A model with a module hook when the capture would happen is refused once, by name, and runs eagerly."""
    model = _float64_model()
    model.model.layers[0].register_forward_hook(lambda *a: None)
    wrapper = GraphedTrainingForward(model, capture=StaticOutputCapture())
    ids = torch.randint(0, 96, (2, 16))
    with pytest.warns(UserWarning, match=r"modules with hooks cannot be captured \(model\.layers\.0\)"):
        model(ids, labels=ids, return_logits=False)
    model(ids, labels=ids, return_logits=False)
    assert wrapper.refused and wrapper.eager_calls == 2 and wrapper.graphed is None


def test_refusals_name_the_values():
    """Each layout a capture cannot serve is named in one line (global-batch balancing too); a dropless
    single-replica layout on CUDA is not."""
    model = _meta_model({})
    cuda = torch.device("cuda", 0)
    assert graph_refusal(model, cuda, SimpleNamespace(ep_size=1, tp_size=1, pp_size=1)) is None
    assert "this run is on cpu" in graph_refusal(model, torch.device("cpu"))
    reason = graph_refusal(model, cuda, SimpleNamespace(ep_size=2, tp_size=1, pp_size=4))
    assert "ep_size=2, pp_size=4" in reason
    for name in ("etp_size", "tp_size"):
        assert f"({name}=2: their collectives" in graph_refusal(model, cuda, SimpleNamespace(**{name: 2}))
    topology = MoETopology(dp_size=2, ep_size=1)  # the strategy's own record: DP only
    assert graph_refusal(model, cuda, topology) is None
    assert "capacity_factor=1.25" in graph_refusal(_meta_model(dict(capacity_factor=1.25)), cuda)
    assert "balance_scope 'global_batch'" in graph_refusal(_meta_model(dict(balance_scope="global_batch")), cuda)
    jittery = _meta_model(dict(checkpoint="full"))
    jittery.model.layers[1].mlp.jitter_noise = 0.01
    assert "model.layers.1.mlp draws router jitter noise (0.01)" in graph_refusal(jittery, cuda)
    assert "holds no MulaForCausalLM" in graph_refusal(torch.nn.Linear(2, 2), cuda)


def _epso_on_cpu(rank, world_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = FabricEPSOStrategy(cuda_graphs=True)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true")
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = MulaForCausalLM(_config())
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 96, (2, 16))
    out = model(ids, labels=ids, return_logits=False)
    fabric.backward(out.loss + out.aux_loss)
    optimizer.step()
    said = [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
    return said, strategy.graphed_forwards, "forward" in model.module.__dict__, bool(torch.isfinite(out.loss))


def test_epso_on_cpu_warns_and_trains_eagerly():
    """``FabricEPSOStrategy(cuda_graphs=True)`` on 2 CPU ranks says in one warning (rank 0) why it cannot capture,
    installs nothing, and the step runs (the model's forward is its class's)."""
    results = run_pooled_test(_epso_on_cpu, 2)
    assert results[0][0] == ["cuda_graphs=True: the training steps run eagerly: a CUDA device is needed (this run is "
                             "on cpu)"]  # fmt: skip
    assert results[1][0] == []
    assert all(r[1:] == ([], False, True) for r in results)


def test_install_on_cpu_installs_nothing():
    """``install_cuda_graphs`` leaves a model it cannot serve untouched."""
    model = _float64_model()
    with pytest.warns(UserWarning, match="a CUDA device is needed"):
        assert install_cuda_graphs(model, torch.device("cpu")) == []
    assert "forward" not in model.__dict__


def test_failed_capture_runs_eagerly():
    """A capture that raises (on a GPU: a kernel that cannot be captured) is reported once by its first line, the
    router loads of the failed attempt are dropped, and the step runs eagerly with the model's own results."""
    overrides = dict(expert_bias=True, bias_update_rate=0.01, score_function="sigmoid")
    plain, model = _float64_model(**overrides), _float64_model(**overrides)

    def failing(adapter, sample_args):
        adapter(*sample_args)
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    wrapper = GraphedTrainingForward(model, capture=failing)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"the capture failed \(operation not permitted when stream is capturing\)$"):
        out = model(ids, labels=ids, return_logits=False)
    expected = plain(ids, labels=ids, return_logits=False)
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close([r.pending_load for r in _routers(model)], [r.pending_load for r in _routers(plain)])
    assert wrapper.refused and wrapper.eager_calls == 1 and wrapper.replays == 0


@pytest.mark.parametrize("variant", ["moe", "shared experts, expert bias, sequence loss"])
def test_triton_step_reads_nothing_on_the_host(variant):
    """With the Triton experts and loss (on the CPU under Triton's interpreter, float32), the captured callable's
    forward and backward make no host read of any kind (``counting_host_reads``: values, data-sized outputs, boolean
    masks); the counter sees the grouped_mm path's CPU-only read of the group sizes, so it can fail."""
    overrides = {**VARIANTS[variant], "experts_backend": "triton", "loss_backend": "triton"}
    model = init_weights(MulaForCausalLM(_config(**overrides)), seed=0).train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with counting_host_reads() as reads:
        flat = _TrainingLoss(model)(ids, ids)
        (flat[0] + flat[1]).backward()
    assert reads.total() == 0, dict(reads.sites)
    assert torch.isfinite(flat[0]) and all(p.grad is not None for p in model.parameters())
    model = init_weights(MulaForCausalLM(_config(**VARIANTS[variant])), seed=0).train()
    with counting_host_reads() as reads:
        _TrainingLoss(model)(ids, ids)
    assert reads.total("moe/experts.py") == 2  # one per MoE layer: the CPU path's host sizes


class _GraphAtTrainStart(Callback):
    """Installs the replacing forward with the static-output stand-in once the strategy has set the model up."""

    def __init__(self):
        self.wrapper = None

    def on_train_start(self, trainer, pl_module):
        self.wrapper = GraphedTrainingForward(pl_module.model, capture=StaticOutputCapture())


def _fit_mula_lm(rank, world_size, graphed):
    torch.manual_seed(0)
    module = MulaLM(
        model=_config(expert_bias=True, bias_update_rate=0.01, score_function="sigmoid", shared_experts=1),
        lr=3e-3, warmup_steps=1, grad_clip=0.5, clip_during_warmup=True,
    )  # fmt: skip
    callbacks = [_GraphAtTrainStart()] if graphed else []
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=EPSOStrategy(cuda_graphs=not graphed), precision="64-true",
        max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks + [_KeepLosses()], use_distributed_sampler=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, 96, (12, 17), generator=gen)
    data = DataLoader([{"input_ids": r[:-1].clone(), "labels": r[:-1].clone()} for r in ids], batch_size=2)
    trainer.fit(module, data)
    keep = trainer.callbacks[-1]
    replays = callbacks[0].wrapper.replays if graphed else 0
    state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    installed = len(trainer.strategy.graphed_forwards) + ("forward" in module.model.__dict__ and not graphed)
    return keep.losses, state, replays, installed


class _KeepLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_replacing_forward_trains_like_the_model_under_the_trainer():
    """``MulaLM`` under ``Trainer`` + ``epso`` on 2 gloo ranks (float64, accumulation 2, clipping, expert bias): with
    the replacing forward (the static-output stand-in for the capture) every micro-batch's loss and every final
    weight and selection bias equal the eager run's; six micro-batches were replayed. The eager run asks for
    ``cuda_graphs=True``, which the Trainer's strategy refuses on the CPU, installing nothing."""
    eager = run_pooled_test(_fit_mula_lm, 2, graphed=False)
    graphed = run_pooled_test(_fit_mula_lm, 2, graphed=True)
    assert [r[3] for r in eager] == [0, 0]
    for (losses_e, state_e, *_), (losses_g, state_g, replays, _) in zip(eager, graphed):
        assert replays == 6 and len(losses_g) == len(losses_e) == 6
        torch.testing.assert_close(losses_g, losses_e, rtol=0, atol=1e-12)
        torch.testing.assert_close(state_g, state_e, rtol=0, atol=1e-12)
    assert any(k.endswith("e_score_correction_bias") and v.abs().sum() > 0 for k, v in graphed[0][1].items())
