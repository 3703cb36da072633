"""How the experts are balanced, and with which optimizer: ``mula fit`` runs of ``mula-tiny-moe`` that differ in one
thing, side by side on the same data, steps and processes.

Run::

    python benchmarks/balancing.py                       # 300 steps, 2 CPU processes (EP=2), stdlib corpus
    python benchmarks/balancing.py --steps 600 --rate 0.003
    python benchmarks/balancing.py --compare scope       # the loss over the micro-batch vs the global batch
    python benchmarks/balancing.py --compare optimizer --lrs 1e-3 3e-3 1e-2   # AdamW vs Muon, each over a grid

Contenders (all the shipped ``examples/configs/mula-tiny-moe.yaml`` with this script's data, steps and layout):

* ``--compare bias`` (the default): ``aux loss``, the Switch / OLMoE load-balancing loss at ``aux_loss_coef`` 0.01
  (the preset's), no selection bias, against ``aux-free``: ``aux_loss_coef`` 0 and ``bias_update_rate`` ``--rate``
  (DeepSeek-V3's auxiliary-loss-free balancing: a per-expert selection bias moved once per optimizer step by
  ``rate * sign(mean load - load)``);
* ``--compare scope``: the load-balancing loss at ``balance_scope`` ``micro_batch`` against ``global_batch`` (the
  expert frequencies counted over both ranks' tokens and the step's micro-batches so far, issue 72);
* ``--compare optimizer``: ``adamw`` and ``muon`` (Muon for the layers' matrices, AdamW for the rest), each at every
  peak learning rate of ``--lrs`` (``min_lr`` a tenth of it); the table adds the step at which each AdamW run's
  validation loss first reaches the best Muon run's final one (validation every ``--val-every`` steps).

Both keep the router z-loss. Printed: the final validation loss (the held-out split, the run's last validation), the
load imbalance (max / mean of the (token, k) pairs per expert, averaged over the MoE layers) at the last logged step
and over the last ``--tail`` logged steps, the ratios aux-free / aux loss, and both curves (imbalance and training LM
loss, averaged over windows of ``--window`` steps); ``--plot`` also draws them. The data (``--max-bytes`` of the
standard library's sources, a BPE of ``--vocab`` tokens) is prepared once into ``--output``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "mula-tiny-moe.yaml"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", default="bench-balancing", help="folder for data, runs and the plot")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument(
        "--rate", type=float, default=0.001, help="bias_update_rate of the aux-free run (DeepSeek-V3's)"
    )
    parser.add_argument("--aux-coef", type=float, default=0.01, help="aux_loss_coef of the aux-loss run")
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tail", type=int, default=10, help="logged steps averaged for the late imbalance")
    parser.add_argument("--window", type=int, default=50, help="steps per row of the printed curves")
    parser.add_argument("--plot", action="store_true", help="write <output>/balancing.png")
    parser.add_argument("--compare", choices=("bias", "scope", "optimizer"), default="bias")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2], help="--compare optimizer")
    parser.add_argument("--val-every", type=int, default=None, help="steps between validations (default: the end)")
    return parser.parse_args()


def _config(args: argparse.Namespace, run: Path, data_dir: Path, overrides: dict, model: dict | None = None) -> dict:
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    config["data"]["data_dir"] = str(data_dir)
    config["model"]["model_overrides"] = overrides
    config["model"].update(model or {})
    config["model"]["warmup_steps"] = min(config["model"]["warmup_steps"], max(1, args.steps // 10))
    trainer = config["trainer"]
    trainer.update(devices=args.devices, max_steps=args.steps, default_root_dir=str(run), log_every_n_steps=5)
    trainer["val_check_interval"] = args.val_every or args.steps
    trainer["limit_val_batches"] = 32
    trainer["strategy"]["init_args"]["ep_size"] = args.ep_size
    trainer["callbacks"] = []  # no checkpoints: the runs are measured, not kept
    trainer["logger"] = [
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(run), "name": "csv"}}
    ]
    config["moe_stats"] = {"wandb_every_n_steps": 0}
    return config


def _fit(args: argparse.Namespace, name: str, data_dir: Path, overrides: dict, model: dict | None = None
         ) -> tuple[list[dict], float]:  # fmt: skip
    import yaml

    run = Path(args.output) / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(_config(args, run, data_dir, overrides, model)))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "mula_lightning.cli", "fit", "--config", str(run / "config.yaml")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: mula fit failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    versions = sorted((run / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(versions[-1] / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f)), time.perf_counter() - start


def _imbalance(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, mean over MoE layers of max / mean expert load) at every logged step."""
    out = []
    for row in rows:
        layers = [float(v) for k, v in row.items() if k.startswith("moe/layer_") and k.endswith("/imbalance") and v]
        if layers:
            out.append((int(row["step"]), sum(layers) / len(layers)))
    return out


