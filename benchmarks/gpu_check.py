"""One command anyone with a GPU can run: FastSparseMoE parity and speed on the device, and a real ``mula fit``.

Run (``make gpu-check`` does the first)::

    python benchmarks/gpu_check.py                      # the first CUDA or XPU device
    python benchmarks/gpu_check.py --device xpu:0 --shape mula-7b-a1b
    python benchmarks/gpu_check.py --device cpu --quick # a smoke run of this script on a machine without a GPU

What it prints, one table:

1. parity: ``FastSparseMoEBlock.from_hf(block)`` vs transformers' OLMoE block (eager) on the device, fp32 and bf16,
   forward output and every gradient (input, router, experts), against the project's parity rule
   (:func:`mula_lightning.testing.assert_parity`: reduction length x eps(dtype) x scale);
2. speed: forward + backward of one MoE block, FastSparseMoE (its ``grouped_mm`` experts backend and its Triton
   kernels, ``experts_backend="triton"``) vs transformers eager and grouped_mm (median of ``--reps`` runs,
   interleaved, the device synchronised around each), with the ratios, the TFLOP/s of the routed experts' GEMMs
   (18 H I per routed row, forward + backward) and the kernels one forward + backward launches (the profiler's
   count);
3. the fused LM head + loss at a Mula-7B-A1B head (hidden 2048, vocabulary 50304, 4096 tokens, bf16; ``--quick``:
   hidden 64, vocabulary 512, 256 tokens, float32): forward + backward with the torch loss and with the Triton loss
   kernel (``backend="triton"``), their times and the largest difference of the loss and the two gradients;
4. host synchronisations: none in FastSparseMoE's forward + backward on one device, nor in a whole training step of
   the tiny Mula MoE with AdamW (CUDA's sync debug mode);
5. the issue's targets (bf16, forward + backward of one layer, the same contenders): the Mula-7B-A1B layer at 2048
   and 16384 tokens, skipped once the run has used ``--budget`` seconds (one device call must stay under 8 minutes);
6. a captured training step (``epso``'s ``cuda_graphs=True`` path, :mod:`mula_lightning.parallel.cuda_graphs`): the
   tiny Mula MoE in bf16, eager vs forward + backward replayed as CUDA graphs (AdamW eager in both), median step
   times, the largest loss difference over the first steps, and whether the replayed steps ran under CUDA's sync
   debug mode without a host synchronisation;
7. training: ``mula fit`` of the tiny MoE on the device with the ``epso`` strategy (1 device, bf16-true), from a
   freshly prepared corpus: exit code, steps, first and last loss, wall time.

Record the table in BENCHMARKS.md with the device named. Nothing here runs in ``make test``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from moe_block import SHAPES, Shape, build  # noqa: E402
from mula_lightning.testing import assert_parity  # noqa: E402

CONTENDERS = ("hf_eager", "hf_grouped_mm", "fast", "fast_triton")


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda:0"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu:0"
    raise SystemExit("gpu_check: no CUDA or XPU device found (use --device cpu for a smoke run of the script)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def _on_device(shape: Shape, dtype: torch.dtype, device: torch.device):
    from mula_lightning.moe import FastSparseMoEBlock

    blocks, params, x, g = build(shape, dtype)
    for block in blocks.values():
        block.to(device)
    # the Triton kernels on the same (shared) parameters and router
    blocks["fast_triton"] = FastSparseMoEBlock.from_hf(blocks["hf_grouped_mm"], experts_backend="triton")
    return blocks, params, x.to(device), g.to(device)


def _forward_backward(block, params, x, g):
    for p in params.values():
        p.grad = None
    xi = x.detach().requires_grad_()
    y = block(xi)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(g)
    return y.detach(), xi.grad, {name: p.grad.clone() for name, p in params.items()}


def parity(shape: Shape, dtype: torch.dtype, device: torch.device, contender: str = "fast") -> str:
    """FastSparseMoE vs the eager HF block on the device: output and every gradient within the parity rule."""
    blocks, params, x, g = _on_device(shape, dtype, device)
    # the block's parameters were moved by .to(device): refresh the shared-parameter view
    params = dict(blocks["hf_eager"].named_parameters())
    y_ref, gx_ref, grads_ref = _forward_backward(blocks["hf_eager"], params, x, g)
    try:
        y, gx, grads = _forward_backward(blocks[contender], params, x, g)
    except Exception as err:  # a kernel that does not build or run on this device: say so, go on
        return f"FAIL ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    try:
        assert_parity(y, y_ref, reduction_len=shape.hidden)
        assert_parity(gx, gx_ref, reduction_len=shape.hidden)
        for name, ref in grads_ref.items():
            assert_parity(grads[name], ref, reduction_len=shape.tokens)
    except AssertionError as err:
        return f"FAIL ({str(err).splitlines()[0][:80]})"
    rel = ((y.float() - y_ref.float()).norm() / y_ref.float().norm().clamp_min(1e-30)).item()
    return f"ok (output rel. error {rel:.1e})"


def speed(shape: Shape, dtype: torch.dtype, device: torch.device, reps: int) -> dict[str, float]:
    """Median seconds of one forward + backward per contender; a contender that cannot run here is left out."""
    blocks, _, x, g = _on_device(shape, dtype, device)
    params = dict(blocks["hf_eager"].named_parameters())
    running = []
    for name in CONTENDERS:  # warm-up (kernels, autotuning)
        try:
            _forward_backward(blocks[name], params, x, g)
            running.append(name)
        except (RuntimeError, ValueError) as err:
            print(f"  ({name} does not run here: {str(err).splitlines()[0][:100]})")
    times: dict[str, list[float]] = {name: [] for name in running}
    for r in range(reps):
        turn = r % len(running)
        for name in running[turn:] + running[:turn]:
            _sync(device)
            start = time.perf_counter()
            _forward_backward(blocks[name], params, x, g)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernels_launched(shape: Shape, dtype: torch.dtype, device: torch.device, contender: str) -> str:
    """Device kernels one forward + backward of ``contender`` launches (routing included), from the profiler."""
    if device.type != "cuda":
        return "n/a"
    from torch.profiler import ProfilerActivity, profile

    blocks, _, x, g = _on_device(shape, dtype, device)
    params = dict(blocks[contender].named_parameters())
    _forward_backward(blocks[contender], params, x, g)  # warm-up: compilation, autotuning
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _forward_backward(blocks[contender], params, x, g)
        torch.cuda.synchronize(device)
    return str(sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA"))


def loss_speed(device: torch.device, quick: bool, reps: int) -> str:
    """The fused head + loss with the torch loss and with the Triton kernel: median times and their differences."""
    from mula_lightning.models.linear_cross_entropy import linear_cross_entropy

    hidden_size, vocab, tokens, dtype = (64, 512, 256, torch.float32) if quick else (2048, 50304, 4096, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, tokens, hidden_size, generator=gen) * 0.5).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
    results, times = {}, {}
    for backend in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        try:
            for _ in range(2):  # warm-up, then the kept run
                h.grad = w.grad = None
                loss = linear_cross_entropy(h, w, labels, backend=backend)
                loss.backward()
        except (RuntimeError, ValueError) as err:
            return f"{backend} does not run here: {str(err).splitlines()[0][:90]}"
        results[backend] = (loss.detach().float(), h.grad.float(), w.grad.float())
        runs = []
        for _ in range(reps):
            h.grad = w.grad = None
            _sync(device)
            start = time.perf_counter()
            linear_cross_entropy(h, w, labels, backend=backend).backward()
            _sync(device)
            runs.append(time.perf_counter() - start)
        times[backend] = statistics.median(runs)
    diffs = ", ".join(
        f"{name} {(a - b).abs().max().item() / b.abs().max().clamp_min(1e-30).item():.1e}"
        for name, a, b in zip(("loss", "d hidden", "d weight"), results["triton"], results["torch"])
    )
    ratio = times["torch"] / times["triton"]
    return (f"torch {times['torch'] * 1e3:.2f} ms, triton {times['triton'] * 1e3:.2f} ms ({ratio:.2f}x); "
            f"largest difference / scale: {diffs}")  # fmt: skip


def host_syncs(shape: Shape, dtype: torch.dtype, device: torch.device, contender: str = "fast") -> str:
    """FastSparseMoE's forward + backward on one device, dropless, through the grouped kernel: it must never wait
    for the device (no ``.item()`` / ``.tolist()`` / data-dependent allocation on the host), as CUDA's sync debug
    mode checks; a synchronisation stalls the host's kernel queue once per MoE layer."""
    if device.type != "cuda":
        return "n/a (CUDA's sync debug mode only)"
    blocks, _, x, g = _on_device(shape, dtype, device)
    block = blocks[contender]
    params = dict(block.named_parameters())
    _forward_backward(block, params, x, g)  # warm-up: kernels, lazy state
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(block, params, x, g)
    except RuntimeError as err:
        return f"synchronises: {str(err).splitlines()[0][:90]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "none"


