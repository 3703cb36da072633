"""The package's structure rules (DESIGN.md): no import cycle between files, no private name imported across
modules, no empty package.

Checked on the source text (AST), so a violation is named with its files and lines before anyone has to find it in
review. Imports inside functions count too: a cycle hidden behind a lazy import is still a cycle of the design.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mula_lightning"


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """module -> {imported module: line} for every import of a mula_lightning module, at any depth of the file."""
    modules = {_module_name(p): p for p in _modules()}
    graph = {}
    for name, path in modules.items():
        edges = {}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        type_only = {  # imports under `if TYPE_CHECKING:` never run, so they cannot form a cycle
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def test_no_import_cycle_between_files():
    """Dependencies point one way (utils <- moe <- models <- parallel <- ... <- cli): no file reaches itself again."""
    graph = _import_graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                cycles.append(" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_moe_imports_nothing_from_models():
    """The MoE layer is configured by its own leaf MoEConfig, never by the model config."""
    graph = _import_graph()
    bad = {m: sorted(t for t in edges if t.startswith("mula_lightning.models")) for m, edges in graph.items()}
    bad = {m: t for m, t in bad.items() if m.startswith("mula_lightning.moe") and t}
    assert not bad, bad


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


def test_the_moe_block_is_never_subclassed():
    """One MoE forward: expert parallelism and every other transport swap the block's token dispatcher in place
    (``TokenDispatcher``); no class of the package derives from FastSparseMoEBlock to repeat its forward."""
    subclasses = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any("FastSparseMoEBlock" in ast.unparse(b) for b in node.bases):
                subclasses.append(f"{path.relative_to(PACKAGE)}:{node.lineno} class {node.name}")
    assert not subclasses, subclasses
