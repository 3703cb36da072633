"""Logical-key DCP checkpoints of a DP x EP model and its ShardedAdamW: save at one layout, resume at another.

Phase 1 trains 3 steps at DP=2 x EP=2 (EPSO) with per-rank-distinct gradients and saves. Phase 2 starts from
zeroed parameters at another layout (or mode, or one process), loads, and trains 2 more steps with gradients
that are the same on every rank. The result must equal torch.optim.AdamW run straight through on the reduced
gradients: so the weights, both Adam moments and the step count all survived the reshard. Everything runs in float64
(the optimizer-state pieces carry float64) and is compared with :func:`mula_lightning.testing.assert_parity`.
"""

import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
from mula_lightning.parallel.state_dict import apply_optimizer_state_dict, model_state_dict, optimizer_state_dict
from mula_lightning.parallel.topology import build_topology
from mula_lightning.testing import adamw_parameter_scale, assert_parity, run_pooled_test

E = 4
SHAPES = {
    "embed.weight": (7, 5),
    "norm.weight": (5,),
    "mlp.experts.gate_up_proj": (E, 6, 5),
    "mlp.experts.down_proj": (E, 5, 3),
}
HP = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
DTYPE = torch.float64
NUMEL = sum(torch.Size(s).numel() for s in SHAPES.values())


class _Toy(nn.Module):
    """Parameters with the dotted names the optimizer classifies (``experts`` ones are EP-sliced)."""

    def __init__(self, ep_rank: int, ep: int, fill: float | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.randn(SHAPES["embed.weight"], generator=g, dtype=DTYPE))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.randn(SHAPES["norm.weight"], generator=g, dtype=DTYPE))
        self.mlp = nn.Module()
        self.mlp.experts = nn.Module()
        per = E // ep
        for n in ("gate_up_proj", "down_proj"):
            full = torch.randn(SHAPES[f"mlp.experts.{n}"], generator=g, dtype=DTYPE)
            self.mlp.experts.register_parameter(n, nn.Parameter(full[ep_rank * per : (ep_rank + 1) * per].clone()))
        if fill is not None:
            with torch.no_grad():
                for p in self.parameters():
                    p.fill_(fill)


def _grad(name, shape, step, rank):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, step, rank)).encode()))
    return torch.randn(shape, generator=gen, dtype=DTYPE)


def _train(model, opt, steps, rank, ep, ep_rank, distinct):
    for step in steps:
        loss = 0
        for n, p in model.named_parameters():
            if distinct:
                g = _grad(n, p.shape, step, rank)
            else:  # the full tensor's gradient on every rank; an expert slice carries its EP group's share (x EP)
                g = _grad(n, SHAPES[n], step, -1)
                if ".experts." in f".{n}":
                    per = E // ep
                    g = g[ep_rank * per : (ep_rank + 1) * per] * ep
            loss = loss + (p * g).sum()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()


def _save(rank, world_size, ep, mode, path):
    topo = build_topology(ep)
    model = _Toy(topo.ep_rank, ep)
    opt = ShardedAdamW(model, topo, mode, bucket_numel=40, **HP)
    _train(model, opt, range(3), rank, ep, topo.ep_rank, distinct=True)
    dcp.save({"model": model_state_dict(model, topo), "optimizer": optimizer_state_dict(opt)}, checkpoint_id=path)


def _resume(rank, world_size, ep, mode, path):
    topo = build_topology(ep)
    model = _Toy(topo.ep_rank, ep, fill=0.0)
    opt = ShardedAdamW(model, topo, mode, bucket_numel=None, **HP)
    state = {"model": model_state_dict(model, topo), "optimizer": optimizer_state_dict(opt)}
    dcp.load(state, checkpoint_id=path)
    apply_optimizer_state_dict(opt, state["optimizer"])
    _train(model, opt, range(3, 5), rank, ep, topo.ep_rank, distinct=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(saved_world, saved_ep):
    full = _Toy(0, 1)
    params = dict(full.named_parameters())
    opt = torch.optim.AdamW(params.values(), **HP)
    for step in range(5):
        for n, p in params.items():
            if step < 3:
                total = torch.zeros_like(p)
                per = E // saved_ep
                for r in range(saved_world):
                    if ".experts." in f".{n}":
                        e = r % saved_ep
                        total[e * per : (e + 1) * per] += _grad(n, total[:per].shape, step, r)
                    else:
                        total += _grad(n, p.shape, step, r)
                p.grad = total / saved_world
            else:
                p.grad = _grad(n, SHAPES[n], step, -1)
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _check(results, ref, ep):
    for rank, params in enumerate(results):
        for n, p in params.items():
            expected = ref[n]
            if ".experts." in f".{n}":
                per = E // ep
                e = rank % ep
                expected = expected[e * per : (e + 1) * per]
            # per step: the sum over at most 4 ranks and the clipping norm over every element; 5 steps
            scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=1.0, eps=HP["eps"]) + expected.abs().max().item()
            assert_parity(p, expected, reduction_len=5 * (4 + NUMEL), scale=scale, msg=f"rank {rank} {n}")


