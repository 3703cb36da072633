"""The hierarchical ZeRO engine on real gloo processes against one process, and its ledger bytes in closed form.

The reference is one process running the unsharded model on every rank's micro-batch, averaging the losses and
stepping ``torch.optim.AdamW`` after torch's global-norm clipping (max_norm small, so clipping fires every step).

Both sides run in float64, so :func:`mula_lightning.testing.assert_parity` compares losses, the gradient norm before
clipping (the check that sees a wrong gradient scale, which clipping and Adam would hide) and parameters after ten
steps at ~1e-12; the quantized runs keep their own bound (within 2% of the unquantized loss, not identical). Injected
bugs (gradients not all-reduced across nodes, a missing 1/world scale) must fail that check. Clipping runs inside
``no_host_reads()``: it must not read the norm back to the host.
"""

import pytest
import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.ledger import CommLedger, ring_bytes_sent
from mula_lightning.parallel.zero.quantization import packed_bytes
from mula_lightning.testing import adamw_parameter_scale, assert_parity, no_host_reads, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 10
BLOCK = 16
DTYPE = torch.float64
H, FF, V, T = 32, 64, 128, 12  # hidden, MLP intermediate, vocabulary, sequence
# Rounded operations feeding one element of the loss or a gradient: per layer, dots over H (attention projections),
# T (attention) and FF (MLP), then the vocabulary's softmax; a gradient adds a sum over every rank's tokens (at most
# 8 ranks x 2 x T); the norm sums squares over every element (its rounding scales every clipped gradient). Each
# AdamW step builds on the previous ones, so N steps allow N times one step's rounding.
MODEL_LEN = 2 * (3 * H + T + 2 * FF) + V
GRAD_LEN = MODEL_LEN + 8 * 2 * T


def _config():
    return MulaConfig.from_name(
        "mula-tiny-dense",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
    )


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, 12), generator=g)


def _inject(bug):
    """Break the engine on purpose (in the rank process): the parity check must then fail. Returns what puts it
    back (a pooled rank runs the next test unbroken)."""
    import mula_lightning.parallel.zero.engine as hz

    group, finish = hz.HierarchicalZeroAdamW._group, hz.HierarchicalZeroAdamW.finish_grad_sync

    def undo():
        hz.HierarchicalZeroAdamW._group, hz.HierarchicalZeroAdamW.finish_grad_sync = group, finish

    if bug == "no_cross_node_reduce":  # gradient shards summed inside the node only, not over the other nodes

        def group_without_cross(self, kind, unit=None):
            return (None, 1, [0]) if kind == "grad_cross" else group(self, kind, unit)

        hz.HierarchicalZeroAdamW._group = group_without_cross
    elif bug == "missing_world_scale":  # summed gradients never divided by the world size

        def finish_without_scale(self):
            if not self._synced:
                finish(self)
                for u in self.units:
                    u.grad_shard.mul_(self.layout.world_size)

        hz.HierarchicalZeroAdamW.finish_grad_sync = finish_without_scale
    return undo


def _train(rank, world_size, configs, bug=None):
    undo = _inject(bug)
    try:
        return _train_configs(rank, configs)
    finally:
        undo()


def _train_configs(rank, configs):
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    results = {}
    for name, sizes, quant in configs:
        layout = ZeroTopoLayout.from_env(**sizes)
        model = init_weights(MulaForCausalLM(_config()), seed=0).to(DTYPE)
        engine = HierarchicalZeroAdamW(
            model, layout, **HP, quantize_weights=quant, quantize_grads=quant, block_size=BLOCK
        )
        losses, norms, records = [], [], None
        for step in range(STEPS):
            x = _batch(step, rank)
            with CommLedger() as ledger:
                loss = model(x, labels=x).loss
                loss.backward()
                with no_host_reads():  # clipping never waits for the device
                    norm = engine.clip_grad_norm_(MAX_NORM)
                norms.append(norm.item())
                engine.step()
            if step == 0:
                records = [(r.tag, r.level, r.op, r.bytes_sent) for r in ledger.records]
            losses.append(loss.item())
        with engine.full_parameters():
            state = {k: v.clone() for k, v in model.state_dict().items()}
        numels = [u.buf.numel for u in engine.units]
        sizes_out = (layout.weight_size, layout.secondary_size, layout.grad_size, layout.optimizer_size)
        results[name] = (losses, state, records, numels, sizes_out, engine.memory_bytes(), norms)
    return results


