"""``make demo``: pretrain ``mula-tiny-moe`` on this Python's standard library, on CPU, with 4 processes.

Run from a clone (it reads ``examples/configs/mula-tiny-moe.yaml``)::

    make demo                                    # = python -m mula_lightning.demo
    python -m mula_lightning.demo --steps 100    # shorter

Steps, and why each is there:

1. **Prepare** the embedded corpus (the standard library's sources; ``--max-bytes`` caps it so the whole demo
   takes a few minutes on 2 cores): train a 4096-token byte-level BPE, tokenize, shuffle globally, shard
   (``mula data prepare``). A finished dataset is reused.
2. **Train** with the same LightningCLI path as ``mula fit`` (config from the shipped YAML): 4 processes started by
   Lightning (``devices=4``; the launcher re-runs this module in 3 children, which find the data ready),
   DP=2 x EP=2 with the ``epso`` strategy (experts split over 2 ranks, EP-aware sharded AdamW), validation every
   100 steps, CSV + offline W&B logs, and the paper's reliability callbacks of the YAML: DualCheckpoint (two
   alternating sharded checkpoints, the newest resumable with ``--ckpt_path last``), bf16 ModelOnlyCheckpoint and
   NaNDetector, every ``--val-every`` steps and at the end.
3. **Evaluate**: validation loss and perplexity over the held-out split, all-reduced over real tokens, printed
   beside the unigram entropy of the training tokens (the loss of the best model that ignores context). The demo
   fails (exit code 1) unless the validation loss is at least ``--min-gap`` nats (default 1) below it.
4. **Report**: ``mula report`` plots (loss, learning rate, tokens/s, expert-load heatmap), then where the
   checkpoints, logs and plots are, and the commands that resume, export and load the model.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "mula-tiny-moe.yaml"


def parse_args(argv: Sequence[str]) -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m mula_lightning.demo", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", type=str, default="demo", help="folder for data, logs, checkpoint and plots")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--max-bytes", type=int, default=6_000_000, help="bytes of stdlib text to prepare")
    parser.add_argument("--seq-len", type=int, default=128, help="context size of the prepared instances")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained on the corpus")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes (DP x EP)")
    parser.add_argument("--ep-size", type=int, default=2, help="expert-parallel degree")
    parser.add_argument("--val-every", type=int, default=100, help="steps between validations (and at the end)")
    parser.add_argument("--wandb", type=bool, default=True, help="also log to W&B (offline)")
    parser.add_argument("--min-gap", type=float, default=1.0, help="required nats of val loss below unigram entropy")
    parser.add_argument("--config", type=str, default=str(CONFIG), help="the LightningCLI YAML to start from")
    return parser.parse_args(list(argv))


def prepare_data(args: Any, data_dir: Path) -> None:
    """Prepare the corpus once: the launcher's parent (or local rank 0 under torchrun) writes, others wait."""
    from mula_lightning.data import prepare

    if (data_dir / "manifest.json").is_file():
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        prepare(
            output=str(data_dir),
            seq_len=args.seq_len,
            train_tokenizer=args.vocab,
            max_bytes=args.max_bytes,
            workers=min(2, os.cpu_count() or 1),
            progress=False,
        )
        return
    deadline = time.monotonic() + 1800
    while not (data_dir / "manifest.json").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{data_dir}: local rank 0 did not finish preparing the data in 30 minutes")
        time.sleep(1.0)


