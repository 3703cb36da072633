"""What a checkpoint costs the training loop: synchronous vs asynchronous ``DualCheckpoint`` saves, per strategy.

Run: ``.venv/bin/python benchmarks/async_save.py`` (CPU, gloo, 2 processes; about two minutes). Options:
``--world 2`` (or 1), ``--models moe dense``, ``--layouts zero3 epso``, ``--steps 4``.

Why: a synchronous save stops every rank for as long as storage takes; ``DualCheckpoint(async_save=True)`` stages
the state to host memory at the step and writes it in a background thread. The issue's target: a training step
during an asynchronous save costs at most 1.2x a step without one.

Per contender (a Fabric run of the model of ``benchmarks/memory.py`` built on the meta device, ``--steps`` training
steps of one 64-token sequence per rank, contenders in one run, each after a warm-up step and save):

* ``step`` = the mean step time without any save;
* ``sync`` = ``save_fabric`` of a synchronous ``DualCheckpoint``: the whole save blocks the loop;
* ``async call`` = the same call with ``async_save=True``: what the step of the save pays (clear the slot, stage);
* ``during`` = (that call + the ``--steps`` steps that follow + waiting for the write to finish) / ``--steps``: the
  cost of a step while a save is in flight, when saves are ``--steps`` steps apart; ratio to ``step``.

On a 2-core CPU with ``--world 2`` the background writer competes with training for the same cores (every core
trains); ``--world 1`` leaves the writer the second core, as a GPU node leaves it idle host cores while the step runs
on the device (EP = 1 there: one process holds every expert).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from memory import MODELS, _strategy, fixed_mmap_threshold
from mula_lightning.testing import run_distributed_test

LAYOUTS = ("zero3", "epso")


def _rank(rank: int, world_size: int, layout: str, model: str, path: str, steps: int) -> dict:
    from lightning.fabric import Fabric

    from mula_lightning.callbacks import DualCheckpoint
    from mula_lightning.models import MulaConfig, MulaForCausalLM

    fixed_mmap_threshold()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(layout, model, world_size))
    fabric.launch()
    config = MulaConfig(**MODELS[model])
    with fabric.init_module(empty_init=True):
        net = MulaForCausalLM(config)
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    tokens = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(rank))
    state = {"model": net, "optimizer": optimizer}

    def step() -> float:
        start = time.perf_counter()
        fabric.backward(net(tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        return time.perf_counter() - start

    sync = DualCheckpoint(os.path.join(path, "sync"), every_n_train_steps=1)
    background = DualCheckpoint(os.path.join(path, "async"), every_n_train_steps=1, async_save=True)
    step()
    sync.save_fabric(fabric, state, 1)  # warm-up: DCP's first save, the checkpoint group
    background.save_fabric(fabric, state, 1)
    background.wait()
    out = {"step": sum(step() for _ in range(steps)) / steps}
    start = time.perf_counter()
    sync.save_fabric(fabric, state, 2)
    out["sync"] = time.perf_counter() - start
    start = time.perf_counter()
    background.save_fabric(fabric, state, 2)
    out["async call"] = time.perf_counter() - start
    for _ in range(steps):
        step()
    background.wait()
    out["during"] = (time.perf_counter() - start) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["moe", "dense"])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.world} gloo processes, 1 thread each; seconds (max over the ranks)")
    print(f"{'model':>6} {'layout':>7} {'step':>7} {'sync':>7} {'async call':>11} {'during':>7} {'during/step':>12}")
    for model in args.models:
        for layout in args.layouts:
            with tempfile.TemporaryDirectory() as tmp:
                results = run_distributed_test(
                    _rank, args.world, layout=layout, model=model, path=tmp, steps=args.steps, timeout=900
                )
            r = {k: max(x[k] for x in results) for k in results[0]}
            print(
                f"{model:>6} {layout:>7} {r['step']:>7.3f} {r['sync']:>7.3f} {r['async call']:>11.3f} "
                f"{r['during']:>7.3f} {r['during'] / r['step']:>11.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
