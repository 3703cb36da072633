"""A whole-model training step in one process: ``MulaForCausalLM`` (FastSparseMoE) vs transformers'
``OlmoeForCausalLM`` with ``grouped_mm`` experts (and its eager per-expert loop), same weights, same batch.

Run::

    python benchmarks/model_step.py                              # both shapes, fp32, 2 threads
    python benchmarks/model_step.py --shapes tiny --profile      # where the step's time goes, per part
    python benchmarks/model_step.py --only mula grouped_mm       # skip HF eager
    python benchmarks/model_step.py --device cuda --dtype bfloat16 --batch 16 --skip compiled eager  # on a GPU

Why one process: ``benchmarks/train.py`` measures ``mula fit`` against Lightning DDP, where collectives and the
sharded optimizer share the step; this one isolates the model (forward, backward) and the optimizer step, the part
every layout runs on every rank.

Shapes:

* ``tiny``: the demo's ``mula-tiny-moe`` (hidden 128, 4 layers, 8 experts top-2 of width 128, vocabulary 4096);
* ``7b-a1b-like``: Mula-7B-A1B's layer (hidden 2048, 16 heads of 128, experts of width 1024, top-8, vocabulary
  50304) at depth 2 and with 32 experts instead of 64, so that two models' training state fits a 24 GiB machine (the
  experts a token meets, hence the FLOPs per token, are those of the full model).

``mula (fast)`` computes the loss as :class:`~mula_lightning.lightning_module.MulaLM` does (``return_logits=False``:
the LM head and the cross-entropy fused in chunks, :mod:`mula_lightning.models.linear_cross_entropy`), ``mula (fast),
plain loss`` through the whole batch's logits, as transformers does; ``mula (fast), compiled`` with ``epso``'s
``compile=True`` (``torch.compile`` of every layer's attention and norms; the compilation happens in the warm-up steps,
which are not timed); on a CUDA or XPU device also ``mula (fast), triton``: the experts and the loss in the Triton
kernels (``experts_backend="triton"``, ``loss_backend="triton"``; their autotuning happens in the warm-up steps); on
CUDA also ``mula (fast), cuda graphs`` and ``mula (fast), triton, cuda graphs``: forward + backward replayed as two
CUDA graphs (``epso``'s ``cuda_graphs=True``, :mod:`mula_lightning.parallel.cuda_graphs`; captured in the warm-up).

A step is ``loss = lm_loss + aux_loss; loss.backward(); optimizer.step(); optimizer.zero_grad()`` with torch's AdamW
as :class:`~mula_lightning.lightning_module.MulaLM` configures it for one device (the fused kernel where the device
has one) for every contender. Each contender runs in a fresh process (peak memory is its own), ``--repeats`` times,
interleaved; the best run is reported. The fraction of the GEMM limit is the model FLOPs of a step
(``MulaConfig.flops_per_token``, forward and backward) over the step time and over the rate of a ``torch.mm`` of the
model's largest GEMM (the LM head: batch tokens x hidden x vocabulary) with the same threads, measured in the same
run. ``--profile`` adds one profiled step per contender (:mod:`step_profile`).

On an accelerator (``--device cuda`` or ``xpu``, ``--dtype bfloat16``, a ``--batch`` that fills it) the same table is
the step against transformers there; the limit is the device's own ``torch.mm`` rate in that dtype (so the fraction is
MFU against what the card reaches), peak MB its allocator's peak, and ``--profile`` still records host time only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_profile, beside this script

from machine_limits import gemm_rate, peak_rss_mb, synchronize  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(preset="mula-tiny-moe", batch=8, seq_len=256, overrides={}),
    "7b-a1b-like": dict(preset="mula-7b-a1b", batch=2, seq_len=256, overrides=dict(num_layers=2, num_experts=32)),
}
CONTENDERS = ("mula (fast)", "mula (fast), plain loss", "mula (fast), compiled", "HF grouped_mm", "HF eager")
#: on CUDA / XPU also: the experts and the loss in the Triton kernels (on the CPU they would run interpreted)
DEVICE_CONTENDERS = ("mula (fast), triton",)
#: on CUDA also: forward + backward replayed as CUDA graphs (epso's cuda_graphs=True; captured in the warm-up steps)
CUDA_CONTENDERS = ("mula (fast), cuda graphs", "mula (fast), triton, cuda graphs")


def _config(shape: str):
    from mula_lightning.models import MulaConfig

    spec = SHAPES[shape]
    return MulaConfig.from_name(spec["preset"], moe_impl="fast", max_seq_len=spec["seq_len"], **spec["overrides"])


def _build(config, contender: str, device: torch.device, dtype: torch.dtype):
    """(model, step function) of a contender; the HF models get the Mula model's weights."""
    from mula_lightning.lightning_module import single_device_adamw
    from mula_lightning.models import MulaForCausalLM, init_weights

    if "triton" in contender:
        import dataclasses

        config = dataclasses.replace(config, experts_backend="triton", loss_backend="triton")
    model = init_weights(MulaForCausalLM(config), seed=0)
    if contender.startswith("HF"):
        from transformers import OlmoeForCausalLM

        from mula_lightning.models.hf_convert import hf_config_from_mula, to_hf

        hf_config = hf_config_from_mula(config)
        hf_config._experts_implementation = "eager" if "eager" in contender else "grouped_mm"
        hf_config.output_router_logits = True  # the load-balancing loss, as Mula computes it
        state = to_hf(model).state_dict()
        del model
        model = OlmoeForCausalLM(hf_config)
        model.load_state_dict(state)
        del state
    if "compiled" in contender:  # epso's compile=True: attention and norms (the MoE blocks stay eager)
        from mula_lightning.parallel.parallelize import apply_compile

        apply_compile(model)
    model.to(device, dtype)
    if "cuda graphs" in contender:
        from mula_lightning.parallel.cuda_graphs import GraphedTrainingForward

        GraphedTrainingForward(model)  # replaces the model's forward: training calls replay the graphs
    optimizer = single_device_adamw(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(input_ids: torch.Tensor) -> None:
        if contender.startswith("HF"):
            loss = model(input_ids=input_ids, labels=input_ids).loss  # includes the router's aux loss
        else:  # as MulaLM trains: the loss only (head + loss fused in chunks), or logits then the loss
            out = model(input_ids, labels=input_ids, return_logits="plain loss" in contender)
            loss = out.loss + out.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def _run(rank, world_size, shape: str, contender: str, args) -> dict[str, Any]:
    """One contender in this fresh process: warm-up steps, timed steps, an optional profiled step."""
    torch.set_num_threads(args.threads)
    config = _config(shape)
    spec = SHAPES[shape]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, step = _build(config, contender, device, dtype)
    if args.loss_chunk_tokens and not contender.startswith("HF"):
        model.loss_chunk_tokens = args.loss_chunk_tokens
    gen = torch.Generator().manual_seed(0)
    shape_ids = (args.batch or spec["batch"], spec["seq_len"])
    batches = [torch.randint(0, config.vocab_size, shape_ids, generator=gen).to(device) for _ in range(4)]
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.steps):
        step(batches[i % len(batches)])
    synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    on_device = device.type in ("cuda", "xpu")
    peak = getattr(torch, device.type).max_memory_allocated(device) / 2**20 if on_device else peak_rss_mb()
    result: dict[str, Any] = {"s_per_step": seconds, "peak_mb": peak}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        import step_profile

        step_profile.label_parts(model)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            start = time.perf_counter()
            step(batches[0])
            wall_us = (time.perf_counter() - start) * 1e6
        result["profile"] = step_profile.shares(profiler, wall_us)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="run only the contenders whose name contains one of these")
    parser.add_argument("--skip", nargs="*", help="leave out the contenders whose name contains one of these")
    parser.add_argument("--profile", action="store_true", help="profile one more step per contender: shares")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, xpu (peak MB: the device allocator's there)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameters and GEMMs")
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (0: the shape's own)")
    parser.add_argument(
        "--loss-chunk-tokens", type=int, default=0, help="rows per chunk of the fused loss (0: default)"
    )
    args = parser.parse_args()

    from mula_lightning.testing import run_distributed_test

    every = CONTENDERS + (DEVICE_CONTENDERS if args.device != "cpu" else ())
    every += CUDA_CONTENDERS if args.device.startswith("cuda") else ()
    contenders = [
        c
        for c in every
        if (not args.only or any(o in c for o in args.only)) and not any(o in c for o in args.skip or ())
    ]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}")
    for shape in args.shapes:
        config, spec = _config(shape), SHAPES[shape]
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):
            for name in contenders:  # interleaved: a slow phase of a shared machine hits every contender alike
                (result,) = run_distributed_test(_run, 1, timeout=3600, shape=shape, contender=name, args=args)
                if name not in best or result["s_per_step"] < best[name]["s_per_step"]:
                    best[name] = result
        batch = args.batch or spec["batch"]
        tokens = batch * spec["seq_len"]
        gemm = (tokens, config.hidden_size, config.vocab_size)  # the LM head, the largest GEMM
        dtype = getattr(torch, args.dtype)
        (rate,) = run_distributed_test(
            gemm_rate, 1, m=gemm[0], k=gemm[1], n=gemm[2], threads=args.threads, device=args.device, dtype=dtype
        )
        flops = config.flops_per_token(spec["seq_len"]) * tokens
        print(
            f"\n{shape}: hidden {config.hidden_size}, {config.num_layers} layers, {config.num_experts} experts top-"
            f"{config.top_k} of width {config.intermediate_size}, vocab {config.vocab_size}; batch {batch} x "
            f"{spec['seq_len']} tokens; {args.dtype} on {args.device}, {args.threads} threads, AdamW; best of "
            f"{args.repeats}, {args.steps} timed steps after {args.warmup}"
        )
        print(
            f"GEMM limit: torch.mm {gemm[0]} x {gemm[1]} x {gemm[2]} {args.dtype}, {args.threads} threads: "
            f"{rate / 1e9:.1f} GFLOP/s; model FLOPs per step {flops / 1e9:.2f} G"
        )
        reference = best.get("HF grouped_mm", {}).get("s_per_step", float("nan"))
        print(
            "\n| contender | tokens/s | s/step | vs HF grouped_mm | fraction of the GEMM limit | peak MB |\n"
            "|---|---|---|---|---|---|"
        )
        for name in contenders:
            r = best[name]
            print(
                f"| {name} | {tokens / r['s_per_step']:.0f} | {r['s_per_step']:.3f} | "
                f"{reference / r['s_per_step']:.2f}x | {flops / r['s_per_step'] / rate:.2f} | {r['peak_mb']:.0f} |"
            )
        if args.profile:
            import step_profile

            print(f"\nWhere one step's time goes ({shape}, shares of the profiled step):\n")
            print(step_profile.table({name: best[name]["profile"] for name in contenders}))


if __name__ == "__main__":
    main()
