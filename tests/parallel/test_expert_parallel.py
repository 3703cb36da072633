"""Expert-parallel FastSparseMoE (all-gather and all-to-all dispatch) against the single-device block.

Every rank feeds its own micro-batch; the reference runs the unsharded block on each rank's micro-batch
separately. Outputs, input and router gradients must match per rank; the gradient of a rank's expert slice
must equal the sum, over the ranks of its EP group, of the reference gradients of that slice (the slice saw
all of the group's tokens). The loss weights differ per rank, so a reduction over the wrong ranks fails.

Parity runs in float64 (experts on the per-expert ``torch.mm`` path) with the tight rule of
:func:`mula_lightning.testing.assert_parity`, plus one float32 case for the grouped GEMM kernels; injected bugs
(a dropped token, dispatch over the world instead of the EP group) must fail the same check.
"""

import contextlib
import copy

import pytest
import torch

from mula_lightning.models import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock
from mula_lightning.parallel import apply_expert_parallel
from mula_lightning.parallel.ledger import CommLedger, ring_bytes_sent
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import DistributedTestError, assert_parity, counting_host_reads, run_pooled_test

H, E, K, FF = 16, 8, 2, 12  # FF: expert intermediate size
S = 15  # tokens per rank
# Rounded operations feeding one output / input-gradient element: dots over H and 2FF, the router's softmax over E,
# the sum over K. A weight gradient also sums over the tokens it saw.
BLOCK_LEN = H + 2 * FF + E + K


