"""Time lost per restart under ``mula launch``: a node killed during ``mula fit`` of the tiny MoE, side by side with
the same run uninterrupted.

Run::

    python benchmarks/launch_restart.py                         # 3 simulated nodes x 1 rank + 1 buffer, CPU
    python benchmarks/launch_restart.py --steps 40 --kill-step 25 --every 10 --nproc-per-node 2

What it measures (from ``launch_report.json`` and the wall clock, all on this machine):

* ``uninterrupted``: wall time of the launch with no fault (one attempt);
* ``with a kill``: wall time of the same launch with ``MULA_FAULT=kill@step=K,node=node1``;
* per restart: ``detect + stop`` (from the failure to the start of the next attempt: the settle window, stopping the
  survivors), ``startup + resume`` (from the start of the next attempt to its first step: interpreter and imports,
  rendezvous, loading the newest DualCheckpoint slot), the total ``time lost`` (failure -> first step after the
  resume) and the steps redone (the steps since the slot, computed again).

The extra wall time of the killed run over the uninterrupted one is the end-to-end cost of one restart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mula_lightning.testing.tiny_run import tiny_fit_config

ROOT = Path(__file__).resolve().parents[1]


def _launch(workdir: Path, args: argparse.Namespace, data_dir: Path, fault: str | None) -> tuple[float, dict]:
    workdir.mkdir(parents=True)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(tiny_fit_config(data_dir, args.steps, args.every)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("MULA_FAULT", None)
    if fault:
        env["MULA_FAULT"] = fault
    argv = [sys.executable, "-m", "mula_lightning.cli", "launch", "--nnodes", str(args.nnodes), "--buffer-nodes", "1"]
    argv += ["--nproc-per-node", str(args.nproc_per_node), "--grace", "5", "--report-dir", "launch", "--"]
    argv += ["mula", "fit", "--config", "tiny.yaml"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, json.loads((workdir / "launch" / "launch_report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-step", type=int, default=13)
    parser.add_argument("--every", type=int, default=5, help="DualCheckpoint interval (steps)")
    parser.add_argument("--nnodes", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    args = parser.parse_args()

    from mula_lightning.data import prepare

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        data_dir = tmp_path / "data"
        prepare(output=str(data_dir), seq_len=32, train_tokenizer=512, max_bytes=300_000, workers=0, progress=False)
        clean_wall, _ = _launch(tmp_path / "clean", args, data_dir, None)
        killed_wall, report = _launch(tmp_path / "killed", args, data_dir, f"kill@step={args.kill_step},node=node1")

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    world = args.nnodes * args.nproc_per_node
    print(f"tiny MoE, {args.steps} steps, {args.nnodes} nodes x {args.nproc_per_node} ranks ({world}), +1 buffer node")
    print(f"DualCheckpoint every {args.every} steps; node1 killed at step {args.kill_step}\n")
    print(f"{'run':<16}{'wall s':>10}")
    print(f"{'uninterrupted':<16}{clean_wall:>10.1f}")
    extra = f"(+{killed_wall - clean_wall:.1f} s, x{killed_wall / clean_wall:.2f})"
    print(f"{'with a kill':<16}{killed_wall:>10.1f}   {extra}")
    print()
    header = f"{'restart':<9}{'failed':<9}{'resumed':>8}{'redone':>8}{'detect+stop s':>15}{'startup+resume s':>18}"
    print(header + f"{'time lost s':>13}")
    attempts = report["attempts"]
    for row, before, after in zip(report["restarts"], attempts, attempts[1:], strict=False):
        detect = after["started"] - before["failure_at"]
        startup = after["first_step_at"] - after["started"]
        print(
            f"{row['attempt']:<9}{','.join(row['failed_hosts']):<9}{row['resumed_from_step']:>8}"
            f"{row['steps_redone']:>8}{detect:>15.1f}{startup:>18.1f}{row['time_lost_s']:>13.1f}"
        )


if __name__ == "__main__":
    main()
