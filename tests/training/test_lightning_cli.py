"""`mula fit | validate` through LightningCLI: every shipped YAML parses, an end-to-end run logs what `mula report`
plots, and bad input (unknown key, tokenizer of other data) fails before training with a message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mula_lightning import cli as mula_cli
from mula_lightning.lightning_cli import MulaCLI, build_cli, config_parser_kwargs
from mula_lightning.models import MulaConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))


class _ParseOnly(MulaCLI):
    """Parse and validate the config (class paths, argument names and types) without instantiating anything."""

    def instantiate_classes(self) -> None:
        pass


def _write(config: dict, path: Path) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_examples_ship_every_preset():
    """One YAML per paper preset, the CPU ones (the demo's MoE, its dense counterpart, its upcycled continuation, its
    MoE-parallel-folding, pipeline and long-sequence (context-parallel) layouts, its Muon + WSD recipe), and the
    upcycling recipe."""
    names = {p.stem for p in CONFIGS}
    presets = {"mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b", "mula-tiny-moe"}
    cpu = {
        "mula-tiny-dense",
        "mula-tiny-upcycled",
        "mula-tiny-moe-folded",
        "mula-tiny-moe-pipeline",
        "mula-tiny-moe-zero-topo",
        "mula-tiny-moe-muon",
        "mula-tiny-moe-long",
    }
    assert names == presets | cpu | {"upcycle-llama3-8b-e8t2"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_yaml_parses_and_fits_its_model(path):
    """jsonargparse accepts every key of the YAML; its ep_size divides the preset's experts and devices x nodes, its
    tp_size the processes and the model's heads and vocabulary, the paper presets keep context 2048 and a 6.3M-token
    global batch (micro-batch x data-parallel ranks of a stage x accumulation), its pp_size x virtual stages divide
    the layers and the processes, its cp_size the processes beside tp_size and 2 x cp_size its sequence length, and
    every recipe (the CPU ones included) trains with the paper's reliability
    callbacks (DualCheckpoint, ModelOnlyCheckpoint, NaNDetector)."""
    import mula_lightning.strategies  # noqa: F401

    cli = _ParseOnly(run=False, args=["--config", str(path)], parser_kwargs=config_parser_kwargs(),
                     **_cli_classes())  # fmt: skip
    config = cli.config
    assert "${" not in str(config.as_dict())  # every interpolation resolved
    strategy = config.trainer.strategy
    ep_size = strategy.init_args.ep_size
    spec = config.model.model
    model = MulaConfig.from_name(spec) if isinstance(spec, str) else MulaConfig(**dict(spec))
    world = config.trainer.devices * config.trainer.num_nodes
    assert world % ep_size == 0
    assert model.num_experts % ep_size == 0 if model.is_moe else ep_size == 1
    tp_size = strategy.init_args.get("tp_size", 1)
    if tp_size > 1:
        from mula_lightning.parallel.mesh import ParallelDims
        from mula_lightning.parallel.tensor_parallel import check_tensor_parallel

        ParallelDims(world, tp=tp_size, ep=ep_size)
        check_tensor_parallel(MulaConfig(**{**model.to_dict(), "vocab_size": 4096}), tp_size)  # the demo's data
    pp_size = strategy.init_args.get("pp_size", 1)
    if pp_size > 1:
        from mula_lightning.parallel.mesh import ParallelDims
        from mula_lightning.parallel.pipeline import stage_layer_ranges

        ParallelDims(world, pp=pp_size, tp=tp_size, ep=ep_size)
        stage_layer_ranges(model.num_layers, pp_size * strategy.init_args.get("pp_virtual_stages", 1))
        assert config.data.micro_batch_size % (strategy.init_args.get("pp_microbatches") or 1) == 0
    cp_size = strategy.init_args.get("cp_size", 1)
    if cp_size > 1:  # its ranks beside tp in a stage, and 2 x cp chunks of the data's sequences
        from mula_lightning.parallel.context_parallel import check_sequence_length
        from mula_lightning.parallel.mesh import ParallelDims

        ParallelDims(world, pp=pp_size, tp=tp_size, cp=cp_size, ep=ep_size)
        check_sequence_length(config.data.seq_len, cp_size)
    if config.data.global_batch_size:
        distinct = world // (pp_size * tp_size * cp_size)  # batches per step: the pp, tp and cp ranks read one
        accumulate = config.trainer.accumulate_grad_batches or 1
        assert config.data.micro_batch_size * distinct * accumulate == config.data.global_batch_size
    if path.stem.startswith("upcycle"):  # the Llama-3 upcycling recipe: CF 4, 3e-5 -> 3e-7, 100 warm-up steps
        assert (
            model.capacity_factor == 4.0
            and model.router_kind == "topk_softmax"
            and (model.num_experts, model.top_k) == (8, 2)
        )
        assert (config.model.lr, config.model.min_lr, config.model.warmup_steps) == (3e-5, 3e-7, 100)
        assert strategy.init_args.init_from_dense
    elif not path.stem.startswith("mula-tiny"):
        assert config.data.seq_len == 2048
        assert abs(config.data.global_batch_size * config.data.seq_len - 6.3e6) < 0.05e6
        assert config.model.lr == 4e-4 and config.model.min_lr == 4e-5 and config.model.warmup_steps == 2500
    classes = {c.class_path.rsplit(".", 1)[-1] for c in config.trainer.callbacks}  # the paper's reliability set
    assert {"DualCheckpoint", "ModelOnlyCheckpoint", "NaNDetector"} <= classes, classes


def _cli_classes():
    from mula_lightning.data.datamodule import MulaDataModule
    from mula_lightning.lightning_module import MulaLM

    return dict(model_class=MulaLM, datamodule_class=MulaDataModule)


def test_unknown_yaml_key_is_rejected_with_its_name(tiny_config, tmp_path, capsys):
    """A misspelt key (model.warmup_step) stops `mula fit` with exit code 2 and an error naming the key."""
    tiny_config["model"]["warmup_step"] = 10
    with pytest.raises(SystemExit) as exc:
        mula_cli.main(["fit", "--config", _write(tiny_config, tmp_path / "bad.yaml")])
    assert exc.value.code == 2
    assert "warmup_step" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_optimizer_and_scheduler_options_that_never_worked_are_not_offered(tiny_config, tmp_path, capsys):
    """``--optimizer AdamW`` failed with "optimizer got an empty parameter list" (built before ``configure_model``)
    and ``--lr_scheduler`` was dropped silently: neither is in ``mula fit --help`` now, and giving one is an argument
    error naming it (exit code 2) before anything runs."""
    with pytest.raises(SystemExit) as exc:
        mula_cli.main(["fit", "--help"])
    assert exc.value.code == 0
    shown = capsys.readouterr().out
    assert "--optimizer" not in shown and "--lr_scheduler" not in shown and "--ckpt_path" in shown
    with pytest.raises(SystemExit) as exc:
        mula_cli.main(["fit", "--config", _write(tiny_config, tmp_path / "fit.yaml"), "--optimizer", "AdamW"])
    assert exc.value.code == 2
    assert "--optimizer" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_options_lightning_refuses_are_named_as_the_users_mistake(tiny_config, tmp_path, capsys):
    """``enable_checkpointing: false`` beside a checkpoint callback, which Lightning refuses: exit code 1 and one line
    naming the option, not an internal error with a request for a bug report (before: "internal error:
    MisconfigurationException ... report the traceback")."""
    tiny_config["trainer"]["enable_checkpointing"] = False
    tiny_config["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]
    assert mula_cli.main(["fit", "--config", _write(tiny_config, tmp_path / "bad.yaml")]) == mula_cli.EXIT_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mula fit: error: "), err
    assert "enable_checkpointing=False" in err and "internal error" not in err, err


def test_config_interpolation_resolves_and_names_a_missing_key(tmp_path, monkeypatch, capsys):
    """A config may refer to its other values (``${model.model}``, ``${trainer.max_steps}``) and to the environment
    (``${oc.env:NAME,default}``), resolved once the command line's overrides are merged (jsonargparse's
    ``omegaconf+`` mode): review item 9 of issue 71, an override of ``model.model`` or ``trainer.max_steps`` reaches
    the references to it (before, they kept the file's values: a dense run wrote under the MoE's folders); a
    reference to a key that does not exist stops ``mula fit`` with exit code 1 and one line naming it, before
    anything is written. Both through the ``fit`` subcommand's parser."""
    config = {
        "model": {"model": "mula-tiny-moe", "warmup_steps": "${trainer.max_steps}"},
        "data": {"data_dir": str(tmp_path / "data" / "${model.model}")},
        "trainer": {"max_steps": 7, "default_root_dir": str(tmp_path / "runs" / "${oc.env:MULA_TEST_JOB,local}")},
    }
    path = _write(config, tmp_path / "interpolated.yaml")
    monkeypatch.setenv("MULA_TEST_JOB", "job42")
    cli = build_cli(["--config", path], run=False)
    assert cli.model.hparams.warmup_steps == 7 and cli.trainer.max_steps == 7
    assert cli.datamodule.hparams.data_dir == str(tmp_path / "data" / "mula-tiny-moe")
    assert cli.trainer.default_root_dir == str(tmp_path / "runs" / "job42")
    cli = build_cli(["--config", path, "--trainer.max_steps", "9", "--model.model", "mula-tiny-dense"], run=False)
    assert cli.model.hparams.warmup_steps == 9 and cli.trainer.max_steps == 9
    assert cli.datamodule.hparams.data_dir == str(tmp_path / "data" / "mula-tiny-dense")
    assert mula_cli.main(["fit", "--config", path]) == 1  # resolved, then stopped by the missing data, naming it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "data" / "mula-tiny-moe" / "manifest.json") in err[0], err
    config["model"]["warmup_steps"] = "${trainer.max_step}"
    assert mula_cli.main(["fit", "--config", _write(config, tmp_path / "bad.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.max_step" in err[0] and "not found" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_data_of_another_tokenizer_fails_before_training(tiny_config, other_tokenizer_data, tmp_path):
    """data.tokenizer pointing at another BPE than the data's: ValueError naming both hashes, no step, no model."""
    tiny_config["data"]["tokenizer"] = str(other_tokenizer_data / "tokenizer.json")
    cli = build_cli(tiny_config, run=False)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.model is None and cli.trainer.global_step == 0


def test_mula_fit_then_report_then_validate(tiny_config, tmp_path, capsys):
    """`mula fit` trains, prints a progress line per logging interval and the validation results, and logs losses,
    lr, grad norm, MoE statistics and tokens/s to CSV; `mula report` turns them into the 4 PNGs; `mula validate` on
    the saved checkpoint gives the same validation loss as the fit."""
    config_path = _write(tiny_config, tmp_path / "tiny.yaml")
    assert mula_cli.main(["fit", "--config", config_path]) == 0
    # the output is no terminal: a progress line per step (log_every_n_steps 1), then the validation results
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("step ", "validation "))]
    assert [line.split(" | ")[0] for line in printed[:4]] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    assert all(" | loss " in line and " | aux " in line and " tok/s (" in line for line in printed[:4]), printed
    assert printed[4].startswith("validation at step 4: val/loss "), printed
    run = tmp_path / "runs" / "tiny" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    for key in (
        "train/loss",
        "train/lm_loss",
        "train/aux_loss",
        "train/lr",
        "train/grad_norm",
        "val/loss",
        "val/perplexity",
        "moe/layer_1/imbalance",
        "moe/layer_0/expert_3",
        "moe/dropped_frac",
        "train/device/items_per_sec",
    ):
        assert key in header, key
    assert mula_cli.main(["report", str(tmp_path / "runs")]) == 0
    for name in ("loss.png", "lr.png", "throughput.png", "expert_load.png"):
        assert (run / "plots" / name).stat().st_size > 1000, name

    (ckpt,) = (run / "checkpoints").glob("*.ckpt")
    fit_val = _last(run / "metrics.csv", "val/loss")
    tiny_config["trainer"]["logger"][0]["init_args"]["name"] = "validate"
    assert (
        mula_cli.main(["validate", "--config", _write(tiny_config, tmp_path / "v.yaml"), "--ckpt_path", str(ckpt)]) == 0
    )
    assert _last(tmp_path / "runs" / "validate" / "version_0" / "metrics.csv", "val/loss") == pytest.approx(fit_val)


def _last(csv_path: Path, key: str) -> float:
    import csv

    with open(csv_path, newline="") as f:
        values = [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    return values[-1]


def test_wandb_is_offline_unless_a_key_is_configured(tmp_path, monkeypatch):
    """No WANDB_MODE, no key, no ~/.netrc entry: offline; an API key or a netrc login: online; WANDB_MODE wins; the
    shipped tiny configs' own W&B loggers follow the same rule."""
    from mula_lightning.lightning_cli import default_loggers, wandb_offline

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    assert wandb_offline()
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert not wandb_offline()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_offline()
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert not wandb_offline()
    wandb_spec = default_loggers()[1]
    assert wandb_spec["class_path"].endswith("WandbLogger") and wandb_spec["init_args"]["offline"] is False
    # the shipped tiny configs list their own WandbLogger with the same rule (was: `offline: true`, which neither a key
    # nor W&B's own WANDB_MODE could switch on)
    import mula_lightning.strategies  # noqa: F401

    for mode, offline in ((None, False), ("offline", True), ("online", False)):
        if mode:
            monkeypatch.setenv("WANDB_MODE", mode)
        for name in ("mula-tiny-moe", "mula-tiny-dense"):
            config = _ParseOnly(run=False, args=["--config", str(CONFIGS[0].parent / f"{name}.yaml")],
                                parser_kwargs=config_parser_kwargs(), **_cli_classes()).config  # fmt: skip
            (wandb,) = [x for x in config.trainer.logger if x.class_path.endswith("WandbLogger")]
            assert wandb.init_args.offline is offline, (name, mode)
