"""``mula report RUN_DIR``: PNG plots of a training run, read from its CSV log.

The CSV log (``metrics.csv`` of Lightning's :class:`CSVLogger`) holds one row per logging call with empty cells
for the keys not logged then; the plots read the columns they need and skip empty cells:

* ``loss.png``: training loss (LM + aux) and LM loss per step, validation loss at each validation;
* ``lr.png``: learning rate per step (warm-up, then cosine);
* ``throughput.png``: tokens/s (all ranks when the run had several, else rank 0's) from :class:`MulaThroughput`;
* ``expert_load.png``: a layers x experts heatmap of the share of routed tokens per expert, averaged over the
  last quarter of the logged steps, beside the per-layer load imbalance (max / mean) over steps (from
  :class:`MoEStats`).

A plot whose columns are absent (a dense model has no expert load) is skipped and reported. ``RUN_DIR`` is a
version folder (``runs/mula/version_3``: that log alone) or a run folder (``runs/mula``): its versions are joined in
order (:func:`join_runs`), since every ``mula fit`` (a resume included) and ``mula validate`` writes a new version,
and the plots of the newest alone showed steps 200-300 after a resume, one point after a validation. Another folder
above logs: the newest ``metrics.csv`` below it.
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Sequence
from pathlib import Path

PLOTS = ("loss.png", "lr.png", "throughput.png", "expert_load.png")
_EXPERT_KEY = re.compile(r"^moe/layer_(\d+)/expert_(\d+)$")
_IMBALANCE_KEY = re.compile(r"^moe/layer_(\d+)/imbalance$")


def find_metrics_csv(run_dir: str | Path) -> Path:
    """The run's ``metrics.csv``: ``run_dir``'s own, else the most recently written one below it."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"no metrics.csv under {run_dir}: {run_dir} does not exist")
    if (run_dir / "metrics.csv").is_file():
        return run_dir / "metrics.csv"
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {run_dir}: {_what_is_there(run_dir)}")
    return found[-1]


def find_run_logs(run_dir: str | Path) -> list[Path]:
    """The CSV logs of the run in ``run_dir``, oldest first: a version folder's own; a run folder's versions
    (``version_N/metrics.csv`` by N); else the newest ``metrics.csv`` below (:func:`find_metrics_csv`)."""
    run_dir = Path(run_dir)
    versions = [p for p in run_dir.glob("version_*/metrics.csv") if p.parent.name[8:].isdigit()]
    if (run_dir / "metrics.csv").is_file() or not versions:
        return [find_metrics_csv(run_dir)]
    return sorted(versions, key=lambda p: int(p.parent.name[8:]))


def join_runs(logs: list[dict[str, list[tuple[int, float]]]]) -> dict[str, list[tuple[int, float]]]:
    """One run's columns from its versions' (oldest first): a resume continues the series, replacing the steps it
    redid (a key's points from the resumed version's first step of that key on come from the resumed version); a
    version whose training starts no later than the joined run's did is a new run from scratch in the same folder,
    and the join starts again from it; a validation's version adds its points."""
    joined: dict[str, list[tuple[int, float]]] = {}
    for columns in logs:
        train = [step for step, _ in columns.get("train/loss", [])]
        started = [step for step, _ in joined.get("train/loss", [])]
        if train and started and min(train) <= min(started):
            joined = {}
        for key, points in columns.items():
            first = min(step for step, _ in points)
            joined[key] = [p for p in joined.get(key, []) if p[0] < first] + list(points)
    return joined


def _what_is_there(run_dir: Path) -> str:
    """Why a folder has no CSV log, from what it does hold."""
    marks = [p.relative_to(run_dir) for name in ("hparams.yaml", "config.yaml", "*.ckpt") for p in run_dir.rglob(name)]
    if marks:
        return (
            f"it holds {', '.join(str(m) for m in sorted(marks)[:3])} but no CSV log: the run's trainer.logger has no "
            "CSVLogger (mula fit adds one unless the config lists its own loggers), or it failed before logging"
        )
    return "is it a run folder of `mula fit` (CSVLogger)?"


