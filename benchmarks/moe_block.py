"""FastSparseMoE vs transformers' sparse MoE blocks (eager and ``experts_implementation="grouped_mm"``): OLMoE's,
and with ``--families`` Qwen3-MoE's and DeepSeek-V3's (sigmoid scores, group-limited routing, a selection bias, routed
scaling and a shared expert).

What it measures, per shape and dtype, on one device (CPU by default):

* forward + backward wall time of one MoE block, all contenders on the same weights (the parameters are shared
  objects), the same input and the same output cotangent, repetitions interleaved (the order rotates every
  repetition) so load from elsewhere hits every contender alike; the median is reported;
* peak memory: the increase of the peak RSS (``ru_maxrss``; read as ``VmHWM``, see :func:`peak_rss_kib`) over
  one forward + backward in a fresh subprocess per contender (weights, input and imports are in the baseline; what
  is left is activations, gradients and temporaries).

The contenders: ``hf_eager`` (the per-expert Python loop), ``hf_grouped_mm`` (transformers' grouped-GEMM
experts), and ``fast`` = ``FastSparseMoEBlock.from_hf(hf_block)``, the drop-in that ``patch_hf_moe`` installs
(same HF router, so all three route identically).

Targets (issue 3): fast >= 3x hf_eager at the Mula-7B-A1B layer; fast >= 1.1x hf_grouped_mm at H=512, I=256,
E=64, K=8, 2048 tokens; >= 0.97x hf_grouped_mm at the Mula-7B-A1B layer; peak memory <= hf_grouped_mm.

Run (10-15 minutes on 2 otherwise idle cores, most of it hf_eager at the Mula shapes)::

    python benchmarks/moe_block.py --threads 2

``--shapes small`` / ``--dtypes float32`` / ``--no-memory`` make it shorter. The routing families (issue 40)::

    python benchmarks/moe_block.py --threads 2 --families qwen3_moe deepseek_v3 --shapes small --dtypes float32

DeepSeek-V3's block at a shape: E experts in 8 groups of which a token keeps 4, one shared expert of width I, routed
scaling 2.5, a random N(0, 0.01^2) selection bias (so that the bias changes choices); Qwen3-MoE's: softmax top-k with
``norm_topk_prob``. The fast block keeps each transformers block's router and shared expert (``from_hf``), so the
contenders route alike and the ratio is that of the routed experts' dispatch, GEMMs and combine.

hf_eager runs once at the Mula shapes (one forward + backward takes about a minute there) and its memory is measured
at the small shape only unless ``--eager-memory-everywhere``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from mula_lightning.moe import FastSparseMoEBlock  # noqa: E402

CONTENDERS = ("hf_eager", "hf_grouped_mm", "fast")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int


SHAPES = {
    "small": Shape("H512 I256 E64 K8", 512, 256, 64, 8, 2048),
    "mula-7b-a1b": Shape("Mula-7B-A1B layer", 2048, 1024, 64, 8, 512),
    "mula-20b-a2b": Shape("Mula-20B-A2B layer", 2048, 1024, 96, 8, 512),
}


FAMILIES = ("olmoe", "qwen3_moe", "deepseek_v3")


def hf_block(family: str, shape: Shape, impl: str) -> torch.nn.Module:
    """transformers' sparse MoE block of ``family`` at ``shape`` (on the meta device), experts run by ``impl``."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=shape.hidden, num_experts_per_tok=shape.top_k, experts_implementation=impl)
    with torch.device("meta"):
        if family == "olmoe":
            cfg = transformers.OlmoeConfig(intermediate_size=shape.intermediate, num_experts=shape.experts, **common)
            return OlmoeSparseMoeBlock(cfg)
        if family == "qwen3_moe":
            cfg = transformers.Qwen3MoeConfig(
                moe_intermediate_size=shape.intermediate, num_experts=shape.experts, norm_topk_prob=True, **common
            )
            return Qwen3MoeSparseMoeBlock(cfg)
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=shape.intermediate, n_routed_experts=shape.experts, n_group=8, topk_group=4,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, **common,
        )  # fmt: skip
        return DeepseekV3MoE(cfg)


def build(shape: Shape, dtype: torch.dtype, seed: int = 0, family: str = "olmoe"):
    """The three contenders on one set of weights, plus the input and the output cotangent."""
    blocks = {f"hf_{impl}": hf_block(family, shape, impl) for impl in ("eager", "grouped_mm")}
    gen = torch.Generator().manual_seed(seed)
    params = {
        name: torch.nn.Parameter(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.02)
        for name, p in blocks["hf_eager"].named_parameters()
    }
    buffers = {name: torch.randn(b.shape, generator=gen) * 0.01 for name, b in blocks["hf_eager"].named_buffers()}
    for block in blocks.values():  # every contender holds the same parameter (and selection bias) objects
        for name, value in [*params.items(), *buffers.items()]:
            module_name, _, attr = name.rpartition(".")
            setattr(block.get_submodule(module_name), attr, value)
    blocks["fast"] = FastSparseMoEBlock.from_hf(blocks["hf_grouped_mm"])
    x = torch.randn(1, shape.tokens, shape.hidden, generator=gen, dtype=dtype)
    g = torch.randn(1, shape.tokens, shape.hidden, generator=gen, dtype=dtype)
    return blocks, params, x, g