def _reference(world_size):
    model = init_weights(MulaForCausalLM(_config()), seed=0).to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses, norms = [], []
    for step in range(STEPS):
        per_rank = [model(_batch(step, r), labels=_batch(step, r)).loss for r in range(world_size)]
        torch.stack(per_rank).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append([p.item() for p in per_rank])
    return losses, model.state_dict(), norms


def _assert_parity(results, ref, names):
    ref_losses, ref_state, ref_norms = ref
    for rank, per_config in enumerate(results):
        for name in names:
            losses, state = per_config[name][:2]
            expected = torch.tensor([s[rank] for s in ref_losses], dtype=DTYPE)
            assert_parity(torch.tensor(losses, dtype=DTYPE), expected, reduction_len=STEPS * GRAD_LEN, msg=name)
            got_norms = torch.tensor(per_config[name][6], dtype=DTYPE)
            assert_parity(got_norms, torch.tensor(ref_norms, dtype=DTYPE), reduction_len=STEPS * GRAD_LEN, msg=name)
            for k, v in ref_state.items():
                scale = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"]) + v.abs().max().item()
                assert_parity(state[k], v, reduction_len=STEPS * GRAD_LEN, scale=scale, msg=f"{name} rank {rank} {k}")


def _expected_bytes(numels, sizes, world, quant, b=DTYPE.itemsize):
    """Closed form per (tag, level) of one step: (d - 1) / d of the moved numel x bytes (``b`` per element,
    quantized: the packed payload plus fp32 scales)."""
    w, s, g, o = sizes
    wq = (lambda n: packed_bytes(n, 8, BLOCK)) if quant else (lambda n: b * n)
    gq = (lambda n: packed_bytes(n, 4, BLOCK)) if quant else (lambda n: b * n)
    out = {}

    def add(key, value):
        if value:
            out[key] = out.get(key, 0) + value

    for n in numels:
        add("weights.forward", (w - 1) * wq(n // w))
        add("weights.backward", (s - 1) * (wq(n // s) if quant or s != w else b * n // s))
        add("grads.reduce_scatter", (g - 1) * gq(n // g))
        add("grads.all_reduce", ring_bytes_sent("all_reduce", world // g, b * n // g))
        add("weights.post_step", (o // w - 1) * b * (n // o))
    add("grads.norm", ring_bytes_sent("all_reduce", world, b))
    return out


def _assert_ledger(results, world, names, levels):
    for per_config in results:
        for name in names:
            _, _, records, numels, sizes = per_config[name][:5]
            quant = name.endswith("_q")
            got = {}
            for tag, level, _, sent in records:
                got[tag] = got.get(tag, 0) + sent
                assert level == levels[name][tag], (name, tag, level)
            assert got == _expected_bytes(numels, sizes, world, quant), name


EIGHT = [
    ("zero_topo", {}, False),
    ("zero3", dict(weight_size=8, grad_size=8, optimizer_size=8, secondary_size=8), False),
    ("hpz", dict(weight_size=8, grad_size=8, optimizer_size=8, secondary_size=4), False),
    ("zero_topo_s4", dict(secondary_size=4), False),
    ("zero_topo_q", {}, True),
]


@pytest.mark.distributed
@pytest.mark.slow
def test_eight_processes_match_one_process_and_ledger_closed_form():
    """8 gloo processes as 2 nodes x 2 GPUs x 2 GCDs. Unquantized zero_topo (w=2, g=4, o=8, s=2), ZeRO-3, hpZ and
    zero_topo with s=node: 10 clipped AdamW steps give the one-process losses and parameters (1e-5). For every
    configuration the ledger's bytes per tag for one step equal the closed form ((d-1)/d x numel x bytes, plus
    fp32 scales when quantized) and each collective sits on the level the paper puts it (forward all-gather on
    the GCD pair, reduce-scatter inside the node, all-reduce and post-step gather across nodes). The quantized
    run stays within 2% of the unquantized loss but is not identical (quantization really happened)."""
    results = run_pooled_test(_train, 8, ranks_per_node=4, ranks_per_gpu=2, configs=EIGHT, timeout=400)
    _assert_parity(results, _reference(8), ["zero_topo", "zero3", "hpz", "zero_topo_s4"])
    topo = {
        "weights.forward": "gcd",
        "weights.backward": "gcd",
        "grads.reduce_scatter": "intra_node",
        "grads.all_reduce": "inter_node",
        "weights.post_step": "inter_node",
        "grads.norm": "inter_node",
    }
    wide = {k: "inter_node" for k in topo}
    levels = {
        "zero_topo": topo,
        "zero_topo_q": topo,
        "zero3": wide,
        "hpz": {**wide, "weights.backward": "intra_node"},
        "zero_topo_s4": {**topo, "weights.backward": "intra_node"},
    }
    _assert_ledger(results, 8, [c[0] for c in EIGHT], levels)
    plain, quant = results[0]["zero_topo"][0], results[0]["zero_topo_q"][0]
    assert plain != quant and abs(quant[-1] - plain[-1]) <= 0.02 * plain[-1]
    mem = {name: results[0][name][5] for name in ("zero_topo", "zero3", "zero_topo_q")}
    assert mem["zero_topo"]["weights"] == 4 * mem["zero3"]["weights"]  # N/2 vs N/8 primary chunks
    assert mem["zero_topo"]["grads"] == 2 * mem["zero3"]["grads"]  # N/4 vs N/8
    assert mem["zero_topo"]["optimizer"] == mem["zero3"]["optimizer"]  # N/8 each
    numel = sum(results[0]["zero_topo"][3])
    assert mem["zero_topo_q"]["secondary"] == numel // 2 + 4 * numel // 2 // BLOCK  # INT8 + scales of N/2


@pytest.mark.distributed
@pytest.mark.parametrize("bug", ["no_cross_node_reduce", "missing_world_scale"])
def test_parity_check_catches_injected_bugs(bug):
    """Gradient shards not all-reduced across nodes (4 processes as 2 nodes x 2), or gradients not divided by the
    world size, fail the float64 parity check of the tests here: the rule is tight enough to see real bugs."""
    configs = [("zero_topo", {}, False)]
    results = run_pooled_test(_train, 4, ranks_per_node=2, ranks_per_gpu=1, configs=configs, bug=bug, timeout=300)
    with pytest.raises(AssertionError):
        _assert_parity(results, _reference(4), ["zero_topo"])


FOUR = [
    ("w1_g2_o4", dict(weight_size=1, grad_size=2, optimizer_size=4), False),
    ("w2_g2_o2", dict(weight_size=2, grad_size=2, optimizer_size=2, secondary_size=2), False),
    ("zero3", dict(weight_size=4, grad_size=4, optimizer_size=4, secondary_size=4), False),
]


@pytest.mark.distributed
def test_four_processes_other_group_sizes_match_one_process():
    """4 gloo processes as 2 nodes x 2 ranks: no weight sharding (w=1, g=2, o=4), optimizer states replicated twice
    (w=g=o=2) and ZeRO-3 over all 4: 10 clipped AdamW steps equal one process, ledger bytes equal the closed form."""
    results = run_pooled_test(_train, 4, ranks_per_node=2, ranks_per_gpu=1, configs=FOUR, timeout=300)
    _assert_parity(results, _reference(4), [c[0] for c in FOUR])
    for per_config in results:
        for name, *_ in FOUR:
            _, _, records, numels, sizes = per_config[name][:5]
            got = {}
            for tag, _, _, sent in records:
                got[tag] = got.get(tag, 0) + sent
            assert got == _expected_bytes(numels, sizes, 4, False), name


def _collectives(rank, world_size):
    import torch.distributed as dist

    from mula_lightning.parallel.zero.collectives import WeightGather, reduce_scatter_chunks

    positions = [0, 2, 1, 3]  # the gradient positions of w=2, g=4: group index k holds chunk positions[k]
    n = 4 * BLOCK
    inputs = [torch.randn(4 * n, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world_size)]
    group = dist.group.WORLD
    rs_q = reduce_scatter_chunks(inputs[rank].clone(), group, 4, positions, (4, BLOCK), "t")
    rs = reduce_scatter_chunks(inputs[rank].clone(), group, 4, positions, None, "t")
    chunk = inputs[rank][:n].clone()
    full = torch.empty(4 * n)
    WeightGather(chunk, full, group, 4, positions, (8, BLOCK), "forward", "t").wait()
    return rs_q, rs, full, chunk.equal(inputs[rank][:n])


@pytest.mark.distributed
def test_quantized_collectives_follow_the_precise_semantics():
    """4 processes, permuted chunk positions. INT4 reduce-scatter: each rank's result is exactly the fp32 sum, in
    source-rank order, of every source's dequantized INT4 chunk for it (and within the INT4 error bound of the
    exact sum; the unquantized path gives the exact sum). INT8 weight gather: every rank, the owner included, holds
    the same dequantized values at the right positions, and the sent chunk is not modified."""
    from mula_lightning.parallel.zero.quantization import QMAX, dequantize, quantize

    results = run_pooled_test(_collectives, 4, timeout=120)
    n = 4 * BLOCK
    inputs = [torch.randn(4 * n, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(4)]
    positions = [0, 2, 1, 3]
    for rank, (rs_q, rs, full, untouched) in enumerate(results):
        p = positions[rank]
        pieces = [x[p * n : (p + 1) * n] for x in inputs]
        expected = torch.zeros(n)
        for piece in pieces:  # source-rank order
            expected += dequantize(quantize(piece, 4, BLOCK))
        assert torch.equal(rs_q, expected)
        exact = sum(pieces)
        bound = sum(x.reshape(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK) / (2 * QMAX[4]) for x in pieces)
        assert torch.all((rs_q - exact).abs() <= bound * (1 + 1e-5) + 1e-6)
        torch.testing.assert_close(rs, exact, rtol=1e-6, atol=1e-6)
        gathered = torch.zeros(4 * n)
        for k, pos in enumerate(positions):
            gathered[pos * n : (pos + 1) * n] = dequantize(quantize(inputs[k][:n], 8, BLOCK))
        assert torch.equal(full, gathered) and untouched


def test_full_weights_live_only_around_their_use_with_one_layer_prefetched():
    """One process, 4 layers: while layer i runs forward, the full buffers allocated are the root's, layer i's and the
    prefetched layer i+1's only; in backward likewise (layer i and the prefetched i-1); after the step every full
    buffer is freed and the engine's update equals torch AdamW (the one-process parity of the same engine)."""
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    cfg = MulaConfig.from_name(
        "mula-tiny-dense",
        vocab_size=128,
        hidden_size=16,
        num_layers=4,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=32,
    )
    model, ref = init_weights(MulaForCausalLM(cfg), seed=0), init_weights(MulaForCausalLM(cfg), seed=0)
    engine = HierarchicalZeroAdamW(model, ZeroTopoLayout(1, 1, 1), **HP, block_size=BLOCK)
    live = lambda: {u.index for u in engine.units if u.buf.params.untyped_storage().nbytes() > 0}  # noqa: E731
    seen = {}
    for i, layer in enumerate(model.model.layers):
        # after the engine's pre-forward hook: layer i gathered, layer i+1 prefetched
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(("fwd", i), live()) and None)
        # a gradient inside layer i's backward (the engine's own hook on it runs first and keeps the unit)
        layer.self_attn.o_proj.weight.register_post_accumulate_grad_hook(
            lambda p, i=i: seen.setdefault(("bwd", i), live()) and None
        )
    x = _batch(0, 0)
    model(x, labels=x).loss.backward()
    engine.step()
    for i in range(4):
        assert seen[("fwd", i)] == {0, i + 1} | ({i + 2} if i < 3 else set()), (i, seen[("fwd", i)])
        assert {0, i + 1} <= seen[("bwd", i)] <= {0, i + 1, i}, (i, seen[("bwd", i)])
    assert live() == set()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    ref(x, labels=x).loss.backward()
    opt.step()
    with engine.full_parameters():
        for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=k)