def read_columns(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` for every non-empty cell of a Lightning CSV log."""
    columns: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, cell in row.items():
                if key in ("step", "epoch") or cell in (None, ""):
                    continue
                try:
                    columns.setdefault(key, []).append((step, float(cell)))
                except ValueError:
                    continue
    return columns


def _series(columns: dict, key: str) -> tuple[list[int], list[float]]:
    points = columns.get(key, [])
    return [s for s, _ in points], [v for _, v in points]


def _figure(title: str, xlabel: str = "step", ylabel: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax, plt


def plot_loss(columns: dict, out: Path) -> bool:
    if "train/loss" not in columns and "val/loss" not in columns:
        return False
    fig, ax, plt = _figure("loss", ylabel="nats / token")
    for key, style in (("train/loss", "-"), ("train/lm_loss", ":")):
        if key in columns:
            ax.plot(*_series(columns, key), style, label=key, linewidth=1)
    if "val/loss" in columns:
        ax.plot(*_series(columns, "val/loss"), "o-", label="val/loss", markersize=4)
    ax.legend()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_lr(columns: dict, out: Path) -> bool:
    if "train/lr" not in columns:
        return False
    fig, ax, plt = _figure("learning rate", ylabel="lr")
    ax.plot(*_series(columns, "train/lr"))
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_throughput(columns: dict, out: Path) -> bool:
    key = "train/items_per_sec" if "train/items_per_sec" in columns else "train/device/items_per_sec"
    if key not in columns:
        return False
    fig, ax, plt = _figure("training throughput", ylabel="tokens / s")
    ax.plot(*_series(columns, key), label="all ranks" if key == "train/items_per_sec" else "rank 0")
    if "train/device/mfu" in columns:
        ax2 = ax.twinx()
        ax2.plot(*_series(columns, "train/device/mfu"), "r:", label="MFU")
        ax2.set_ylabel("MFU")
    ax.legend(loc="lower right")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def expert_load_matrix(columns: dict) -> list[list[float]] | None:
    """(layers, experts) share of routed tokens, averaged over the last quarter of the logged steps."""
    cells = {}
    for key, points in columns.items():
        match = _EXPERT_KEY.match(key)
        if match and points:
            tail = points[len(points) - max(1, len(points) // 4) :]
            cells[(int(match[1]), int(match[2]))] = sum(v for _, v in tail) / len(tail)
    if not cells:
        return None
    layers = 1 + max(i for i, _ in cells)
    experts = 1 + max(e for _, e in cells)
    return [[cells.get((i, e), 0.0) for e in range(experts)] for i in range(layers)]


def plot_expert_load(columns: dict, out: Path) -> bool:
    matrix = expert_load_matrix(columns)
    if matrix is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    image = left.imshow(matrix, aspect="auto", cmap="viridis")
    left.set_title("share of routed tokens per expert (last quarter of steps)")
    left.set_xlabel("expert")
    left.set_ylabel("layer")
    left.set_yticks(range(len(matrix)))
    fig.colorbar(image, ax=left)
    for key in sorted(k for k in columns if _IMBALANCE_KEY.match(k)):
        right.plot(*_series(columns, key), label=key.split("/")[1], linewidth=1)
    right.set_title("load imbalance (max / mean)")
    right.set_xlabel("step")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def render_report(run_dir: str | Path, output: str | Path | None = None) -> list[Path]:
    """Write the plots of the run in ``run_dir`` (a version folder, or a run folder: its versions joined) to
    ``output`` (default ``plots`` beside the log, or in the run folder); return them."""
    logs = find_run_logs(run_dir)
    csv_path = logs[-1] if len(logs) == 1 else Path(run_dir)
    out_dir = Path(output) if output is not None else (logs[0].parent if len(logs) == 1 else Path(run_dir)) / "plots"
    columns = join_runs([read_columns(path) for path in logs])
    if not any(key.startswith(("train/", "val/")) for key in columns):
        logged = ", ".join(sorted(columns)[:6]) or "nothing"
        raise ValueError(
            f"{csv_path}: no training or validation metrics (it holds {logged}): the run stopped before its first "
            "logged step (trainer.log_every_n_steps larger than the steps it ran, without mula fit's last_step "
            "callback) or failed before it"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in zip(PLOTS, (plot_loss, plot_lr, plot_throughput, plot_expert_load)):
        if plot(columns, out_dir / name):
            written.append(out_dir / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``mula report RUN_DIR [--output DIR]``."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="mula report", description="PNG plots of a run from its CSV log.")
    parser.add_argument("run_dir", type=str, help="run folder (runs/<name>/version_N) or a folder above it")
    parser.add_argument("--output", type=str | None, default=None, help="plot folder (default: <run>/plots)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        written = render_report(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"mula report: error: {e}", file=sys.stderr)
        return 1
    missing = [name for name in PLOTS if name not in {p.name for p in written}]
    for path in written:
        print(path)
    if missing:
        print(f"(skipped, no data in the log: {', '.join(missing)})")
    return 0