def step(block: torch.nn.Module, params: dict, x: torch.Tensor, g: torch.Tensor) -> float:
    for p in params.values():
        p.grad = None
    xi = x.detach().requires_grad_()
    t0 = time.perf_counter()
    y = block(xi)
    y.backward(g)
    return time.perf_counter() - t0


def time_contenders(
    shape: Shape, dtype: torch.dtype, reps: int, eager_reps: int, family: str = "olmoe"
) -> dict[str, float]:
    blocks, params, x, g = build(shape, dtype, family=family)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for name in ("hf_grouped_mm", "fast"):  # warm-up (eager is slow enough that a warm-up changes nothing)
        step(blocks[name], params, x, g)
    for r in range(reps):
        order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
        for name in order:
            if name == "hf_eager" and r >= eager_reps:
                continue
            times[name].append(step(blocks[name], params, x, g))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_rss_kib() -> int:
    """This process's own resident-set high-water mark in KiB.

    That is ``ru_maxrss`` on Linux, except that ``getrusage`` also carries over the parent's peak across
    fork + exec (the benchmark parent is large), so the per-process ``VmHWM`` is read where available; it is reset
    to the current RSS by writing 5 to ``/proc/self/clear_refs``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_child(shape_key: str, dtype_name: str, contender: str, family: str) -> None:
    """Runs in a fresh process: print the peak-RSS increase (MiB) over one forward + backward."""
    shape, dtype = SHAPES[shape_key], getattr(torch, dtype_name)
    blocks, params, x, g = build(shape, dtype, family=family)
    keep = blocks[contender]
    del blocks
    gc.collect()
    try:  # reset the high-water mark to the current RSS (Linux), so import-time peaks do not hide the step's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = peak_rss_kib()
    step(keep, params, x, g)
    peak = peak_rss_kib()
    print(json.dumps({"peak_increase_mib": (peak - base) / 1024.0}))


def measure_memory(
    shape_key: str, dtype_name: str, threads: int, contenders=CONTENDERS, family: str = "olmoe"
) -> dict[str, float]:
    out = {}
    for contender in contenders:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", shape_key, dtype_name, contender, family]
        cmd += ["--threads", str(threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[contender] = json.loads(res.stdout.strip().splitlines()[-1])["peak_increase_mib"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions at the small shape")
    parser.add_argument("--big-reps", type=int, default=5, help="timed repetitions at the Mula layer shapes")
    parser.add_argument("--eager-reps", type=int, default=3, help="hf_eager repetitions at the small shape")
    parser.add_argument("--big-eager-reps", type=int, default=1, help="hf_eager repetitions at the Mula shapes")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument(
        "--eager-memory-everywhere",
        action="store_true",
        help="also measure hf_eager's memory at the Mula shapes (one F+B there takes minutes on 2 cores)",
    )
    parser.add_argument("--families", nargs="+", default=["olmoe"], choices=FAMILIES, help="transformers blocks")
    parser.add_argument(
        "--memory-child", nargs=4, metavar=("SHAPE", "DTYPE", "CONTENDER", "FAMILY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(*args.memory_child)
        return

    print(f"torch {torch.__version__}, {args.threads} threads, device cpu; times are medians of F+B seconds")
    header = (
        "| block | shape | dtype | tokens | hf_eager s | hf_grouped_mm s | fast s | fast vs eager |"
        " fast vs grouped_mm | peak MiB eager / grouped_mm / fast |"
    )
    rows = [header, "|" + "---|" * 10]
    for family, shape_key in [(f, s) for f in args.families for s in args.shapes]:
        shape = SHAPES[shape_key]
        for dtype_name in args.dtypes:
            small = shape_key == "small"
            reps, eager_reps = (args.reps, args.eager_reps) if small else (args.big_reps, args.big_eager_reps)
            t = time_contenders(shape, getattr(torch, dtype_name), reps, eager_reps, family)
            mem_contenders = CONTENDERS if small or args.eager_memory_everywhere else CONTENDERS[1:]
            mem = {} if args.no_memory else measure_memory(shape_key, dtype_name, args.threads, mem_contenders, family)
            mem_cell = " / ".join(f"{mem[c]:.0f}" if c in mem else "-" for c in CONTENDERS)
            rows.append(
                f"| {family} | {shape.name} | {dtype_name} | {shape.tokens} | {t['hf_eager']:.3f} |"
                f" {t['hf_grouped_mm']:.3f} |"
                f" {t['fast']:.3f} | {t['hf_eager'] / t['fast']:.2f}x | {t['hf_grouped_mm'] / t['fast']:.2f}x |"
                f" {mem_cell} |"
            )
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
