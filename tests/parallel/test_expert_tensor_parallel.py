"""Expert tensor parallelism (Megatron's ETP) of FastSparseMoE against the single-device block.

Each expert's intermediate dimension is split over ``etp`` consecutive ranks of the expert group (EP x ETP ranks);
the all-gather dispatcher gathers every group rank's tokens and its reduce-scatter sums the partial down
projections. Every rank feeds its own micro-batch; the reference runs the unsharded block on each one separately.
Outputs, input and router gradients must match per rank; a rank's expert gradient (its experts, its part of the
intermediate dimension) must equal that part of the sum of the reference gradients over its expert group's ranks
(the part saw all of the group's tokens). In float64, with the tight rule of :func:`assert_parity`.
"""

import pytest
import torch

from mula_lightning.models import MulaConfig
from mula_lightning.moe import FastSparseMoEBlock, ReferenceMoEBlock
from mula_lightning.parallel.expert_parallel import (
    apply_expert_parallel,
    expert_tensor_parallel_slice,
    gather_expert_parallel_state_dict,
)
from mula_lightning.testing import assert_parity, run_pooled_test

H, E, K, FF = 16, 4, 2, 12  # FF: expert intermediate size
S = 15  # tokens per rank
BLOCK_LEN = H + 2 * FF + E + K
DTYPE = torch.float64


def _config(**overrides):
    sizes = dict(hidden_size=H, num_heads=2, num_kv_heads=2, intermediate_size=FF, num_experts=E, top_k=K)
    return MulaConfig.from_name("mula-tiny-moe", **{**sizes, "moe_impl": "fast", **overrides})


