"""``mula plan --plot FILE.png``: memory per rank as stacked bars (one per pipeline stage of a layout, or per layout
of a search), with the device's usable memory as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STACKED = ("weights", "gradients", "master", "moments", "activations", "buffers")


def _bars(result: dict[str, Any], top: int) -> tuple[list[str], list[dict[str, int]]]:
    if result.get("search"):
        layouts = result["layouts"][:top]
        labels = [f"{p['strategy'][:4]} {p['mode'] or ''}\n{p['dp']}x{p['ep']}x{p['pp']}" for p in layouts]
        return labels, [p["memory_bytes"] for p in layouts]
    (layout,) = result["layouts"]
    return [f"stage {i}" for i in range(len(layout["stages"]))], layout["stages"]


def plot_memory(result: dict[str, Any], path: str | Path, top: int = 10) -> Path:
    """Write the figure of a ``mula plan`` result (:func:`~mula_lightning.plan.cli.plan`) to ``path``.

    Raises:
        ValueError: naming the path when it is not a .png, .pdf or .svg file, or the result has nothing to draw.
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--plot {path}: the figure is written as .png, .pdf or .svg")
    labels, rows = _bars(result, top)
    if not rows:
        raise ValueError(f"--plot {path}: no layout fits, nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cluster = result["cluster"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(rows) + 3), 4.5))
    bottom = [0.0] * len(rows)
    for kind in STACKED:
        values = [row[kind] / 1e9 for row in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    usable = (cluster["memory_bytes"] - cluster["reserved_bytes"]) / 1e9
    ax.axhline(usable, color="black", linestyle="--", linewidth=1, label=f"usable ({usable:.0f} GB)")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("GB per rank")
    what = "fastest layouts that fit" if result.get("search") else "pipeline stages"
    ax.set_title(f"{result['model']['name']} on {cluster['nodes']} {cluster['name']} nodes: {what}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
