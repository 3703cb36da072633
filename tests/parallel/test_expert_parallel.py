"""Expert-parallel FastSparseMoE (all-gather and all-to-all dispatch) against the single-device block.

Every rank feeds its own micro-batch; the reference runs the unsharded block on each rank's micro-batch
separately. Outputs, input and router gradients must match per rank; the gradient of a rank's expert slice
must equal the sum, over the ranks of its EP group, of the reference gradients of that slice (the slice saw
all of the group's tokens). The loss weights differ per rank, so a reduction over the wrong ranks fails.
"""

import copy

import pytest
import torch

from mula_lightning.models import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock
from mula_lightning.parallel.expert_parallel import ExpertParallelMoEBlock, apply_expert_parallel
from mula_lightning.parallel.ledger import CommLedger, ring_bytes_sent
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import DistributedTestError, run_distributed_test

H, E, K = 16, 8, 2


def _config(capacity_factor=None):
    return MulaConfig.from_name(
        "mula-tiny-moe",
        hidden_size=H,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=12,
        num_experts=E,
        top_k=K,
        capacity_factor=capacity_factor,
        moe_impl="fast",
    )


def _block(case):
    torch.manual_seed(0)
    block = FastSparseMoEBlock(_config(capacity_factor=1.0 if case == "capacity" else None))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        if case in ("skewed", "capacity"):  # experts 4..7 (the second half) never win: one EP rank idles
            block.gate.weight[E // 2 :] = -5.0
    return block


def _batch(rank, case):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, 5, H, generator=g)  # 15 tokens: odd, no alignment
    if case in ("skewed", "capacity"):
        x = x.abs()
    return x, torch.randn(3, 5, H, generator=g)


def _step(block, x, weights):
    x = x.clone().requires_grad_(True)
    out, aux = block.forward_with_aux(x)
    ((out * weights).sum() + aux.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, aux


def _ep_run(rank, world_size, ep, dispatcher, case):
    topo = build_topology(ep)
    block = ExpertParallelMoEBlock(_block(case), topo.ep_group, dispatcher)
    x, w = _batch(rank, case)
    out, x_grad, grads, aux = _step(block, x, w)
    return out, x_grad, grads, aux.num_dropped.item(), aux.tokens_per_expert


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,ep,case",
    [(2, 2, "random"), (4, 2, "skewed"), (4, 4, "capacity")],
)
def test_expert_parallel_matches_single_device_per_rank(world_size, ep, case):
    """Both dispatchers equal the unsharded block: outputs, input/router grads, and summed expert-slice grads.

    Cases: random routing; a routing where one EP rank receives no token; capacity factor 1.0 with drops.
    """
    refs = [_step(_block(case), *_batch(r, case)) for r in range(world_size)]
    per = E // ep
    for dispatcher in ("allgather", "alltoall"):
        results = run_distributed_test(_ep_run, world_size, ep=ep, dispatcher=dispatcher, case=case, timeout=120)
        for rank, (out, x_grad, grads, dropped, tokens) in enumerate(results):
            ref_out, ref_x_grad, ref_grads, ref_aux = refs[rank]
            tol = dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out, ref_out, **tol, msg=f"{dispatcher} rank {rank} output")
            torch.testing.assert_close(x_grad, ref_x_grad, **tol, msg=f"{dispatcher} rank {rank} input grad")
            torch.testing.assert_close(grads["gate.weight"], ref_grads["gate.weight"], **tol)
            assert dropped == ref_aux.num_dropped.item() and torch.equal(tokens, ref_aux.tokens_per_expert)
            group = [r for r in range(world_size) if r // ep == rank // ep]
            lo = (rank % ep) * per
            for name in ("experts.gate_up_proj", "experts.down_proj"):
                expected = sum(refs[r][2][name][lo : lo + per] for r in group)
                torch.testing.assert_close(grads[name], expected, **tol, msg=f"{dispatcher} rank {rank} {name}")
    if case == "skewed":
        assert all(r[2]["experts.gate_up_proj"][E // 2 :].abs().sum() == 0 for r in refs)  # rank 1 really idles
    if case == "capacity":
        assert sum(r[3].num_dropped.item() for r in refs) > 0


def _ledger_run(rank, world_size):
    topo = build_topology(world_size)
    block = ExpertParallelMoEBlock(_block("random"), topo.ep_group, "allgather")
    x, w = _batch(rank, "random")
    with CommLedger() as ledger:
        _step(block, x, w)
    return [(r.op, r.tag, r.phase, r.bytes_sent) for r in ledger.records]


@pytest.mark.distributed
def test_allgather_dispatch_bytes_equal_the_closed_form():
    """One forward+backward of the all-gather dispatcher sends exactly the ring bytes of the module docstring."""
    d, s = 2, 15
    records = run_distributed_test(_ledger_run, d)[0]
    got = {(tag, phase): sent for _, tag, phase, sent in records}
    x, w, idx = s * H * 4, s * K * 4, s * K * 8
    expected = {
        ("moe.token_count", None): ring_bytes_sent("all_gather", d, 8),
        ("moe.dispatch.x", "forward"): (d - 1) * x,
        ("moe.dispatch.w", "forward"): (d - 1) * w,
        ("moe.dispatch.idx", None): (d - 1) * idx,
        ("moe.combine", "forward"): (d - 1) * (d * x) // d,
        ("moe.combine", "backward"): (d - 1) * x,
        ("moe.dispatch.x", "backward"): (d - 1) * (d * x) // d,
        ("moe.dispatch.w", "backward"): (d - 1) * (d * w) // d,
    }
    assert got == expected


def _unequal_tokens(rank, world_size):
    topo = build_topology(world_size)
    block = ExpertParallelMoEBlock(_block("random"), topo.ep_group, "allgather")
    block(torch.randn(1, 4 + rank, H))


@pytest.mark.distributed
def test_bad_input_is_named():
    """EP size not dividing num_experts or the world size, and unequal token counts under all-gather, are named."""
    with pytest.raises(DistributedTestError, match=r"\[4, 5\]"):
        run_distributed_test(_unequal_tokens, 2)
    with pytest.raises(DistributedTestError) as err:
        run_distributed_test(_bad_sizes, 3)
    assert "num_experts (8) must be divisible by ep_size (3)" in str(err.value)
    assert "world size (3) must be divisible by ep_size (2)" in str(err.value)


def _bad_sizes(rank, world_size):
    import torch.distributed as dist

    try:
        build_topology(2)
    except ValueError as e:
        first = str(e)
    model = torch.nn.Sequential(copy.deepcopy(_block("random")))
    try:
        apply_expert_parallel(model, dist.group.WORLD)
    except ValueError as e:
        raise ValueError(f"{first}; {e}") from e
