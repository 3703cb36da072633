"""Generate the layout tables of docs/plan.md from ``mula plan`` (never typed by hand), or check that they are current.

    .venv/bin/python scripts/plan_tables.py          # rewrite the block between the markers of docs/plan.md
    .venv/bin/python scripts/plan_tables.py --check  # exit 1 (naming the first differing line) if it is stale

One row per shipped recipe (``examples/configs/mula-{20b-a2b,100b-a7b,220b-a10b}.yaml``) planned on the cluster and
node count its YAML states (Aurora, 256 nodes): the layout, the worst pipeline stage's memory per rank by kind,
whether it fits, the predicted step time, tokens/s and MFU; then, per recipe, the three fastest layouts
``mula plan --search`` finds at the same global batch; then each recipe with ``--optimizer muon``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b")
START, END = "<!-- plan-tables:start -->", "<!-- plan-tables:end -->"


def _gb(value: int) -> str:
    return f"{value / 1e9:.1f}"


def _recompute(value) -> str:
    return "+".join(value) if isinstance(value, list) else (value or "none")


def _sizes(p: dict) -> str:
    """``DP x EP (x ETP) x PP``, and the dense layers' ``TP`` (with sequence parallelism) where there is one."""
    out = f"DP {p['dp']} x EP {p['ep']}" + (f" x ETP {p['etp']}" if p["etp"] > 1 else "") + f" x PP {p['pp']}"
    return out + (f" x TP {p['tp']}" + (" SP" if p["sp"] else "") if p["tp"] > 1 else "")


def tables() -> str:
    """The markdown block (without the markers)."""
    sys.path.insert(0, str(ROOT / "src"))
    from mula_lightning.plan.cli import plan

    lines = [
        "Memory per rank of the worst pipeline stage (GB), as `mula plan --config examples/configs/<recipe>.yaml` "
        "prints it (Aurora, 256 nodes of 12 tiles of 64 GB, 4 GB reserved; step times from the stated assumptions "
        "of `mula_lightning.plan.step_time` and nominal link bandwidths):",
        "",
        "| recipe | layout | recompute | weights | grads | master | moments | activations | buffers | total | fits "
        "| step s | M tokens/s | MFU |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    searched, muon = [], []
    for recipe in RECIPES:
        config = str(ROOT / "examples" / "configs" / f"{recipe}.yaml")
        (p,) = plan(["--config", config])["layouts"]
        (q,) = plan(["--config", config, "--optimizer", "muon"])["layouts"]
        n = q["muon"]
        muon.append(
            f"| {recipe} | {_gb(p['memory_bytes']['master'] + p['memory_bytes']['moments'])} | "
            f"{_gb(q['memory_bytes']['master'] + q['memory_bytes']['moments'])} | {_gb(q['memory_bytes']['total'])} | "
            f"{max(n['elements']) / 1e6:.0f} | {max(n['newton_schulz_flops']) / 1e12:.1f} | "
            f"{q['time']['optimizer_s']:.3f} | {p['step_time_s']:.2f} | {q['step_time_s']:.2f} |"
        )
        m = p["memory_bytes"]
        layout = f"{p['strategy']} {p['mode'] or ''} {_sizes(p)}".replace("  ", " ")
        lines.append(
            f"| {recipe} | {layout} | {_recompute(p['activation_checkpointing'])} | {_gb(m['weights'])} | "
            f"{_gb(m['gradients'])} | {_gb(m['master'])} | {_gb(m['moments'])} | {_gb(m['activations'])} | "
            f"{_gb(m['buffers'])} | {_gb(m['total'])} | {'yes' if p['fits'] else 'no'} | {p['step_time_s']:.2f} | "
            f"{p['tokens_per_s'] / 1e6:.2f} | {100 * p['mfu']:.1f}% |"
        )
        found = plan(["--config", config, "--search"])
        for rank, q in enumerate(found["layouts"][:3]):
            name = f"{q['strategy']} {q['mode'] or ''}".strip()
            searched.append(
                f"| {recipe if rank == 0 else ''} | {rank + 1} | {name} {_sizes(q)} | "
                f"{_recompute(q['activation_checkpointing'])} | {_gb(q['memory_bytes']['total'])} | "
                f"{q['step_time_s']:.2f} | {100 * q['mfu']:.1f}% |"
            )
        searched.append(f"| | | {len(found['layouts'])} fit, {len(found['rejected'])} rejected | | | | |")
    lines += [
        "",
        "The fastest layouts `mula plan --config examples/configs/<recipe>.yaml --search` finds at the same global "
        "batch (3072 sequences of 2048 tokens):",
        "",
        "| recipe | # | layout | recompute | total GB | step s | MFU |",
        "|---|--:|---|---|--:|--:|--:|",
        *searched,
        "",
        "The same recipes with `--optimizer muon` (Muon on the layers' matrices, each owned whole by one rank: the "
        "busiest owner's momentum and master, its Newton-Schulz FLOPs in the step time at the same matmul rate):",
        "",
        "| recipe | AdamW master + moments GB | Muon master + moments GB | Muon total GB | busiest owner's M "
        "elements | its Newton-Schulz TFLOP | its Newton-Schulz s | AdamW step s | Muon step s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        *muon,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--page", default=str(ROOT / "docs" / "plan.md"))
    args = parser.parse_args(argv)
    page = Path(args.page)
    text = page.read_text()
    if START not in text or END not in text:
        print(f"{page}: the markers {START} / {END} are missing", file=sys.stderr)
        return 1
    before, rest = text.split(START, 1)
    current, after = rest.split(END, 1)
    fresh = "\n" + tables() + "\n"
    if args.check:
        if current == fresh:
            return 0
        old, new = current.splitlines(), fresh.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        print(f"{page}: the layout tables are stale at line {first + 1} of the block; run scripts/plan_tables.py\n"
              f"  page:      {old[first] if first < len(old) else '(nothing)'}\n"
              f"  generated: {new[first] if first < len(new) else '(nothing)'}", file=sys.stderr)  # fmt: skip
        return 1
    page.write_text(before + START + fresh + END + after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