def training_step_syncs(device: torch.device) -> str:
    """A whole training step of the tiny Mula MoE on one device in bf16 (forward with the fused head + loss, backward,
    torch's fused AdamW): no host synchronisation anywhere in it (router counts, dispatch plan, grouped GEMMs, loss),
    as CUDA's sync debug mode checks; then the same step under ``torch.use_deterministic_algorithms``."""
    if device.type != "cuda":
        return "n/a (CUDA's sync debug mode only)"
    from mula_lightning.lightning_module import single_device_adamw
    from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights

    config = MulaConfig.from_name("mula-tiny-moe", moe_impl="fast", max_seq_len=256)
    model = init_weights(MulaForCausalLM(config), seed=0).to(device, torch.bfloat16)
    optimizer = single_device_adamw(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (8, 256), device=device)

    def step() -> None:
        out = model(ids, labels=ids, return_logits=False)
        (out.loss + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, optimizer state
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as err:
        return f"synchronises: {str(err).splitlines()[0][:90]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.use_deterministic_algorithms(True)
    try:
        step()
        torch.cuda.synchronize(device)
    except RuntimeError as err:
        return f"none; deterministic algorithms refused: {str(err).splitlines()[0][:70]}"
    finally:
        torch.use_deterministic_algorithms(False)
    return "none; also runs under deterministic algorithms"


def speed_row(shape: Shape, device: torch.device, reps: int) -> str:
    """One layer's forward + backward in bf16 at ``shape``: times, the ratios to transformers' grouped_mm, TFLOP/s."""
    flops = 18 * shape.hidden * shape.intermediate * shape.tokens * shape.top_k  # the experts' GEMMs, fwd + bwd
    t = speed(shape, torch.bfloat16, device, reps)
    row = ", ".join(f"{n} {t[n] * 1e3:.2f} ms" for n in CONTENDERS if n in t)
    ratios = ", ".join(
        f"{n} vs grouped_mm {t['hf_grouped_mm'] / t[n]:.2f}x, {flops / t[n] / 1e12:.1f} TFLOP/s"
        for n in ("fast", "fast_triton")
        if n in t and "hf_grouped_mm" in t
    )
    return f"{row}; {ratios}"


def captured_step(device: torch.device, reps: int, steps: int = 3) -> str:
    """The tiny Mula MoE's training step (bf16, fused head + loss, AdamW) eager and with forward + backward replayed
    as CUDA graphs: median step times, the largest loss difference over ``steps`` steps from the same weights and
    batches, host synchronisations of a replayed step (CUDA's sync debug mode)."""
    if device.type != "cuda":
        return "n/a (CUDA graphs)"
    from mula_lightning.lightning_module import single_device_adamw
    from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
    from mula_lightning.parallel.cuda_graphs import GraphedTrainingForward

    config = MulaConfig.from_name("mula-tiny-moe", moe_impl="fast", max_seq_len=256)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (8, 256), device=device, generator=gen) for _ in range(steps)]
    losses, times, notes = {}, {}, []
    for mode in ("eager", "graphs"):
        model = init_weights(MulaForCausalLM(config), seed=0).to(device, torch.bfloat16)
        optimizer = single_device_adamw(model.parameters(), lr=1e-4)
        wrapper = GraphedTrainingForward(model) if mode == "graphs" else None

        def step(ids: torch.Tensor) -> torch.Tensor:
            out = model(ids, labels=ids, return_logits=False)  # noqa: B023 - this mode's model
            (out.loss + out.aux_loss).backward()
            optimizer.step()  # noqa: B023
            optimizer.zero_grad(set_to_none=True)  # noqa: B023
            return out.loss.detach().float()

        try:
            losses[mode] = torch.stack([step(ids) for ids in batches])  # the graphs' capture is in the first
        except RuntimeError as err:
            return f"{mode} FAIL ({str(err).splitlines()[0][:100]})"
        if wrapper is not None:
            if wrapper.refused or wrapper.replays == 0:
                return f"not captured: {wrapper.refused or 'no replay'}"
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(batches[0])
                notes.append("a replayed step does not synchronise")
            except RuntimeError as err:
                notes.append(f"a replayed step synchronises: {str(err).splitlines()[0][:80]}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
        runs = []
        for _ in range(reps):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            step(batches[0])
            torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - start)
        times[mode] = statistics.median(runs)
    diff = (losses["graphs"] - losses["eager"]).abs().max().item()
    return (f"eager {times['eager'] * 1e3:.2f} ms, graphs {times['graphs'] * 1e3:.2f} ms "
            f"({times['eager'] / times['graphs']:.2f}x); loss difference over {steps} steps {diff:.1e}; "
            + "; ".join(notes))  # fmt: skip


