"""ShardedAdamW (EPSO / SO / DDP modes) against torch.optim.AdamW on the same reduced gradients.

Each rank holds the non-expert parameters in full and its EP slice of the expert parameters, and feeds
gradients that are distinct per rank and per step, so a reduction over the wrong group (or a wrong divisor)
changes the result. The reference in the test process sums those gradients exactly as the semantics say
(non-expert: over all ranks; expert slice j: over the ranks with ep_rank j; both divided by DP*EP) and runs
torch.optim.AdamW with torch's own global-norm clipping. Both sides run in float64 and are compared with
:func:`mula_lightning.testing.assert_parity`.
"""

import zlib

import pytest
import torch
from torch import nn

from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import adamw_parameter_scale, assert_parity, no_host_reads, run_pooled_test

E = 4
SHAPES = {"embed.weight": (7, 5), "attn.norm.weight": (5,), "layers.0.mlp.gate.weight": (E, 5)}
EXPERT_SHAPES = {"layers.0.mlp.experts.gate_up_proj": (E, 6, 5), "layers.0.mlp.experts.down_proj": (E, 5, 3)}
HP = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8)
DTYPE = torch.float64


def _full_params(dtype=DTYPE):
    g = torch.Generator().manual_seed(0)
    shapes = {**SHAPES, **EXPERT_SHAPES}
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in shapes.items()}


def _grad(name, shape, step, rank, dtype=DTYPE):
    g = torch.Generator().manual_seed(zlib.crc32(repr((name, step, rank)).encode()))
    return torch.randn(shape, generator=g, dtype=dtype) * (1 + rank)  # distinct per rank and step


class _Model(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.names = list(params)
        for i, t in enumerate(params.values()):
            self.register_parameter(f"p{i}", nn.Parameter(t.clone()))

    def named_parameters(self, *args, **kwargs):  # expose the dotted names the optimizer classifies by
        for n, (_, p) in zip(self.names, super().named_parameters(*args, **kwargs)):
            yield n, p


def _slice(t, ep_rank, ep):
    per = E // ep
    return t[ep_rank * per : (ep_rank + 1) * per]


def _run_modes(
    rank, world_size, ep, steps, max_norm, accumulate, modes, bucket_numel, dtype=DTYPE, unused=(), sync_every=False
):
    topo = build_topology(ep)
    results = {}
    for mode in modes:
        full = _full_params(dtype)
        local = {n: (_slice(t, topo.ep_rank, ep) if n in EXPERT_SHAPES else t) for n, t in full.items()}
        model = _Model(local)
        params = dict(model.named_parameters())
        groups = [
            {"params": [p for n, p in params.items() if not n.endswith("norm.weight")], "weight_decay": 0.1},
            {"params": [p for n, p in params.items() if n.endswith("norm.weight")], "weight_decay": 0.0},
        ]
        opt = ShardedAdamW(model, topo, mode, param_groups=groups, bucket_numel=bucket_numel, **HP)
        for step in range(steps):
            for micro in range(accumulate):
                opt.require_grad_sync = sync_every or micro == accumulate - 1
                loss = sum(
                    (p * _grad(n, p.shape, (step, micro), rank, dtype)).sum() / accumulate
                    for n, p in params.items()
                    if (step, n) not in unused  # a parameter the step does not use gets no gradient at all
                )
                loss.backward()
            if max_norm is not None:
                with no_host_reads():
                    opt.clip_grad_norm_(max_norm)
            opt.step()
        results[mode] = ({n: p.detach().clone() for n, p in params.items()}, opt.state_bytes())
    return results


def _reference(world_size, ep, steps, max_norm, accumulate, unused=()):
    full = {n: nn.Parameter(t.clone()) for n, t in _full_params().items()}
    no_decay = [p for n, p in full.items() if n.endswith("norm.weight")]
    decay = [p for n, p in full.items() if not n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], **HP)
    for step in range(steps):
        for n, p in full.items():
            total = torch.zeros_like(p)
            for rank in range(world_size):
                for micro in range(accumulate):
                    if (step, n) in unused:  # no gradient: zero, as the sharded optimizer reduces it
                        continue
                    g = _grad(n, _slice(p, rank % ep, ep).shape if n in EXPERT_SHAPES else p.shape, (step, micro), rank)
                    g = g / accumulate
                    if n in EXPERT_SHAPES:
                        _slice(total, rank % ep, ep).add_(g)
                    else:
                        total.add_(g)
            p.grad = total / world_size
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(full.values()), max_norm)
        opt.step()
    return {n: p.detach() for n, p in full.items()}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,ep,accumulate,bucket_numel",
    [(4, 2, 1, None), (4, 2, 2, 64), (8, 4, 1, 50)],
)
def test_every_mode_matches_torch_adamw_on_reduced_gradients(world_size, ep, accumulate, bucket_numel):
    """After 4 clipped AdamW steps, every rank's parameters equal torch.optim.AdamW on the correctly reduced grads.

    Covers DP=2 x EP=2 and DP=2 x EP=4, one and several buckets (with padding), two param groups (no decay on
    norms), gradient accumulation (reduce once per step), and clipping that fires on every step and reads no value
    back to the host (``Tensor.item`` / ``tolist`` raise inside ``clip_grad_norm_``).
    """
    steps, max_norm = 4, 0.5
    modes = ("ep_aware", "dp", "none")
    results = run_pooled_test(
        _run_modes,
        world_size,
        ep=ep,
        steps=steps,
        max_norm=max_norm,
        accumulate=accumulate,
        modes=modes,
        bucket_numel=bucket_numel,
        timeout=180,
    )
    ref = _reference(world_size, ep, steps, max_norm, accumulate)
    # Rounded operations per element and step: the sum over ranks and micro-batches, and the clipping norm's sum of
    # squares over every element; each step builds on the previous ones.
    numel = sum(torch.Size(s).numel() for s in {**SHAPES, **EXPERT_SHAPES}.values())
    reduction_len = steps * (world_size * accumulate + numel)
    adam_scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=max_norm, eps=HP["eps"])  # Adam's 1/eps amplification
    for rank, per_mode in enumerate(results):
        for mode in modes:
            params, _ = per_mode[mode]
            for n, p in params.items():
                expected = _slice(ref[n], rank % ep, ep) if n in EXPERT_SHAPES else ref[n]
                scale = adam_scale + expected.abs().max().item()
                assert_parity(p, expected, reduction_len=reduction_len, scale=scale, msg=f"rank {rank} {mode} {n}")


