"""The README and every guide under docs/ stay true: each code block is run here as it is written, run at a tiny scale
by a test of its own (``<!-- test: by NAME -->``), or marked as needing a GPU or a cluster and parsed; a block added
without a marker fails the suite (:mod:`mula_lightning.testing.doc_blocks` states the rule)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mula_lightning.cli import COMMANDS
from mula_lightning.testing import run_distributed_test
from mula_lightning.testing.doc_blocks import block_problems, doc_blocks, doc_pages, exec_doc_block

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = doc_blocks(ROOT)
RUN = [b for b in BLOCKS if b.kind == "run"]
SYNTAX = [b for b in BLOCKS if b.kind == "syntax"]


def test_every_block_is_marked_and_every_guide_is_linked():
    """No block lacks a marker (or carries a wrong one), every ``by`` block is read by a test, the README is a front
    page under 150 lines, and it links every guide under docs/."""
    assert block_problems(ROOT) == []
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    guides = [p.name for p in doc_pages(ROOT)[1:]]
    assert len(guides) >= 10 and [g for g in guides if f"(docs/{g})" not in readme] == []


def test_the_marker_check_fails_on_an_unmarked_or_misdeclared_block(tmp_path):
    """A copy of the pages with a new unmarked block, an indented code block, a 'by' block no test reads and a
    syntax block without a reason: each is named with its page and line."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "tests").mkdir()
    page = tmp_path / "docs" / "models.md"
    lines = page.read_text().splitlines()
    n = len(lines)  # the new lines are n + 1, n + 2, ...
    lines += ["", "```python", "print('new')", "```", "", "text", "", "    mula fit --config x.yaml", ""]
    lines += ["<!-- test: by nobody-reads-this -->", "```bash", "mula models", "```"]
    lines += ["<!-- test: syntax -->", "```bash", "mula models", "```", "<!-- test: output -->", "```bash", "ls", "```"]
    page.write_text("\n".join(lines) + "\n")
    problems = "\n".join(block_problems(tmp_path))
    assert f"models.md:{n + 2}: a python block without a '<!-- test: ... -->' line" in problems
    assert f"models.md:{n + 8}: an indented code block" in problems
    assert f'models.md:{n + 11}: no test calls doc_block("nobody-reads-this")' in problems
    assert f"models.md:{n + 15}: 'syntax' needs a reason" in problems
    assert f"models.md:{n + 19}: a 'output' block must be one of ('text',), not 'bash'" in problems


@pytest.mark.distributed
def test_a_failing_block_fails(tmp_path):
    """The runner is not a formality: a Python block that raises on one of two ranks fails the run, naming the
    page and line it came from."""
    source = "import torch.distributed as dist\nassert dist.get_rank() == 0, 'rank 1 disagrees'\n"
    with pytest.raises(Exception, match="rank 1 disagrees") as error:
        run_distributed_test(exec_doc_block, 2, source=source, cwd=str(tmp_path), filename="models.md:7", timeout=120)
    assert "models.md" in str(error.value)


@pytest.mark.parametrize("block", SYNTAX, ids=[b.where for b in SYNTAX])
def test_blocks_that_need_a_gpu_or_a_cluster_parse(block):
    """A block marked as needing what the suite lacks is still valid Python, bash or YAML, and the ``mula`` commands,
    scripts and make targets it names exist."""
    if block.lang == "python":
        ast.parse(block.text, block.where)
    elif block.lang == "yaml":
        assert isinstance(yaml.safe_load(block.text), dict)
    else:
        proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where}: {proc.stderr}"
        text = block.text.replace("\\\n", " ")
        for command in re.findall(r"(?:^|\s)mula (\w+)", text):  # what each line names exists
            assert command in COMMANDS, f"{block.where}: mula has no command {command!r}"
        for script in re.findall(r"python (\S+\.py)", text):
            assert (ROOT / script).is_file(), f"{block.where}: no {script}"
        makefile = (ROOT / "Makefile").read_text()
        for target in re.findall(r"^make ([\w-]+)", text, re.M):
            assert re.search(rf"^{target}:", makefile, re.M), f"{block.where}: the Makefile has no target {target}"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return env


@pytest.mark.distributed
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_block_runs_as_written(block, tmp_path):
    """The block as it is written, in a scratch folder holding a copy of examples/ and benchmarks/: Python on the
    ranks its marker names (each with torchrun's environment, so Fabric adopts them), shell lines with ``bash -e``
    and ``mula`` / ``python`` on the PATH; it exits 0."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks")
    if block.lang == "python":
        run_distributed_test(exec_doc_block, block.ranks, source=block.text, cwd=str(tmp_path), filename=block.where,
                             timeout=300)  # fmt: skip
        return
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name, command in (("mula", f'"{sys.executable}" -m mula_lightning.cli'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