#: DeepSeek-V3's router: sigmoid scores, 4 groups of which a token keeps 2, renormalised and scaled weights
DEEPSEEK_ROUTING = dict(score_function="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5)  # fmt: skip


def _config(capacity_factor=None, **routing):
    return MulaConfig.from_name(
        "mula-tiny-moe",
        hidden_size=H,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=FF,
        num_experts=E,
        top_k=K,
        capacity_factor=capacity_factor,
        moe_impl="fast",
        **routing,
    )


def _block(case, dtype=torch.float32, backend="auto"):
    torch.manual_seed(0)
    routing = DEEPSEEK_ROUTING if case == "deepseek" else {}
    config = _config(capacity_factor=1.0 if case == "capacity" else None, **routing)
    block = FastSparseMoEBlock(config, experts_backend=backend).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        if case in ("skewed", "capacity"):  # experts 4..7 (the second half) never win: one EP rank idles
            block.gate.weight[E // 2 :] = -5.0
    return block


def _batch(rank, case, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, 5, H, generator=g, dtype=dtype)  # 15 tokens: odd, no alignment
    if case in ("skewed", "capacity"):
        x = x.abs()
    return x, torch.randn(3, 5, H, generator=g, dtype=dtype)


def _step(block, x, weights):
    x = x.clone().requires_grad_(True)
    out, aux = block.forward_with_aux(x)
    ((out * weights).sum() + aux.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, aux


@contextlib.contextmanager
def _injected(bug):
    """Break expert parallelism on purpose (in the rank process) while the block runs: the parity check must then
    fail. Put back on exit, so that a pooled rank runs the next test unbroken."""
    import mula_lightning.parallel.token_dispatchers as dispatchers

    build = dispatchers.build_dispatch_plan
    if bug == "dropped_token":  # the first (token, k) pair gathered from rank 0 never reaches its expert

        def build_dropping_one(indices_SK, *args, **kwargs):
            indices_SK = indices_SK.clone()
            indices_SK[0, 0] = -1
            kwargs.pop("num_rows", None)  # the exchanged counts would catch the drop on the device first
            return build(indices_SK, *args, **kwargs)

        dispatchers.build_dispatch_plan = build_dropping_one
    try:
        yield
    finally:
        dispatchers.build_dispatch_plan = build


def _expert_parallel(block, group, dispatcher, where, bug=None):
    """``apply_expert_parallel`` on the bare block, or on a model that holds it; returns the (same) block."""
    import torch.distributed as dist

    if where == "bare":
        assert apply_expert_parallel(block, group, dispatcher) is block
    else:
        model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": block})])})
        assert apply_expert_parallel(model, group, dispatcher) is model
        assert model["layers"][0]["mlp"] is block
    if bug == "world_group":  # tokens gathered and combined over every rank instead of the EP group
        block.dispatcher.ep_group = dist.group.WORLD
    return block


def _ep_run(rank, world_size, ep, dispatcher, case, dtype, bug=None, where="bare", experts_backend="auto"):
    topo = build_topology(ep)
    block = _expert_parallel(_block(case, dtype, experts_backend), topo.ep_group, dispatcher, where, bug)
    assert type(block) is FastSparseMoEBlock and block.dispatcher.name == dispatcher
    x, w = _batch(rank, case, dtype)
    with _injected(bug):
        out, x_grad, grads, aux = _step(block, x, w)
    return out, x_grad, grads, aux.num_dropped.item(), aux.tokens_per_expert


def _check_ep(results, refs, world_size, ep, dispatcher, dtype):
    """Every rank's output, input and router gradients, and expert-slice gradients equal the reference's."""
    per = E // ep
    for rank, (out, x_grad, grads, dropped, tokens) in enumerate(results):
        ref_out, ref_x_grad, ref_grads, ref_aux = refs[rank]
        what = f"{dispatcher} {dtype} rank {rank}"
        assert_parity(out, ref_out, reduction_len=BLOCK_LEN, msg=f"{what} output")
        assert_parity(x_grad, ref_x_grad, reduction_len=BLOCK_LEN, msg=f"{what} input grad")
        assert_parity(grads["gate.weight"], ref_grads["gate.weight"], reduction_len=S * BLOCK_LEN, msg=f"{what} gate")
        assert dropped == ref_aux.num_dropped.item() and torch.equal(tokens, ref_aux.tokens_per_expert), what
        group = [r for r in range(world_size) if r // ep == rank // ep]
        lo = (rank % ep) * per
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            expected = sum(refs[r][2][name][lo : lo + per] for r in group)
            assert_parity(grads[name], expected, reduction_len=ep * S * BLOCK_LEN, msg=f"{what} {name}")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,ep,case,dtype,where,backend",
    [
        (2, 2, "random", torch.float64, "bare", "auto"),
        (4, 2, "skewed", torch.float64, "model", "auto"),
        (4, 4, "capacity", torch.float64, "bare", "auto"),
        (2, 2, "random", torch.float32, "model", "auto"),  # the grouped GEMM kernels
        (4, 2, "deepseek", torch.float64, "bare", "auto"),  # sigmoid scores, group-limited routing, scaled weights
        (4, 2, "capacity", torch.float32, "bare", "triton"),  # the Triton kernels (interpreted) on local experts
    ],
    ids=["2-2-random-f64-bare", "4-2-skewed-f64-model", "4-4-capacity-f64-bare", "2-2-random-f32-model",
         "4-2-deepseek-f64-bare", "4-2-capacity-f32-triton"],
)  # fmt: skip
def test_expert_parallel_matches_single_device_per_rank(world_size, ep, case, dtype, where, backend):
    """Both dispatchers equal the unsharded block: outputs, input/router grads, and summed expert-slice grads.

    Cases: random routing; a routing where one EP rank receives no token; capacity factor 1.0 with drops;
    DeepSeek-V3's router (sigmoid scores, 4 groups keep 2, renormalised weights scaled by 2.5); in
    float64 (bound ~1e-13 relative) and, for random routing, in float32 through the grouped GEMM kernels; with
    drops, in float32 through the Triton kernels (``experts_backend="triton"``) against the grouped GEMM reference.
    ``apply_expert_parallel`` is given the bare block, or a model holding it (2 and 4 processes each).
    """
    refs = [_step(_block(case, dtype), *_batch(r, case, dtype)) for r in range(world_size)]
    for dispatcher in ("allgather", "alltoall"):
        results = run_pooled_test(
            _ep_run, world_size, ep=ep, dispatcher=dispatcher, case=case, dtype=dtype, where=where,
            experts_backend=backend, timeout=120,
        )  # fmt: skip
        _check_ep(results, refs, world_size, ep, dispatcher, dtype)
    if case == "skewed":
        assert all(r[2]["experts.gate_up_proj"][E // 2 :].abs().sum() == 0 for r in refs)  # rank 1 really idles
    if case == "capacity":
        assert sum(r[3].num_dropped.item() for r in refs) > 0


@pytest.mark.distributed
@pytest.mark.parametrize("bug", ["dropped_token", "world_group"])
def test_parity_check_catches_injected_bugs(bug):
    """A token dropped from dispatch, or dispatch and combine over the world instead of the EP group (DP=2 x EP=2),
    fails the float64 parity check of the test above: its tolerance is tight enough to see real bugs."""
    world_size, ep, dtype = 4, 2, torch.float64
    refs = [_step(_block("random", dtype), *_batch(r, "random", dtype)) for r in range(world_size)]
    kwargs = dict(ep=ep, dispatcher="allgather", case="random", dtype=dtype, timeout=120)
    _check_ep(run_pooled_test(_ep_run, world_size, **kwargs), refs, world_size, ep, "allgather", dtype)
    results = run_pooled_test(_ep_run, world_size, bug=bug, **kwargs)
    with pytest.raises(AssertionError):
        _check_ep(results, refs, world_size, ep, "allgather", dtype)


def _ledger_run(rank, world_size):
    topo = build_topology(world_size)
    block = apply_expert_parallel(_block("random", torch.float32), topo.ep_group, "allgather")
    x, w = _batch(rank, "random", torch.float32)
    with CommLedger() as ledger:
        _step(block, x, w)
    return [(r.op, r.tag, r.phase, r.bytes_sent) for r in ledger.records]


@pytest.mark.distributed
def test_allgather_dispatch_bytes_equal_the_closed_form():
    """One forward+backward of the all-gather dispatcher sends exactly the ring bytes of the module docstring."""
    d, s = 2, 15
    records = run_pooled_test(_ledger_run, d)[0]
    got = {(tag, phase): sent for _, tag, phase, sent in records}
    x, w, idx = s * H * 4, s * K * 4, s * K * 8
    expected = {
        ("moe.token_count", None): ring_bytes_sent("all_gather", d, 8 * (1 + d)),  # S and pairs per EP rank
        ("moe.dispatch.x", "forward"): (d - 1) * x,
        ("moe.dispatch.w", "forward"): (d - 1) * w,
        ("moe.dispatch.idx", None): (d - 1) * idx,
        ("moe.combine", "forward"): (d - 1) * (d * x) // d,
        ("moe.combine", "backward"): (d - 1) * x,
        ("moe.dispatch.x", "backward"): (d - 1) * (d * x) // d,
        ("moe.dispatch.w", "backward"): (d - 1) * (d * w) // d,
    }
    assert got == expected


def _reads_run(rank, world_size, dispatcher, case):
    import os

    topo = build_topology(world_size)
    block = apply_expert_parallel(_block(case), topo.ep_group, dispatcher)
    x, w = _batch(rank, case)
    _step(block, x, w)  # warm-up
    with counting_host_reads() as reads:
        _step(block, x, w)
    sites = {(name, os.path.basename(where.rsplit(":", 1)[0])): n for (name, where), n in reads.sites.items()}
    sites.pop(("tolist", "experts.py"), None)  # moe/experts.py: the CPU experts' group sizes (on the device elsewhere)
    return sites


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["random", "capacity"])
def test_one_host_read_per_dispatch(case):
    """A forward and backward of an expert-parallel block (2 ranks, EP = 2) reads tensor values back to the host
    once, for either transport, with and without capacity drops: the all-gather dispatcher's count exchange (which
    also sizes the dispatch plan: no read of its routed-row count, no boolean-mask select) and the all-to-all
    dispatcher's split sizes, sent and received, read together (no bincount). On an accelerator every read drains
    the kernel queue."""
    for dispatcher, site in (("allgather", "token_dispatchers.py"), ("alltoall", "collectives.py")):
        for rank, sites in enumerate(run_pooled_test(_reads_run, 2, dispatcher=dispatcher, case=case)):
            assert sites == {("tolist", site): 1}, (dispatcher, rank, sites)


def _unequal_tokens(rank, world_size):
    topo = build_topology(world_size)
    block = apply_expert_parallel(_block("random"), topo.ep_group, "allgather")
    block(torch.randn(1, 4 + rank, H))


@pytest.mark.distributed
def test_bad_input_is_named():
    """EP size not dividing num_experts or the world size, and unequal token counts under all-gather, are named."""
    with pytest.raises(DistributedTestError, match=r"\[4, 5\]"):
        run_pooled_test(_unequal_tokens, 2)
    with pytest.raises(DistributedTestError) as err:
        run_pooled_test(_bad_sizes, 3)
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


def _reapply(rank, world_size):
    import torch.distributed as dist

    topo = build_topology(world_size)
    block = apply_expert_parallel(_block("random"), topo.ep_group, "allgather")
    slice_before = block.experts.gate_up_proj.detach().clone()
    apply_expert_parallel(block, topo.ep_group, "alltoall")  # same group: only the transport changes
    swapped = (block.dispatcher.name, torch.equal(block.experts.gate_up_proj, slice_before))
    other = dist.new_group(list(range(world_size)))
    try:
        apply_expert_parallel(block, other, "alltoall")
        other_group = "accepted"
    except ValueError as e:
        other_group = str(e)
    wrong = _block("random")
    wrong.experts.expert_range = (0, E // world_size) if rank else (E // world_size, E)
    for p in (wrong.experts.gate_up_proj, wrong.experts.down_proj):
        p.data = p.data[: E // world_size].clone()
    try:
        apply_expert_parallel(wrong, topo.ep_group)
        wrong_slice = "accepted"
    except ValueError as e:
        wrong_slice = str(e)
    return swapped, other_group, wrong_slice


@pytest.mark.distributed
def test_reapplying_swaps_the_transport_and_refuses_foreign_layouts():
    """Applying expert parallelism again over the same group swaps the dispatcher and keeps the expert slice; over
    another group, or onto an expert slice that is not this rank's, it is refused with the values named."""
    for rank, (swapped, other_group, wrong_slice) in enumerate(run_pooled_test(_reapply, 2)):
        assert swapped == ("alltoall", True)
        assert "already expert parallel over another process group" in other_group
        assert f"expected all {E} or this EP rank's {E // 2} experts [{rank * E // 2}, {(rank + 1) * E // 2}]" in (
            wrong_slice
        )