@pytest.mark.distributed
def test_resume_at_other_layouts_modes_and_in_one_process(tmp_path):
    """Saved at DP=2 x EP=2 (ep_aware), resumed at DP=1 x EP=2 (dp), DP=4 x EP=1 (none) and one process."""
    path = str(tmp_path / "ckpt")
    run_pooled_test(_save, 4, ep=2, mode="ep_aware", path=path, timeout=120)
    ref = _reference(saved_world=4, saved_ep=2)
    _check(run_pooled_test(_resume, 2, ep=2, mode="dp", path=path, timeout=120), ref, ep=2)
    _check(run_pooled_test(_resume, 4, ep=1, mode="none", path=path, timeout=120), ref, ep=1)
    _check([_resume(0, 1, ep=1, mode="none", path=path)], ref, ep=1)


@pytest.mark.distributed
def test_grow_from_two_to_four_ranks_with_ep_aware(tmp_path):
    """Saved at DP=1 x EP=2 (dp mode), resumed at DP=2 x EP=2 (ep_aware): the 2 -> 4 direction."""
    path = str(tmp_path / "ckpt")
    run_pooled_test(_save, 2, ep=2, mode="dp", path=path, timeout=120)
    _check(run_pooled_test(_resume, 4, ep=2, mode="ep_aware", path=path, timeout=120), _reference(2, 2), ep=2)


def _load_bf16_masters(rank, world_size):
    import mula_lightning.parallel.sharded_optimizer as sharded

    topo = build_topology(2)
    model = _Toy(topo.ep_rank, 2).to(torch.bfloat16)
    opt = ShardedAdamW(model, topo, "ep_aware", bucket_numel=40, **HP)
    state = optimizer_state_dict(opt)
    for fam, shard in opt.shards.items():  # what dcp.load would leave: loaded masters, distinct per rank
        shard["master"].copy_(torch.arange(shard["master"].numel()) * 0.25 + 100 * rank + 10 * len(fam))
    works, real = [], sharded.all_gather_single

    class _Watched:  # the real gloo work; only records that it was waited for
        def __init__(self, work):
            self.work, self.waited = work, False
            works.append(self)

        def wait(self):
            self.waited = True
            return self.work.wait()

    sharded.all_gather_single = lambda *a, **k: _Watched(real(*a, **k))
    try:
        apply_optimizer_state_dict(opt, state)
    finally:
        sharded.all_gather_single = real
    owned = {}
    for fam, buf in opt.buffers.items():
        for seg in buf.segments:
            master = opt.shards[fam]["master"][seg.local_start : seg.local_start + seg.numel]
            owned[(seg.slot.name, seg.param_start)] = master.to(torch.bfloat16)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [w.waited for w in works], owned, params, topo.ep_rank


@pytest.mark.distributed
def test_loading_half_precision_masters_waits_for_the_weight_gathers():
    """After an optimizer-state load with bf16 parameters, every weight all-gather started to spread the loaded
    float32 masters has been waited for when ``apply_optimizer_state_dict`` returns (before, they were started and
    never waited: the model could be read, or overwritten, while a gather still wrote into it), and every rank's
    parameters hold the masters of whichever rank owns each element (distinct per rank)."""
    results = run_pooled_test(_load_bf16_masters, 4, timeout=120)
    owners = {}
    for waited, owned, _, ep_rank in results:
        assert waited and all(waited), f"weight all-gathers not waited for: {waited}"
        for (name, start), values in owned.items():
            key = (name, ep_rank) if ".experts." in f".{name}" else (name, None)
            owners.setdefault(key, {})[start] = values
    for _, _, params, ep_rank in results:
        for name, p in params.items():
            pieces = owners[(name, ep_rank) if ".experts." in f".{name}" else (name, None)]
            flat = torch.cat([pieces[s] for s in sorted(pieces)])
            assert torch.equal(p.reshape(-1), flat[: p.numel()]), name
