"""The layout tables of docs/plan.md are what ``mula plan`` computes today (``scripts/plan_tables.py --check``), and the
check fails on a stale table."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("plan_tables", ROOT / "scripts" / "plan_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_guide_tables_are_generated_and_current(tmp_path, capsys):
    """--check passes on docs/plan.md; a copy with one number changed fails, naming the stale line."""
    script = _script()
    assert script.main(["--check"]) == 0, capsys.readouterr().err
    text = (ROOT / "docs" / "plan.md").read_text()
    block = text.split(script.START)[1].split(script.END)[0]
    row = next(line for line in block.splitlines() if line.startswith("| mula-100b-a7b |"))
    stale = tmp_path / "plan.md"
    stale.write_text(text.replace(row, row.replace("| yes |", "| no |")))
    assert script.main(["--check", "--page", str(stale)]) == 1
    assert "the layout tables are stale" in capsys.readouterr().err