@pytest.mark.distributed
def test_several_backwards_with_sync_on_accumulate_as_in_ddp():
    """Three backwards per step with synchronisation on in every one (no ``no_backward_sync``, as DDP and FSDP
    allow, and as repeated ``manual_backward`` calls do) give the parameters of one reduction per step over the
    summed micro-batches, in every mode, with one bucket and several, with clipping, and with a parameter unused in
    some micro-batches' steps. Before the fix the first backward launched each bucket's reduction and the later ones
    were lost (the parameters moved by the first micro-batch alone)."""
    steps, unused = 3, ((1, "attn.norm.weight"), (2, "layers.0.mlp.experts.down_proj"))
    modes = ("ep_aware", "dp", "none")
    for bucket_numel in (None, 50):
        results = run_pooled_test(_run_modes, 4, ep=2, steps=steps, max_norm=0.5, accumulate=3, modes=modes,
                                  bucket_numel=bucket_numel, unused=unused, sync_every=True, timeout=180)  # fmt: skip
        ref = _reference(4, 2, steps, 0.5, 3, unused)
        numel = sum(torch.Size(s).numel() for s in {**SHAPES, **EXPERT_SHAPES}.values())
        scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=0.5, eps=HP["eps"])
        for rank, per_mode in enumerate(results):
            for mode in modes:
                for n, p in per_mode[mode][0].items():
                    expected = _slice(ref[n], rank % 2, 2) if n in EXPERT_SHAPES else ref[n]
                    assert_parity(p, expected, reduction_len=steps * (4 * 3 + numel),
                                  scale=scale + expected.abs().max().item(), msg=f"rank {rank} {mode} {n}")  # fmt: skip


def _bf16_accumulation(rank, world_size, micro_batches):
    topo = build_topology(1)
    model = _Model(_full_params(torch.bfloat16))
    params = dict(model.named_parameters())
    opt = ShardedAdamW(model, topo, "ep_aware", bucket_numel=50, **HP)
    for micro in range(micro_batches):
        opt.require_grad_sync = micro == micro_batches - 1
        sum((p * _grad(n, p.shape, micro, rank, torch.bfloat16)).sum() for n, p in params.items()).backward()
    opt.finish_grad_sync()
    return opt.owned_gradient_segments()


