"""``mula models``: the preset table with analytic parameter counts (and Table 1's published figures)."""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import ArgumentParser

from mula_lightning.models.config import PRESETS, TABLE1_BILLIONS, MulaConfig


def parameter_table() -> str:
    """A text table of every preset: shape, total and active parameters, and Table 1's numbers (E counts routed +
    shared experts where a preset has shared ones; K the routed experts a token chooses)."""
    header = (
        f"{'preset':<20}{'layers':>7}{'hidden':>7}{'heads':>6}{'inter':>6}{'E':>7}{'K':>3}"
        f"{'total':>12}{'active':>12}{'Table 1 total/active':>23}"
    )
    rows = [header, "-" * len(header)]
    for name in PRESETS:
        c = MulaConfig.from_name(name)
        total, active = c.num_params(), c.num_params(active=True)
        paper = TABLE1_BILLIONS.get(name)
        paper_s = f"{paper[0]:g}B / {paper[1]:g}B" if paper else "-"
        experts = f"{c.num_experts}+{c.shared_experts}" if c.shared_experts else str(c.num_experts)
        rows.append(
            f"{name:<20}{c.num_layers:>7}{c.hidden_size:>7}{c.num_heads:>6}{c.intermediate_size:>6}"
            f"{experts:>7}{c.top_k:>3}{_human(total):>12}{_human(active):>12}{paper_s:>23}"
        )
    return "\n".join(rows)


def _human(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K"


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="mula models", description=__doc__)
    parser.parse_args(list(argv or []))
    print(parameter_table())
    return 0