def unigram_entropy(data_dir: Path) -> float:
    """Entropy (nats) of the token frequencies of the training split: the loss floor of a context-free model."""
    import numpy as np

    from mula_lightning.data.dataset import TokenShardDataset
    from mula_lightning.data.manifest import DataManifest

    manifest = DataManifest.load(data_dir)
    dataset = TokenShardDataset(data_dir, "train", manifest)
    counts = np.zeros(manifest.vocab_size, dtype=np.int64)
    for start in range(0, len(dataset), 4096):
        rows = dataset.read(start, min(start + 4096, len(dataset)))  # (n, seq_len) token ids, contiguous
        counts += np.bincount(np.asarray(rows, dtype=np.int64).reshape(-1), minlength=manifest.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build_config(args: Any, out: Path, data_dir: Path) -> dict[str, Any]:
    """The shipped YAML with the demo's paths, steps and layout filled in."""
    import yaml

    if not Path(args.config).is_file():
        raise FileNotFoundError(f"{args.config} not found: run the demo from a clone of the repository")
    config = yaml.safe_load(Path(args.config).read_text())
    runs = str(out / "runs")
    config["data"]["data_dir"] = str(data_dir)
    trainer = config["trainer"]
    trainer.update(devices=args.devices, max_steps=args.steps, default_root_dir=runs)
    trainer["val_check_interval"] = min(args.val_every, args.steps)
    trainer["strategy"]["init_args"]["ep_size"] = args.ep_size
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": runs, "name": "demo"}}]
    if args.wandb:
        init = {"save_dir": runs, "project": "mula-demo", "offline": True}
        loggers.append({"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": init})
    trainer["logger"] = loggers
    config["model"]["warmup_steps"] = min(config["model"]["warmup_steps"], max(1, args.steps // 10))
    # short runs (tests) still log often enough for every plot: rates need a full throughput window
    trainer["log_every_n_steps"] = min(trainer.get("log_every_n_steps", 50), max(1, args.steps // 6))
    checkpoints = out / "checkpoints"  # the YAML's reliability callbacks, pointed into the demo folder
    for callback in trainer.get("callbacks") or []:
        name, init = callback["class_path"].rsplit(".", 1)[-1], callback.setdefault("init_args", {})
        if name in ("DualCheckpoint", "ModelOnlyCheckpoint"):
            init.update(dirpath=str(checkpoints / ("dual" if name == "DualCheckpoint" else "weights")))
            init["every_n_train_steps"] = trainer["val_check_interval"]
        elif name == "NaNDetector":
            init["report_dir"] = str(checkpoints / "nan")
    throughput = config.setdefault("throughput", {})
    throughput["window_size"] = min(throughput.get("window_size", 20), max(2, args.steps // 3))
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    import torch

    torch.set_num_threads(1)  # 4 processes share the cores; more threads per process only contend
    out = Path(args.output).resolve()
    data_dir = out / f"data-{args.max_bytes}B-seq{args.seq_len}-bpe{args.vocab}"  # other settings, other folder
    start = time.perf_counter()
    prepare_data(args, data_dir)
    prepared_s = time.perf_counter() - start

    from mula_lightning.lightning_cli import build_cli

    cli = build_cli(build_config(args, out, data_dir), run=False)
    trainer = cli.trainer
    trainer.fit(cli.model, cli.datamodule)
    if trainer.global_rank != 0:
        return 0
    train_s = time.perf_counter() - start - prepared_s

    from mula_lightning.report import render_report

    val_loss = float(trainer.callback_metrics["val/loss"])
    entropy = unigram_entropy(data_dir)
    csv_dir = Path(trainer.loggers[0].log_dir)
    plots = render_report(csv_dir)
    from mula_lightning.checkpoint.slots import newest_marked_slot

    dual = newest_marked_slot(out / "checkpoints" / "dual")  # rank 0 alone here: no collective lookup
    weights = sorted((out / "checkpoints" / "weights").glob("step-*"))
    gap = entropy - val_loss
    print("\n== mula-tiny-moe demo ==")
    dp = args.devices // args.ep_size
    print(f"layout            : {args.devices} CPU processes, DP={dp} x EP={args.ep_size} (epso)")
    print(f"steps             : {trainer.global_step}  (prepare {prepared_s:.0f} s, train+eval {train_s:.0f} s)")
    print(f"unigram entropy   : {entropy:.3f} nats/token (training split)")
    print(f"validation loss   : {val_loss:.3f} nats/token  (perplexity {math.exp(val_loss):.1f})")
    print(f"gap               : {gap:.3f} nats (required >= {args.min_gap})")
    print(f"checkpoint (dual) : {dual}  (resume: --ckpt_path last)")
    print(f"model-only (bf16) : {weights[-1] if weights else None}")
    print(f"NaN detector      : on (exit code 86, report in {out / 'checkpoints' / 'nan'})")
    print(f"logs (CSV)        : {csv_dir / 'metrics.csv'}")
    if args.wandb:
        print(f"logs (W&B offline): {out / 'runs' / 'wandb'}  (upload: wandb sync <run folder>)")
    print("plots             : " + ", ".join(str(p) for p in plots))
    print(f"export            : mula export {out / 'checkpoints' / 'dual'} --to hf {out / 'hf'}")
    if gap < args.min_gap:
        print(f"FAILED: the validation loss is not {args.min_gap} nats below the unigram entropy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
