"""The code blocks of a project's Markdown pages and the test marker each carries, so that no guide goes stale.

Every fenced block of ``README.md`` and ``docs/*.md`` is preceded by one marker line saying how the suite checks it:

* ``<!-- test: run -->``: the suite runs the block as it is written (Python as a script on one gloo rank, or on
  ``ranks=N`` ranks with ``<!-- test: run ranks=N -->``, each rank launched as ``torchrun`` would; shell lines by
  ``bash -e`` in a scratch folder holding a copy of ``examples/``, with ``mula`` and ``python`` on the ``PATH``);
* ``<!-- test: by NAME -->``: a test of its own runs it (at a tiny scale, as ``tests/training/test_journey.py`` runs
  the journey) and reads it with ``doc_block("NAME")``; the marker check fails unless some test file says so;
* ``<!-- test: syntax: REASON -->``: it needs what the suite does not have (a GPU, a cluster, hours), so it is only
  parsed (``bash -n``, ``compile``, YAML); the reason is required;
* ``<!-- test: output -->``: what a command printed (a ``text`` block), not code.

:func:`block_problems` lists what breaks that rule (an unmarked block, an unknown marker, an indented code block,
a ``by`` name no test reads); the suite fails on any.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DocBlock", "block_problems", "doc_block", "doc_blocks", "doc_pages", "exec_doc_block"]

_MARKER = re.compile(r"^<!--\s*test:\s*(?P<kind>run|by|syntax|output)\b:?\s*(?P<arg>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```\s*(?P<lang>[\w+-]*)\s*$")
_LANGS = {
    "run": ("python", "bash"),
    "by": ("python", "bash"),
    "syntax": ("python", "bash", "yaml"),
    "output": ("text",),
}


@dataclass(frozen=True)
class DocBlock:
    """One fenced block: where it is, its language, how it is tested (``kind``, ``arg``) and its text."""

    path: Path
    line: int
    lang: str
    kind: str
    arg: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def ranks(self) -> int:
        """The ranks a ``run ranks=N`` block needs (1 otherwise)."""
        match = re.fullmatch(r"ranks=(\d+)", self.arg)
        return int(match.group(1)) if match else 1


def doc_pages(root: str | os.PathLike) -> list[Path]:
    """``README.md`` and every page under ``docs/`` of the project at ``root``."""
    root = Path(root)
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _parse(path: Path) -> tuple[list[DocBlock], list[str]]:
    blocks, problems = [], []
    lines = path.read_text().splitlines()
    i, marker, previous_blank = 0, None, True
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                problems.append(f"{path.name}:{start}: a code block is never closed")
            lang = fence.group("lang")
            if marker is None:
                problems.append(f"{path.name}:{start}: a {lang or 'plain'} block without a '<!-- test: ... -->' line")
                kind, arg = "", ""
            else:
                kind, arg = marker.group("kind"), marker.group("arg")
                if lang not in _LANGS[kind]:
                    problems.append(
                        f"{path.name}:{start}: a '{kind}' block must be one of {_LANGS[kind]}, not {lang!r}"
                    )
                if kind in ("by", "syntax") and not arg:
                    problems.append(f"{path.name}:{start}: '{kind}' needs a {'name' if kind == 'by' else 'reason'}")
                if kind == "run" and arg and not re.fullmatch(r"ranks=\d+", arg):
                    problems.append(f"{path.name}:{start}: 'run' takes only ranks=N, not {arg!r}")
            blocks.append(DocBlock(path, start, lang, kind, arg, "\n".join(body) + "\n"))
            marker, previous_blank = None, False
        else:
            stripped = line.strip()
            if stripped.startswith("<!--") and "test:" in stripped:
                marker = _MARKER.match(stripped)
                if marker is None:
                    problems.append(f"{path.name}:{i + 1}: an unknown marker {stripped!r}")
            elif stripped:
                marker = None
            if line.startswith("    ") and previous_blank and stripped and not stripped.startswith(("-", "*", "|")):
                problems.append(f"{path.name}:{i + 1}: an indented code block (use a fenced block with a marker)")
            previous_blank = not stripped
        i += 1
    return blocks, problems


def doc_blocks(root: str | os.PathLike) -> list[DocBlock]:
    """Every fenced block of the project's pages, in page order."""
    return [block for page in doc_pages(root) for block in _parse(page)[0]]


def doc_block(name: str, root: str | os.PathLike | None = None) -> DocBlock:
    """The block marked ``<!-- test: by NAME -->`` (a test that runs it calls this with the literal name)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[3]
    found = [b for b in doc_blocks(root) if b.kind == "by" and b.arg == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} blocks are marked '<!-- test: by {name} -->' (expected exactly one)")
    return found[0]


def block_problems(root: str | os.PathLike, tests: str | os.PathLike | None = None) -> list[str]:
    """What breaks the marker rule in the project's pages: unmarked or misdeclared blocks, indented code blocks,
    ``by`` names used twice or read by no file under ``tests`` (a test reads its block with ``doc_block("NAME")``)."""
    root = Path(root)
    problems, names = [], {}
    for page in doc_pages(root):
        blocks, found = _parse(page)
        problems += found
        for block in blocks:
            if block.kind == "by":
                if block.arg in names:
                    problems.append(f"{block.where}: 'by {block.arg}' is used by {names[block.arg]} too")
                names[block.arg] = block.where
    tests = Path(tests) if tests is not None else root / "tests"
    sources = "\n".join(p.read_text() for p in sorted(tests.rglob("*.py")))
    for name, where in names.items():
        if f'doc_block("{name}"' not in sources:
            problems.append(f'{where}: no test calls doc_block("{name}") to run this block')
    return problems


def exec_doc_block(rank: int, world_size: int, source: str, cwd: str, filename: str) -> None:
    """Run a Python block as a ``__main__`` script in ``cwd`` on one rank of ``run_distributed_test`` (whose
    environment is torchrun's: Lightning's launcher adopts the ranks instead of starting its own)."""
    os.chdir(cwd)
    code = compile(source, filename, "exec")
    exec(code, {"__name__": "__main__", "__file__": filename})
