"""The training guide's journey, command by command, at a tiny scale: prepare -> fit -> resume -> validate -> report
-> export -> transformers -> generate; a dense model -> upcycle -> continue training -> export. The README's quick
start is a part of it.

The commands are read from the block of docs/training.md marked ``<!-- test: by journey -->`` and run as they are, in
a fresh folder holding a copy of ``examples/``, with a few appended overrides that only shrink the work (a 512-token
BPE on 300 kB, a 2-layer width-32 model, 2 processes, 4 + 2 steps instead of 200 + 100): an edit that breaks a
command breaks this test. Each ``mula`` command runs in its own interpreter, so ``mula fit`` starts its second process
with Lightning's own launcher, as on a user's machine.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mula_lightning.testing.doc_blocks import doc_block

ROOT = Path(__file__).resolve().parents[2]
TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 32}
STEPS = {"200": "4", "300": "6"}  # the guide's step counts, shrunk


def _commands(block) -> list[str]:
    lines = [line.strip() for line in block.text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def journey_commands() -> list[str]:
    return _commands(doc_block("journey"))


def _shrink(argv: list[str]) -> list[str]:
    """The guide's command with the test's scale: step counts shrunk, tiny model, 2 processes, frequent logging."""
    argv = [STEPS.get(a, a) for a in argv]
    argv = [re.sub(r"step-00000300$", "step-00000006", a) for a in argv]
    if argv[:3] == ["mula", "data", "prepare"]:
        return [*argv, "--seq-len", "32", "--train-tokenizer", "512", "--max-bytes", "300000", "--workers", "0"]
    if argv[:2] in (["mula", "fit"], ["mula", "validate"]):
        config = argv[argv.index("--config") + 1]
        extra = ["--trainer.devices", "2", "--data.micro_batch_size", "4", "--trainer.limit_val_batches", "2"]
        extra += ["--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1"]
        if "upcycled" not in config:  # the upcycled model's config comes from init_from
            overrides = dict(TINY, **({"num_experts": 4, "top_k": 2} if "moe" in config else {}))
            extra += ["--model.model_overrides", json.dumps(overrides)]
        if argv[1] == "fit" and "--trainer.max_steps" not in argv:
            extra += ["--trainer.max_steps", "6"]
        return [*argv, *extra]
    return argv


def _run(argv: list[str], cwd: Path) -> str:
    if argv[0] == "mula":
        argv = [sys.executable, "-m", "mula_lightning.cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_journey_runs_end_to_end(tmp_path):
    """Every command of the journey (the README's quick start among them) exits 0; the resumed run logs steps 4 and 5
    only (it continued, it did not restart) and leaves step 6 in the newest dual slot; the exports (and that of a
    model-only checkpoint, whose tokenizer also reaches the upcycled model) load in ``AutoTokenizer`` +
    ``AutoModelForCausalLM`` with the data's tokenizer, and a greedy ``generate`` stops at the data's EOS; the
    upcycled model trained further is an 8-expert MoE."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mula_lightning.checkpoint.export import main as export_main
    from mula_lightning.checkpoint.slots import resolve_last, slot_step
    from mula_lightning.data.manifest import DataManifest
    from mula_lightning.data.tokenizer import load_tokenizer

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    commands = journey_commands()
    missing = [c for c in _commands(doc_block("quickstart")) if c not in commands]  # the README's quick start
    assert missing == [], missing
    assert any(c.startswith("mula upcycle") for c in commands) and any("--ckpt_path last" in c for c in commands)
    for command in commands:
        output = _run(_shrink(shlex.split(command)), tmp_path)
        if "--ckpt_path last" in command and command.startswith("mula fit"):  # resumed at step 4, not restarted
            assert slot_step(resolve_last(tmp_path / "checkpoints" / "mula-tiny-moe" / "dual")) == 6
            with open(tmp_path / "runs" / "mula-tiny-moe" / "version_1" / "metrics.csv", newline="") as f:
                steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
            assert steps == [4, 5], steps
        if command.startswith("python examples/generate.py"):
            generate_argv, generate_output = shlex.split(command), output

    # model-only checkpoints carry the tokenizer too: through `mula upcycle`, and into an export of their own
    assert (tmp_path / "checkpoints" / "mula-tiny-upcycled" / "start" / "tokenizer.json").is_file()
    weights = tmp_path / "checkpoints" / "mula-tiny-moe" / "weights" / "step-00000006"
    assert export_main([str(weights), "--to", "hf", str(tmp_path / "out" / "step6")]) == 0  # `mula export`, in-process

    # the example's printed text is transformers' own greedy continuation of the prompt by the exported model (the
    # prompt alone, or another model's text, would differ: the continuation is checked, not the echoed prompt)
    model_dir, prompt = tmp_path / generate_argv[2], generate_argv[3]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=20, do_sample=False)
    assert expected.shape[1] > ids["input_ids"].shape[1]
    assert tokenizer.decode(expected[0]) in generate_output

    manifest = DataManifest.load(tmp_path / "data" / "stdlib")
    text = "import os\nprint(os.getcwd())\n"
    for name, experts in (("tiny-moe-hf", 4), ("tiny-upcycled-hf", 8), ("step6", 4)):
        out = tmp_path / "out" / name
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer(text)["input_ids"] == load_tokenizer(manifest.tokenizer_path).encode(text).ids
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        config = model.config  # Mixtral names the experts num_local_experts, OLMoE num_experts
        assert (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)) == experts
        x = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():  # every logit equal: greedy picks id 0, the trained tokenizer's EOS, and must stop
            model.lm_head.weight.zero_()
            generated = model.generate(x, max_new_tokens=8, do_sample=False)
        assert manifest.eos_id == 0 and generated.shape[1] == x.shape[1] + 1 and generated[0, -1].item() == 0