def main() -> None:
    args = _args()
    from mula_lightning.data import prepare

    data_dir = Path(args.output) / f"data-{args.max_bytes}B-seq{args.seq_len}-bpe{args.vocab}"
    if not (data_dir / "manifest.json").is_file():
        prepare(output=str(data_dir), seq_len=args.seq_len, train_tokenizer=args.vocab, max_bytes=args.max_bytes,
                workers=min(2, os.cpu_count() or 1), progress=False)  # fmt: skip
    if args.compare == "optimizer":
        return _compare_optimizers(args, data_dir)
    contenders = {
        "aux loss": {"aux_loss_coef": args.aux_coef},
        "aux-free": {"aux_loss_coef": 0.0, "bias_update_rate": args.rate},
    }
    if args.compare == "scope":
        contenders = {"micro": {"balance_scope": "micro_batch"}, "global": {"balance_scope": "global_batch"}}
    results = {}
    for name, overrides in contenders.items():
        rows, seconds = _fit(args, name.replace(" ", "-"), data_dir, overrides)
        curve = _imbalance(rows)
        val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
        tail = [v for _, v in curve[-args.tail :]]
        train = [(int(r["step"]), float(r["train/lm_loss"])) for r in rows if r.get("train/lm_loss")]
        results[name] = dict(val=val[-1], last=curve[-1][1], tail=sum(tail) / len(tail), curve=curve, train=train,
                             seconds=seconds)  # fmt: skip
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {_torch_version()}")
    print(f"mula-tiny-moe, {args.steps} steps, {args.devices} processes (EP={args.ep_size}), rate {args.rate}")
    print(f"{'contender':<10} {'val loss':>9} {'imbalance (last)':>17} {'imbalance (last ' + str(args.tail) + ')':>20}")
    for name, r in results.items():
        print(f"{name:<10} {r['val']:>9.4f} {r['last']:>17.3f} {r['tail']:>20.3f}   ({r['seconds']:.0f} s)")
    (second, a), (first, b) = list(results.items())[1], list(results.items())[0]
    print(
        f"{second} / {first}: val loss {a['val'] / b['val']:.4f}, imbalance (last) {a['last'] / b['last']:.3f}, "
        f"imbalance (last {args.tail}) {a['tail'] / b['tail']:.3f}"
    )
    print(_curves(results, args.window))
    if args.plot:
        _plot(results, Path(args.output) / "balancing.png")


def _compare_optimizers(args: argparse.Namespace, data_dir: Path) -> None:
    """AdamW and Muon at each learning rate of ``--lrs``: final validation loss, and the validation step at which
    AdamW first reaches the best Muon run's final loss."""
    vals: dict[tuple[str, float], list[tuple[int, float]]] = {}
    for optimizer in ("adamw", "muon"):
        for lr in args.lrs:
            model = {"optimizer": optimizer, "lr": lr, "min_lr": lr / 10}
            rows, seconds = _fit(args, f"{optimizer}-lr{lr:g}", data_dir, {}, model)
            vals[optimizer, lr] = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
            print(f"{optimizer} lr {lr:g}: val loss {vals[optimizer, lr][-1][1]:.4f} ({seconds:.0f} s)", flush=True)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {_torch_version()}")
    print(f"mula-tiny-moe, {args.steps} steps, {args.devices} processes (EP={args.ep_size})")
    best_muon = min(v[-1][1] for (o, _), v in vals.items() if o == "muon")
    print("| optimizer | lr | val loss | step AdamW first reaches the best Muon's final loss |")
    print("|---|---:|---:|---:|")
    for (optimizer, lr), curve in vals.items():
        reached = next((step for step, v in curve if v <= best_muon), None) if optimizer == "adamw" else None
        cell = "-" if optimizer == "muon" else (str(reached) if reached is not None else f"not in {args.steps}")
        print(f"| {optimizer} | {lr:g} | {curve[-1][1]:.4f} | {cell} |")


def _curves(results: dict, window: int) -> str:
    """Both curves as a table: per window of steps, the mean imbalance and the mean training LM loss of each run."""
    names = list(results)
    last = max(step for r in results.values() for step, _ in r["curve"])
    head = " | ".join(f"{n} imbalance | {n} LM loss" for n in names)
    lines = [f"\n| steps | {head} |", "|---|" + "---|---|" * len(names)]
    for lo in range(0, last, window):
        cells = []
        for n in names:
            for key in ("curve", "train"):
                values = [v for step, v in results[n][key] if lo < step <= lo + window]
                cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
        lines.append(f"| {lo + 1}-{lo + window} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, r in results.items():
        left.plot(*zip(*r["curve"]), label=name)
        right.plot(*zip(*r["train"]), label=name)
    left.set(xlabel="step", ylabel="imbalance (max / mean, layer mean)", title="expert load")
    right.set(xlabel="step", ylabel="train LM loss", title="loss")
    left.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