@pytest.mark.distributed
def test_bf16_parameters_accumulate_and_receive_gradients_in_float32():
    """bf16 parameters (bf16-true): 64 micro-batches of bf16 gradients accumulate and are reduced over 2 ranks in
    float32 buffers, so every owned gradient element equals the exact mean (float64) within float32 rounding of a
    sum of 128 terms. With bf16 buffers (before) each accumulation and the copy of the float32-reduced shard back
    rounded to bf16: errors of about 4e-3 relative, far outside this bound."""
    micro_batches, world = 64, 2
    results = run_pooled_test(_bf16_accumulation, world, micro_batches=micro_batches, timeout=120)
    full = _full_params(torch.bfloat16)
    exact = {n: torch.zeros(t.numel(), dtype=torch.float64) for n, t in full.items()}
    for n, t in full.items():
        for rank in range(world):
            for micro in range(micro_batches):
                exact[n] += _grad(n, t.shape, micro, rank, torch.bfloat16).double().reshape(-1) / world
    covered = dict.fromkeys(full, 0)
    for segments in results:
        for name, offset, values in segments:
            expected = exact[name][offset : offset + values.numel()].float()
            assert_parity(values, expected, reduction_len=2 * micro_batches * world, msg=f"{name} at {offset}")
            covered[name] += values.numel()
    assert covered == {n: t.numel() for n, t in full.items()}


@pytest.mark.distributed
def test_a_parameter_without_gradient_in_a_step_reduces_zero_not_an_earlier_gradient():
    """Parameters that a step does not use (a dense one and an expert one, used in the steps before and after) get a
    zero gradient in that step on every rank, as torch.optim.AdamW with zero gradients: the flat buffers are not
    zeroed between steps (each parameter's first gradient overwrites its slot), so a slot no gradient reached must be
    zeroed before its bucket is reduced, in one bucket and in several."""
    steps, unused = 3, ((1, "attn.norm.weight"), (1, "layers.0.mlp.experts.down_proj"), (2, "embed.weight"))
    for bucket_numel in (None, 50):
        results = run_pooled_test(_run_modes, 4, ep=2, steps=steps, max_norm=None, accumulate=1, modes=("ep_aware",),
                                  bucket_numel=bucket_numel, unused=unused, timeout=180)  # fmt: skip
        ref = _reference(4, 2, steps, None, 1, unused)
        numel = sum(torch.Size(s).numel() for s in {**SHAPES, **EXPERT_SHAPES}.values())
        for rank, per_mode in enumerate(results):
            for n, p in per_mode["ep_aware"][0].items():
                expected = _slice(ref[n], rank % 2, 2) if n in EXPERT_SHAPES else ref[n]
                scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=10.0, eps=HP["eps"]) + expected.abs().max().item()
                assert_parity(p, expected, reduction_len=steps * (4 + numel), scale=scale, msg=f"rank {rank} {n}")


