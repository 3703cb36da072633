"""bf16-true against float32 under ``epso`` and ``zero_topo``: 20 optimizer steps of the same model, data and layout
(4 ranks: DP 2 x EP 2 for epso, and two of its tensor-parallel layouts: TP 2 + sequence parallelism folded with EP 2,
ETP 2 x EP 2; weights over 2, gradients over 2, optimizer states over 4 for zero_topo, with EP 2 inside it; 2
micro-batches per step), the
relative loss difference printed and bounded. The other tensor-parallel layouts (TP 2 x DP 2, TP 2 folded with EP 2
without sequence parallelism) are left to the float64 parity tests: what bf16 changes (parameter, gradient-reduction
and optimizer-state dtypes) runs through the same code in them as in these two.

How tight the bound is: on learnable data (arithmetic sequences) at lr 1e-3 a correct bf16-true run stays within
about 3e-4 of float32 in every step (measured on AMD EPYC); the bound is 2e-3. A run whose optimizer keeps its
master weights and moments in bf16 (updates below half a bf16 ulp of a weight are lost, so the run drifts) lands
near 5e-3 and fails it; that run is part of the tests, so a bound loosened until it no longer catches it fails too.
The gradient reductions' dtype itself is checked in the communication ledger: over 2-4 ranks a bf16 reduction
rounds the same sums as bf16 gradients already do, so no loss bound could tell it apart.
"""

import contextlib
import functools

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.testing import run_pooled_test

STEPS, MICRO, LR = 20, 2, 1e-3
BOUND = 2e-3  # largest relative loss difference bf16-true may show against float32 in any of the 20 steps
EPSO_LAYOUTS = {
    "epso": dict(ep_size=2),
    "epso tp2+sp ep2": dict(tp_size=2, sequence_parallel=True, ep_size=2),
    "epso etp2 ep2": dict(etp_size=2, ep_size=2),
}
# the 3-level layout with the experts' slices over their 2 edp ranks: its dense units are the engine's units without
# expert parallelism, its expert units the same code over their own groups (one layout checks both)
ZERO_TOPO_LAYOUTS = {"zero_topo ep2": dict(ep_size=2)}
V, T, B = 128, 32, 4


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe",
        vocab_size=V,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=32,
        num_experts=4,
        top_k=2,
        moe_impl="fast",
    )


def _batch(step: int, rank: int, micro: int) -> torch.Tensor:
    """Arithmetic sequences mod V (random start, stride 1-3): learnable, so the runs' losses move and can drift."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    start = torch.randint(0, V, (B, 1), generator=g)
    stride = torch.randint(1, 4, (B, 1), generator=g)
    return (start + stride * torch.arange(T)) % V


@contextlib.contextmanager
def _bf16_optimizer_state(wrong: bool):
    """The wrong configuration: both optimizers keep master weights and moments in the parameters' dtype (bf16);
    undone on exit (the pooled ranks run later tests)."""
    import mula_lightning.parallel.sharded_optimizer as sharded
    import mula_lightning.parallel.zero.engine as engine

    right = sharded.at_least_float32
    if wrong:
        sharded.at_least_float32 = engine.at_least_float32 = lambda dtype: dtype
    try:
        yield
    finally:
        sharded.at_least_float32 = engine.at_least_float32 = right


def _train(rank, world_size, strategy_name, precision, wrong_state):
    with _bf16_optimizer_state(wrong_state):
        return _train_with(world_size, strategy_name, precision)


def _train_with(world_size, strategy_name, precision):
    from mula_lightning.parallel.ledger import CommLedger
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if strategy_name.startswith("epso"):
        strategy = FabricEPSOStrategy(**EPSO_LAYOUTS[strategy_name])
    else:
        strategy = FabricZeroTopoStrategy(
            block_size=16, ranks_per_node=2, ranks_per_gpu=2, **ZERO_TOPO_LAYOUTS[strategy_name]
        )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    losses = []
    with CommLedger() as ledger:
        for step in range(STEPS):
            total = torch.zeros(())
            for micro in range(MICRO):
                x = _batch(step, strategy.distributed_sampler_kwargs["rank"], micro)  # tp ranks: one batch
                with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                    out = model(x, labels=x)
                    loss = (out.loss + 0.01 * out.aux_loss) / MICRO
                    fabric.backward(loss)
                total += loss.detach().float()
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
    mean = torch.stack(losses)
    fabric.all_reduce(mean, reduce_op="mean")
    grad_dtypes = {
        r.dtype for r in ledger.records if r.tag and r.tag.startswith(("optimizer.", "grads.")) and r.op != "all_gather"
    }
    return mean.tolist(), sorted(grad_dtypes), sorted({str(p.dtype) for p in model.parameters()})


@functools.cache
def _run(strategy_name: str, precision: str, wrong_state: bool = False):
    return run_pooled_test(
        _train, 4, strategy_name=strategy_name, precision=precision, wrong_state=wrong_state, timeout=300
    )[0]


def _relative_difference(strategy_name: str, wrong_state: bool) -> torch.Tensor:
    reference = torch.tensor(_run(strategy_name, "32-true")[0])
    bf16 = torch.tensor(_run(strategy_name, "bf16-true", wrong_state)[0])
    return (bf16 - reference).abs() / reference.abs()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", [*EPSO_LAYOUTS, *ZERO_TOPO_LAYOUTS])
def test_bf16_true_follows_float32_within_the_bound(strategy_name):
    """bf16-true trains (the loss falls by more than 0.5 in 20 steps) and stays within BOUND of the float32 run in
    every step; its parameters are bf16 and its gradients are reduced in float32 (the ledger's records)."""
    losses, grad_dtypes, param_dtypes = _run(strategy_name, "bf16-true")
    rel = _relative_difference(strategy_name, wrong_state=False)
    summary = f"max {rel.max():.2e}, mean {rel.mean():.2e}"
    print(f"\n{strategy_name} bf16-true vs float32, relative loss difference: {summary}")
    assert losses[0] - losses[-1] > 0.5
    assert param_dtypes == ["torch.bfloat16"]
    assert grad_dtypes == ["torch.float32"]
    assert rel.max() < BOUND, f"bf16-true drifted {rel.max():.2e} from float32 (bound {BOUND:.0e}): {rel.tolist()}"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy_name", ["epso", "zero_topo ep2"])
def test_the_bound_catches_bf16_optimizer_state(strategy_name):
    """The same bf16-true run with the optimizer's master weights and moments in bf16 exceeds BOUND: the bound is
    tight enough to catch a wrong optimizer dtype."""
    rel = _relative_difference(strategy_name, wrong_state=True)
    print(f"\n{strategy_name} bf16 optimizer state vs float32, relative loss difference: max {rel.max():.2e}")
    assert rel.max() > BOUND