def fit(device: torch.device, steps: int) -> str:
    """`mula fit` of the tiny MoE on one device with epso, bf16-true; returns a one-line summary."""
    import csv

    import yaml

    from mula_lightning.data import prepare
    from mula_lightning.testing.tiny_run import tiny_fit_config

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        prepare(output=str(data), seq_len=64, train_tokenizer=512, max_bytes=400_000, workers=0, progress=False)
        config = tiny_fit_config(data, steps, every_n_train_steps=steps)
        devices = [device.index] if device.index is not None and device.type != "cpu" else 1
        precision = "32-true" if device.type == "cpu" else "bf16-true"
        config["trainer"].update(accelerator=device.type, devices=devices, precision=precision)
        (work / "fit.yaml").write_text(yaml.safe_dump(config))
        # prepend src, keep what the caller put on the path (packages carried onto a machine without an index)
        pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": pythonpath, "WANDB_MODE": "offline"}
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "mula_lightning.cli", "fit", "--config", "fit.yaml"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return f"FAIL (exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:100]})"
        (metrics,) = (work / "runs" / "tiny").glob("version_*/metrics.csv")
        with open(metrics) as fh:
            losses = [float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")]
        return f"ok: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {wall:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda:0, xpu:0, ... (default: the first CUDA or XPU device)")
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="mula fit steps")
    parser.add_argument("--quick", action="store_true", help="a small shape, 2 repetitions, 10 steps (smoke run)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds after which the target rows are skipped")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device or _default_device())
    shape = SHAPES[args.shape]
    if args.quick:
        shape, args.reps, args.steps = Shape("quick H64 I32 E8 K2", 64, 32, 8, 2, 128), 2, 10
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    if device.type == "xpu":
        name = torch.xpu.get_device_name(device)
    print(f"device: {name}; torch {torch.__version__}; shape {shape.name}, {shape.tokens} tokens\n")
    print(f"{'check':<44}result")
    for dtype in (torch.float32, torch.bfloat16):
        for contender in ("fast", "fast_triton"):
            label = f"parity vs HF eager, {contender}, {str(dtype)[6:]}"
            print(f"{label:<44}{parity(shape, dtype, device, contender)}")
    flops = 18 * shape.hidden * shape.intermediate * shape.tokens * shape.top_k  # the experts' GEMMs, fwd + bwd
    for dtype in (torch.float32, torch.bfloat16):
        t = speed(shape, dtype, device, args.reps)
        row = ", ".join(f"{n} {t[n] * 1e3:.2f} ms" for n in CONTENDERS if n in t)
        ratios = ", ".join(
            f"{n} vs eager {t['hf_eager'] / t[n]:.2f}x, vs grouped_mm {t['hf_grouped_mm'] / t[n]:.2f}x, "
            f"{flops / t[n] / 1e12:.1f} TFLOP/s"
            for n in ("fast", "fast_triton")
            if n in t
        )
        print(f"{'fwd+bwd, ' + str(dtype)[6:]:<44}{row}; {ratios}")
    for contender in ("hf_grouped_mm", "fast", "fast_triton"):
        label = f"kernels per fwd+bwd, {contender}"
        print(f"{label:<44}{kernels_launched(shape, torch.bfloat16, device, contender)}")
    print(f"{'LM head + loss fwd+bwd, torch vs triton':<44}{loss_speed(device, args.quick, args.reps)}")
    for contender in ("fast", "fast_triton"):
        label = f"host syncs in fwd+bwd, {contender}"
        print(f"{label:<44}{host_syncs(shape, torch.bfloat16, device, contender)}")
    print(f"{'host syncs in a training step':<44}{training_step_syncs(device)}")
    targets = [Shape("quick H64 I32 E8 K2", 64, 32, 8, 2, 512)] if args.quick else [
        replace(SHAPES["mula-7b-a1b"], tokens=2048), replace(SHAPES["mula-7b-a1b"], tokens=16384)]  # fmt: skip
    for target in targets:
        label = f"fwd+bwd bf16, {target.name}, {target.tokens} tok"
        used = time.perf_counter() - started
        row = f"skipped ({used:.0f} s used of a {args.budget:.0f} s budget)" if used > args.budget else None
        print(f"{label:<44}{row or speed_row(target, device, args.reps)}", flush=True)
    print(f"{'captured training step, tiny MoE, bf16':<44}{captured_step(device, args.reps)}", flush=True)
    print(f"{'mula fit tiny MoE, epso, 1 device':<44}{fit(device, args.steps)}")


if __name__ == "__main__":
    main()