def _owned(numel_by_family_shard):
    return sum(-(-n // g) for n, g in numel_by_family_shard)


@pytest.mark.distributed
def test_state_bytes_follow_the_formula():
    """Optimizer-state bytes per rank = 8 per owned element of float32 parameters (padding included): SO keeps
    non-expert states EP times."""
    world_size, ep = 4, 2
    results = run_pooled_test(
        _run_modes,
        world_size,
        ep=ep,
        steps=1,
        max_norm=None,
        accumulate=1,
        modes=("ep_aware", "dp", "none"),
        bucket_numel=None,
        dtype=torch.float32,
        timeout=120,
    )
    dp = world_size // ep
    # one bucket per family; each param group is laid out in the same bucket
    p_ne = sum(torch.Size(s).numel() for s in SHAPES.values())
    p_e_local = sum(torch.Size(s).numel() for s in EXPERT_SHAPES.values()) // ep
    expected = {
        "ep_aware": 8 * (_owned([(p_ne, world_size)]) + _owned([(p_e_local, dp)])),
        "dp": 8 * (_owned([(p_ne, dp)]) + _owned([(p_e_local, dp)])),
        "none": 8 * (p_ne + p_e_local),
    }
    for per_mode in results:
        for mode, (_, nbytes) in per_mode.items():
            assert nbytes == expected[mode], (mode, nbytes, expected[mode])
    assert expected["ep_aware"] < expected["dp"] < expected["none"]


def test_moments_are_allocated_at_first_use():
    """In one process: building the optimizer allocates no moments (as torch's AdamW), yet their keys are listed and
    counted in state_bytes; the first step allocates them and the update equals torch's AdamW."""
    params = _full_params()
    model = _Model(params)
    opt = ShardedAdamW(model, build_topology(1), "ep_aware", bucket_numel=None, **HP, weight_decay=0.0)
    for state in opt.shards.values():
        assert state.allocated() == [] and sorted(state) == ["exp_avg", "exp_avg_sq"]
    numel = sum(buf.owned_numel for buf in opt.buffers.values())
    assert opt.state_bytes() == 16 * numel  # float64: 2 moments x 8 bytes per owned element
    ref = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    torch_opt = torch.optim.AdamW(ref.values(), **HP, weight_decay=0.0)
    grads = {n: _grad(n, p.shape, 0, 0) for n, p in model.named_parameters()}
    sum((p * grads[n]).sum() for n, p in model.named_parameters()).backward()
    for n, g in grads.items():
        ref[n].grad = g
    opt.step()
    torch_opt.step()
    assert all(sorted(s.allocated()) == ["exp_avg", "exp_avg_sq"] for s in opt.shards.values())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-12, atol=1e-12, msg=n)


def _tensor_parallel_state(rank, world_size, mode):
    from torch.distributed.tensor import Shard, distribute_tensor

    topo = build_topology(1, tp_size=2)  # 4 ranks: TP=2 x DP=2
    model = nn.Module()
    model.norm = nn.Parameter(torch.randn(10, dtype=DTYPE))
    model.attn = nn.Parameter(distribute_tensor(torch.randn(7, 6, dtype=DTYPE), topo.tp_mesh, [Shard(1)]))
    opt = ShardedAdamW(model, topo, mode, bucket_numel=None, **HP)
    return {fam: buf.numel for fam, buf in opt.buffers.items()}, opt.state_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ep_aware", "none"])
def test_tensor_parallel_weights_take_their_local_shard_in_the_buffers(mode):
    """TP=2 x DP=2: a DTensor weight of 7 x 6 sharded over tp holds its 7 x 3 local shard in the flat buffer (21
    elements, padded to the 2 dense data-parallel ranks under ep_aware), a replicated one its 10 elements (padded to
    the 4 ranks); the moments are 2 x 8 bytes per owned element: nothing of the other tp rank's shard is kept."""
    for numels, nbytes in run_pooled_test(_tensor_parallel_state, 4, mode=mode):
        if mode == "ep_aware":
            assert numels == {"non_expert": 12, "tensor_parallel": 22}
            assert nbytes == 2 * 8 * (12 // 4 + 22 // 2)
        else:
            assert numels == {"non_expert": 10, "tensor_parallel": 21}
            assert nbytes == 2 * 8 * (10 + 21)


def _norms(rank, world_size, ep, bucket_numel):
    """The global norm taken twice (logging, then clipping) and after clipping, with the all-reduces each took."""
    import mula_lightning.parallel.sharded_optimizer as sharded

    topo = build_topology(ep)
    full = _full_params()
    model = _Model({n: (_slice(t, topo.ep_rank, ep) if n in EXPERT_SHAPES else t) for n, t in full.items()})
    params = dict(model.named_parameters())
    opt = ShardedAdamW(model, topo, "ep_aware", bucket_numel=bucket_numel, **HP)
    sum(((p * _grad(n, p.shape, (0, 0), rank)).sum() for n, p in params.items())).backward()
    opt.finish_grad_sync()
    calls = []
    all_reduce = sharded.dist.all_reduce
    sharded.dist.all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
    try:
        first, second = opt.owned_grad_norm(), opt.owned_grad_norm()
        before_clip = len(calls)
        clipped = opt.clip_grad_norm_(0.5 * first.item())
        after = opt.owned_grad_norm()
    finally:
        sharded.dist.all_reduce = all_reduce
    return first.item(), second.item(), clipped.item(), after.item(), before_clip, len(calls)


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_numel", [None, 20])
def test_global_norm_is_reduced_once_until_the_gradients_change(bucket_numel):
    """4 ranks, EP=2, one bucket or many: the global gradient norm equals the norm of the summed gradients (float64);
    asked twice (logged, then clipped by) it costs one all-reduce; clipping changes the gradients, so the next norm
    is taken again (one more all-reduce) and is the clipped value, half the first."""
    results = run_pooled_test(_norms, 4, ep=2, bucket_numel=bucket_numel, timeout=120)
    squares = 0.0
    for n, p in _full_params().items():
        total = torch.zeros_like(p)
        for rank in range(4):
            g = _grad(n, _slice(p, rank % 2, 2).shape if n in EXPERT_SHAPES else p.shape, (0, 0), rank)
            (_slice(total, rank % 2, 2) if n in EXPERT_SHAPES else total).add_(g)
        squares += (total / 4).pow(2).sum().item()
    expected = squares**0.5
    for first, second, clipped, after, before_clip, calls in results:
        assert first == second == clipped
        assert first == pytest.approx(expected, rel=1e-12)
        assert after == pytest.approx(0.5 * expected, rel=1e-6)  # torch's clip coefficient: max / (norm + 1e-6)
        assert (before_clip, calls) == (1, 2)


def _bf16_reduction(rank, world_size, ep, mode, reduce_dtype):
    from mula_lightning.parallel.sharded_optimizer import COPIES_IN_FLIGHT

    topo = build_topology(ep)
    full = _full_params(torch.float32)
    model = _Model({n: (_slice(t, topo.ep_rank, ep) if n in EXPERT_SHAPES else t) for n, t in full.items()})
    params = dict(model.named_parameters())
    opt = ShardedAdamW(model, topo, mode, bucket_numel=12, reduce_dtype=reduce_dtype, **HP)
    in_flight = []
    for n, p in reversed(params.items()):  # one parameter at a time: buckets launch as backward reaches them
        (p * _grad(n, p.shape, 0, rank, torch.float32)).sum().backward()
        in_flight.append(sum(work is not None for work, _ in opt._pending.values()))
    launched = len(opt._pending)
    opt.finish_grad_sync()
    return in_flight, launched, COPIES_IN_FLIGHT, opt.owned_gradient_segments()


@pytest.mark.distributed
@pytest.mark.parametrize("mode, reduce_dtype", [("ep_aware", torch.bfloat16), ("dp", torch.bfloat16),
                                               ("none", torch.bfloat16), ("ep_aware", torch.float32)])  # fmt: skip
def test_reductions_keep_a_bounded_number_of_bucket_copies_in_flight(mode, reduce_dtype):
    """With ``reduce_dtype=bfloat16`` each bucket is reduced from a bf16 copy of its float32 gradients (and gloo's
    emulated reduce-scatter receives into a copy of any bucket), which the launched collective holds until it is
    waited for: at most ``COPIES_IN_FLIGHT`` are in flight at any time of the backward (4 ranks, EP 2, buckets of 12
    elements: many more buckets than that), and every rank's reduced shard still equals the mean of the ranks'
    gradients (to bf16's precision)."""
    results = run_pooled_test(_bf16_reduction, 4, ep=2, mode=mode, reduce_dtype=reduce_dtype, timeout=120)
    mean = {}  # every family divides by W = 4; an expert slice sums the ranks of its EP index
    for name, t in _full_params(torch.float64).items():
        if name in EXPERT_SHAPES:
            parts = [sum(_grad(name, _slice(t, j, 2).shape, 0, r, torch.float32).double() for r in range(j, 4, 2))
                     for j in range(2)]  # fmt: skip
            mean[name] = torch.cat(parts) / 4
        else:
            mean[name] = sum(_grad(name, t.shape, 0, r, torch.float32).double() for r in range(4)) / 4
    for in_flight, launched, bound, segments in results:
        assert max(in_flight) <= bound < launched, (in_flight, launched)
        assert segments
        for name, offset, values in segments:  # offsets into the whole flattened parameter
            expected = mean[name].reshape(-1)[offset : offset + values.numel()]
            scale = mean[name].abs().max().item()
            torch.testing.assert_close(values.double(), expected, rtol=2**-6, atol=2**-6 * scale)
