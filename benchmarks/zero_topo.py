"""Hierarchical ZeRO: bytes per collective per topology level, memory per rank, quantized vs unquantized loss.

Run: ``.venv/bin/python benchmarks/zero_topo.py`` (CPU, gloo). Options: ``--steps 200`` (loss part),
``--loss-world 4``, ``--skip-loss``.

Part 1 (8 processes = 2 nodes x 2 GPUs x 2 GCDs, ``mula-tiny-dense``, fp32): one training step of five
configurations of the same engine (:class:`~mula_lightning.parallel.zero.engine.HierarchicalZeroAdamW`):
ZeRO-3 (w = g = o = s = 8), ZeRO++ (hpZ secondary partition in the node, INT8 weights, INT4 gradients),
zero_topo unquantized, zero_topo quantized (secondary degree 2) and zero_topo quantized with secondary degree 4.
For every collective tag it prints, per rank, the ledger's bytes, our closed form ((d-1)/d x numel x bytes + fp32
scales) and the paper's Table VII-VIII volume with psi in fp16 bytes (2 x numel; INT8 = psi/2, INT4 = psi/4), then
memory per rank of each state (``untyped_storage().nbytes()``) beside Tables V-VI (in our dtypes: fp32 weights and
gradients, INT8 + scales secondary).

Part 2 (``--loss-world`` processes, 2 ranks per GPU and per node): 200 AdamW steps of ``mula-tiny-dense`` and
``mula-tiny-moe`` on the demo data (the embedded stdlib corpus prepared as in ``make demo``: 2 MB, a 4096-token
BPE), unquantized vs quantized (INT8 weights, INT4 gradients); prints the mean loss of the last 10 steps and the
relative gap (paper's claim: quantized training follows the unquantized loss; the issue's bar: within 2%).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.parallel.ledger import CommLedger
from mula_lightning.parallel.zero.quantization import packed_bytes
from mula_lightning.testing import run_distributed_test

BLOCK = 256
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = [  # name, layout sizes, quantized
    ("ZeRO-3", dict(weight_size=8, grad_size=8, optimizer_size=8, secondary_size=8), False),
    ("ZeRO++ (hpZ+qwZ+qgZ)", dict(weight_size=8, grad_size=8, optimizer_size=8, secondary_size=4), True),
    ("zero_topo", {}, False),
    ("zero_topo q, s=2", {}, True),
    ("zero_topo q, s=4", dict(secondary_size=4), True),
]
PAPER_FACTOR = {"weights.forward": 0.5, "weights.backward": 0.5, "grads.reduce_scatter": 0.25}


DATA_DIR = Path("demo") / "zero_topo-data-2000000B-seq64-bpe4096"


def prepare_demo_data(data_dir: Path = DATA_DIR) -> Path:
    """The demo data: the embedded corpus (this Python's standard library), 2 MB, a 4096-token BPE, 64-token rows.

    Prepared once (``mula_lightning.data.prepare``) and reused; the tiny presets have a 4096-token vocabulary.
    """
    from mula_lightning.data import prepare

    if not (data_dir / "manifest.json").is_file():
        prepare(output=str(data_dir), seq_len=64, train_tokenizer=4096, max_bytes=2_000_000, workers=0, progress=False)
    return data_dir


def _demo_tokens(data_dir: Path = DATA_DIR) -> torch.Tensor:
    """The training split of the demo data as one stream of token ids."""
    from mula_lightning.data.dataset import TokenShardDataset

    dataset = TokenShardDataset(data_dir, "train")
    return torch.from_numpy(dataset.read(0, len(dataset)).astype("int64")).reshape(-1)


def _bytes_step(rank: int, world_size: int) -> dict:
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    out = {}
    tokens = _demo_tokens()
    for name, sizes, quant in CONFIGS:
        layout = ZeroTopoLayout.from_env(**sizes)
        model = init_weights(MulaForCausalLM(MulaConfig.from_name("mula-tiny-dense")), seed=0)
        engine = HierarchicalZeroAdamW(model, layout, **HP, quantize_weights=quant, quantize_grads=quant)
        x = tokens[rank * 512 : rank * 512 + 4 * 128].reshape(4, 128)
        with CommLedger() as ledger:
            model(x, labels=x).loss.backward()
            engine.step()
        per_tag: dict = {}
        for r in ledger.records:
            entry = per_tag.setdefault(r.tag, [r.op, r.level, len(r.ranks), 0])
            entry[3] += r.bytes_sent
        numel = sum(u.buf.numel for u in engine.units)
        sz = (layout.weight_size, layout.secondary_size, layout.grad_size, layout.optimizer_size)
        out[name] = (per_tag, numel, sz, engine.memory_bytes())
    return out


def _closed_form(tag: str, numel: int, d: int, quant: bool, sizes) -> int:
    w, s, g, o = sizes
    if tag == "weights.forward":
        return (d - 1) * (packed_bytes(numel // d, 8, BLOCK) if quant else 4 * numel // d)
    if tag == "weights.backward":
        return (d - 1) * (packed_bytes(numel // d, 8, BLOCK) if quant else 4 * numel // d)
    if tag == "grads.reduce_scatter":
        return (d - 1) * (packed_bytes(numel // d, 4, BLOCK) if quant else 4 * numel // d)
    if tag == "grads.all_reduce":
        return 2 * (d - 1) * (4 * numel // g) // d
    if tag == "weights.post_step":
        return (d - 1) * 4 * numel // o
    return 2 * (d - 1) * 4 // d  # grads.norm: one fp32 scalar


def part1() -> None:
    start = time.perf_counter()
    results = run_distributed_test(_bytes_step, 8, ranks_per_node=4, ranks_per_gpu=2, timeout=600)[0]
    elapsed = time.perf_counter() - start
    print(f"== Part 1: one step, mula-tiny-dense, 8 ranks = 2 nodes x 2 GPUs x 2 GCDs (rank 0; {elapsed:.0f} s)")
    header = f"{'configuration':22} {'collective':21} {'op':14} {'level':10} {'d':>2} {'ledger B':>10} "
    header += f"{'closed form':>11} {'paper (fp16 psi)':>16}"
    print(header)
    for name, _, quant in CONFIGS:
        per_tag, numel, sizes, _ = results[name]
        for tag, (op, level, d, sent) in per_tag.items():
            closed = _closed_form(tag, numel, d, quant, sizes)
            paper = ""
            if tag in PAPER_FACTOR:
                factor = PAPER_FACTOR[tag] if quant else 1.0
                paper = f"{factor * 2 * numel * (d - 1) / d:16.0f}"
            elif tag == "weights.post_step":
                paper = f"{2 * numel * (d - 1) / d:16.0f}"
            print(f"{name:22} {tag:21} {op:14} {level:10} {d:2d} {sent:10d} {closed:11d} {paper}")
    print("\nMemory per rank (bytes, measured from untyped_storage().nbytes(); formula in our dtypes: fp32 = 4 B)")
    print(f"{'configuration':22} {'state':10} {'measured':>10} {'formula':>10}  paper (Tables V-VI, fp16)")
    for name, _, quant in CONFIGS:
        _, numel, (w, s, g, o), mem = results[name]
        sec = packed_bytes(numel // s, 8, BLOCK) if quant else (4 * numel // s if s != w else 0)
        psi = numel
        if name.startswith("ZeRO++"):
            paper_secondary = f"2psi/{s} = {2 * psi // s} (fp16)"
        elif name.startswith("ZeRO-3"):
            paper_secondary = "none"
        else:
            paper_secondary = f"psi/{s} = {psi // s} (INT8)" + (
                "" if quant else "; unquantized: none, primary re-gathered"
            )
        rows = [
            ("weights", mem["weights"], 4 * numel // w, f"2psi/{w} = {2 * psi // w}"),
            ("secondary", mem["secondary"], sec, paper_secondary),
            ("grads", mem["grads"], 4 * numel // g, f"2psi/{g} = {2 * psi // g}"),
            (
                "optimizer",
                mem["optimizer"],
                8 * numel // o,
                f"(not tabulated; fp16 training 12psi/{o} = {12 * psi // o})",
            ),
        ]
        for state, measured, formula, paper in rows:
            print(f"{name:22} {state:10} {measured:10d} {formula:10d}  {paper}")
    print(f"(psi = {numel} padded elements)")


def _train(rank: int, world_size: int, model_name: str, steps: int, quant: bool) -> list[float]:
    from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
    from mula_lightning.parallel.zero.layout import ZeroTopoLayout

    cfg = MulaConfig.from_name(model_name, max_seq_len=64)
    model = init_weights(MulaForCausalLM(cfg), seed=0)
    engine = HierarchicalZeroAdamW(
        model, ZeroTopoLayout.from_env(), **HP, quantize_weights=quant, quantize_grads=quant, block_size=BLOCK
    )
    tokens = _demo_tokens()
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - 65, (world_size, 4), generator=g)[rank]
        x = torch.stack([tokens[s : s + 64] for s in starts.tolist()])
        out = model(x, labels=x)
        (out.loss + out.aux_loss).backward()
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(out.loss.item())
    return losses


def part2(steps: int, world: int) -> None:
    print(f"\n== Part 2: {steps} steps on the demo data, {world} ranks (2 per GPU and node: w=2, g=2, o={world})")
    print(f"{'model':16} {'unquantized':>12} {'quantized':>10} {'gap':>8}  (mean loss of the last 10 steps)")
    for model_name in ("mula-tiny-dense", "mula-tiny-moe"):
        final = {}
        for quant in (False, True):
            losses = run_distributed_test(
                _train,
                world,
                ranks_per_node=2,
                ranks_per_gpu=2,
                timeout=1800,
                model_name=model_name,
                steps=steps,
                quant=quant,
            )
            mean = [sum(r[-10:]) / 10 for r in losses]
            final[quant] = sum(mean) / len(mean)
        gap = (final[True] - final[False]) / final[False]
        print(f"{model_name:16} {final[False]:12.4f} {final[True]:10.4f} {100 * gap:7.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--loss-world", type=int, default=4)
    parser.add_argument("--skip-loss", action="store_true")
    args = parser.parse_args()
    prepare_demo_data()
    part1()
    if not args.skip_loss:
        part2(args.steps, args.loss_world)


if __name__ == "__main__":
    main()
