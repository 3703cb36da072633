"""fit -> export -> transformers without seams: a `mula fit` checkpoint exports with no --config, and the export
loads in ``AutoTokenizer`` / ``AutoModelForCausalLM`` with the training tokenizer and the data's EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mula_lightning import cli as mula_cli
from mula_lightning.checkpoint.export import read_checkpoint
from mula_lightning.data.manifest import DataManifest

TEXT = "def main():\n    return 42  # the answer\n"


def _fit(tiny_config: dict, tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    assert mula_cli.main(["fit", "--config", str(path)]) == 0
    (ckpt,) = (tmp_path / "runs" / "tiny" / "version_0" / "checkpoints").glob("*.ckpt")
    return ckpt


def test_fit_checkpoint_exports_without_config_and_loads_in_transformers(tiny_config, tiny_data, tmp_path, capsys):
    """`mula export CKPT --to hf OUT` (no --config) on a `mula fit` checkpoint: the config comes with the checkpoint
    (vocabulary resolved from the data), AutoTokenizer round-trips text with the data's token ids, the HF model's
    logits equal the project's model on those ids, config / generation config name the data's EOS inside the
    vocabulary, every file is readable by others, and greedy ``generate`` stops at EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mula_lightning.data.tokenizer import load_tokenizer

    ckpt = _fit(tiny_config, tmp_path)
    out = tmp_path / "hf"
    assert mula_cli.main(["export", str(ckpt), "--to", "hf", str(out)]) == 0
    manifest = DataManifest.load(tiny_data)
    assert f"EOS id {manifest.eos_id}" in capsys.readouterr().out

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == load_tokenizer(manifest.tokenizer_path).encode(TEXT).ids and len(ids) > 5
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token_id == manifest.eos_id == tokenizer.pad_token_id

    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == manifest.eos_id < config["vocab_size"]
    assert all((p.stat().st_mode & 0o044) == 0o044 for p in out.iterdir()), "an export is for others to read"

    mula_model, data = read_checkpoint(ckpt)
    assert data["eos_id"] == manifest.eos_id and mula_model.config.vocab_size == config["vocab_size"]
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, mula_model.eval()(x).logits, rtol=1e-5, atol=1e-5)

    # Greedy decoding with every logit equal picks id 0, the EOS of a trained tokenizer: generation must stop there
    # (without the exported EOS it would run to max_new_tokens).
    assert manifest.eos_id == 0
    with torch.no_grad():
        hf_model.lm_head.weight.zero_()
        generated = hf_model.generate(x, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == x.shape[1] + 1 and generated[0, -1].item() == manifest.eos_id


def test_config_flag_still_overrides_and_a_foreign_checkpoint_asks_for_it(tiny_config, tmp_path):
    """--config overrides the stored config (a wrong one is named by the shape check); a checkpoint without the
    stored entry (another LightningModule's) asks for --config by name."""
    ckpt = _fit(tiny_config, tmp_path)
    with pytest.raises(ValueError, match="does not match config 'mula-tiny-dense'"):
        read_checkpoint(ckpt, "mula-tiny-dense")
    raw = torch.load(ckpt, weights_only=True)
    raw.pop("mula")
    foreign = tmp_path / "foreign.ckpt"
    torch.save(raw, foreign)
    with pytest.raises(ValueError, match="holds no model config; pass --config"):
        read_checkpoint(foreign)