def _block(dtype=DTYPE, backend="auto"):
    torch.manual_seed(0)
    block = FastSparseMoEBlock(_config(experts_backend=backend)).to(DTYPE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block.to(dtype)  # drawn in float64 whatever the run's dtype: the same weights, rounded


def _batch(rank, dtype=DTYPE):
    g = torch.Generator().manual_seed(100 + rank)
    x, w = torch.randn(3, 5, H, generator=g, dtype=DTYPE), torch.randn(3, 5, H, generator=g, dtype=DTYPE)
    return x.to(dtype), w.to(dtype)


def _step(block, x, weights):
    x = x.clone().requires_grad_(True)
    out, aux = block.forward_with_aux(x)
    ((out * weights).sum() + aux.aux_loss).backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _etp_rank(rank, world_size, ep, etp, dtype=DTYPE, experts_backend="auto"):
    from mula_lightning.parallel.mesh import ParallelDims, build_parallel_mesh

    mesh = build_parallel_mesh(ParallelDims(world_size, ep=ep, etp=etp))
    group = mesh.expert_group()
    block = apply_expert_parallel(_block(dtype, experts_backend), group, "allgather", etp_size=etp)
    shapes = (tuple(block.experts.gate_up_proj.shape), tuple(block.experts.down_proj.shape))
    full = {k: v.clone() for k, v in gather_expert_parallel_state_dict(block, group, etp).items()}
    out, x_grad, grads = _step(block, *_batch(rank, dtype))
    return out, x_grad, grads, shapes, full, mesh.ranks("edp")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "ep,etp,backend",
    [(2, 2, "auto"), (1, 2, "auto"), (1, 4, "auto"), (2, 2, "triton")],
    ids=["ep2-etp2", "ep1-etp2-edp2", "ep1-etp4", "ep2-etp2-triton"],
)
def test_expert_tensor_parallel_matches_single_device_per_rank(ep, etp, backend):
    """4 ranks: EP=2 x ETP=2 (one expert group of all ranks), ETP=2 x EDP=2 (two groups) and ETP=4: each rank holds
    E/EP experts with I/ETP of their intermediate size; outputs, input and router gradients equal the unsharded
    block's on each rank's micro-batch; expert gradients equal their part of the reference gradients summed over
    the expert group; the gathered state dict is the original block's. Also with the Triton experts (float32 under
    the interpreter, against the float64 reference: each rank's partial down projection carries the router weight)."""
    world = 4
    dtype = torch.float32 if backend == "triton" else DTYPE
    refs = [_step(_block(), *_batch(r)) for r in range(world)]
    original = _block(dtype).state_dict()
    per, part = E // ep, FF // etp

    def close(actual, expected, **kwargs):  # the run's dtype against the float64 reference
        assert_parity(actual.to(expected.dtype), expected, dtype=dtype, **kwargs)

    for rank, (out, x_grad, grads, shapes, full, _) in enumerate(
        run_pooled_test(_etp_rank, world, ep=ep, etp=etp, dtype=dtype, experts_backend=backend, timeout=120)
    ):
        assert shapes == ((per, 2 * part, H), (per, H, part))
        assert full.keys() == original.keys() and all(torch.equal(full[k], v) for k, v in original.items())
        ref_out, ref_x_grad, ref_grads = refs[rank]
        close(out, ref_out, reduction_len=BLOCK_LEN, msg=f"rank {rank} output")
        close(x_grad, ref_x_grad, reduction_len=BLOCK_LEN, msg=f"rank {rank} input grad")
        close(grads["gate.weight"], ref_grads["gate.weight"], reduction_len=S * BLOCK_LEN, msg="gate")
        size = ep * etp
        group = range(rank // size * size, rank // size * size + size)
        ep_rank, etp_rank = rank % size // etp, rank % etp
        rows = slice(ep_rank * per, (ep_rank + 1) * per)
        summed_gate_up = sum(refs[r][2]["experts.gate_up_proj"] for r in group)[rows]
        summed_down = sum(refs[r][2]["experts.down_proj"] for r in group)[rows]
        expected = expert_tensor_parallel_slice(summed_gate_up, summed_down, etp_rank, etp)
        bound = size * S * BLOCK_LEN
        close(grads["experts.gate_up_proj"], expected[0], reduction_len=bound, msg=f"rank {rank} gate_up")
        close(grads["experts.down_proj"], expected[1], reduction_len=bound, msg=f"rank {rank} down")


def test_slice_keeps_gate_and_up_parts_side_by_side():
    """Part t of the intermediate dimension takes rows [tI/ETP, (t+1)I/ETP) of the gate half and of the up half of
    gate_up (gate part first), and those columns of down."""
    gate_up = torch.arange(2 * 6 * 2, dtype=torch.float64).reshape(1, 12, 2)
    down = torch.arange(2 * 6, dtype=torch.float64).reshape(1, 2, 6)
    part_gate_up, part_down = expert_tensor_parallel_slice(gate_up, down, 1, 3)
    assert torch.equal(part_gate_up[0, :, 0], torch.tensor([4.0, 6.0, 16.0, 18.0]))
    assert torch.equal(part_down, down[:, :, 2:4])


def _bad_rank(rank, world_size, case):
    from mula_lightning.parallel.mesh import ParallelDims, build_parallel_mesh

    group = build_parallel_mesh(ParallelDims(world_size, etp=2)).expert_group()
    if case == "reference":
        block = ReferenceMoEBlock(_config(moe_impl="reference"))
        apply_expert_parallel(torch.nn.ModuleDict({"mlp": block}), group, "allgather", etp_size=2)
    elif case == "alltoall":
        apply_expert_parallel(_block(), group, "alltoall", etp_size=2)
    else:
        block = FastSparseMoEBlock(_config(intermediate_size=13))
        apply_expert_parallel(block, group, "allgather", etp_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case,fragment",
    [
        ("reference", "mlp: expert tensor parallelism needs FastSparseMoEBlock (moe_impl='fast'), not Reference"),
        ("alltoall", "dispatcher='alltoall' with etp_size (2) > 1 is not supported"),
        ("intermediate", "the experts' intermediate size (13) must be divisible by etp_size (2)"),
    ],
)
def test_expert_tensor_parallelism_that_cannot_work_is_named(case, fragment):
    """The reference block, the all-to-all dispatcher and an intermediate size etp does not divide each raise one
    ValueError naming the values."""
    from mula_lightning.testing import DistributedTestError

    with pytest.raises(DistributedTestError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        run_pooled_test(_bad_rank, 2, case=case, timeout=60)
