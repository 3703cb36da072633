"""The package's structure rules (DESIGN.md): no private name imported across modules, no empty package.

Checked on the source text (AST), so a violation is named with its file and line before anyone has to find it in
review. (The import-cycle rule joins these once the models <-> moe cycle is gone: see the architecture issue.)
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mula_lightning"


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_private_name_is_imported_across_modules():
    """`from mula_lightning.x import _name` (at any depth of a file) is refused: shared helpers are public leaves."""
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mula_lightning"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {private} from {node.module}")
    assert not offenders, "\n".join(offenders)


def test_no_empty_package():
    """Every package holds code besides a docstring (an empty placeholder package is removed until it is filled)."""
    empty = []
    for init in PACKAGE.rglob("__init__.py"):
        modules = [p for p in init.parent.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
        body = [n for n in ast.parse(init.read_text()).body if not isinstance(n, ast.Expr)]
        if (
            not modules
            and not body
            and not any(p.is_dir() and (p / "__init__.py").exists() for p in init.parent.iterdir())
        ):
            empty.append(str(init.parent.relative_to(PACKAGE)))
    assert not empty, f"empty packages: {empty}"
