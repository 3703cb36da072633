"""``mula fit`` checks the whole configuration in the launching process: each bad input below is answered with one
line naming the values and exit code 1, before ``Trainer.fit`` starts any process, and nothing is written."""

from __future__ import annotations

import functools
import json

import pytest
import yaml
from lightning.pytorch import Trainer

from mula_lightning import cli as mula_cli


def _run(config: dict, tmp_path, capsys, monkeypatch, *extra: str) -> str:
    """``mula fit`` on ``config``; returns the error line after checking the exit code, that ``Trainer.fit`` never
    ran (no process was started) and that the run folder was not created."""

    @functools.wraps(Trainer.fit)  # LightningCLI reads fit's options (--ckpt_path) from its signature
    def no_fit(*args, **kwargs):
        raise AssertionError("Trainer.fit ran: the configuration was not checked before launch")

    monkeypatch.setattr(Trainer, "fit", no_fit)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert mula_cli.main(["fit", "--config", str(path), *extra]) == mula_cli.EXIT_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("mula fit: error: ")
    assert not (tmp_path / "runs").exists()
    return err


def _epso(config: dict, devices: int, **options) -> dict:
    config["trainer"]["devices"] = devices
    config["trainer"]["strategy"] = {"class_path": "mula_lightning.strategies.EPSOStrategy", "init_args": options}
    return config


def test_missing_data_folder_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """A data_dir that was never prepared: the missing manifest and the command that writes it are named."""
    tiny_config["data"]["data_dir"] = str(tmp_path / "never-prepared")
    err = _run(tiny_config, tmp_path, capsys, monkeypatch)
    assert "never-prepared/manifest.json not found" in err and "mula data prepare" in err


def test_ep_size_that_does_not_divide_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """ep_size 3 over 2 processes and 4 experts: the experts and the value are named before 2 processes start."""
    err = _run(_epso(tiny_config, 2, ep_size=3), tmp_path, capsys, monkeypatch)
    assert "num_experts" in err and "(4)" in err and "ep_size (3)" in err


def test_processes_that_ep_size_does_not_divide_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """ep_size 4 divides the 4 experts but not 2 processes: the number of processes is named."""
    err = _run(_epso(tiny_config, 2, ep_size=4), tmp_path, capsys, monkeypatch)
    assert "the number of processes (devices x nodes) (2)" in err and "ep_size (4)" in err


def test_tp_size_that_does_not_divide_the_heads_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """tp_size 4 over 4 processes and a model of 2 heads (and 2 key/value heads): every size it does not divide is
    named in one line before 4 processes start."""
    err = _run(_epso(tiny_config, 4, tp_size=4), tmp_path, capsys, monkeypatch)
    assert "tp_size (4) must divide num_heads (2), num_kv_heads (2)" in err


def test_processes_that_tp_size_does_not_divide_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """tp_size 2 over 3 processes: the number of processes is named."""
    err = _run(_epso(tiny_config, 3, tp_size=2), tmp_path, capsys, monkeypatch)
    assert "the number of processes (devices x nodes) (3) must be divisible by tp_size (2)" in err


def test_sequence_length_sequence_parallelism_cannot_split_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """Sequence parallelism over 3 ranks with data of 32-token sequences (a model that 3 divides otherwise): the
    data's seq_len and tp_size are named."""
    tiny_config["model"]["model_overrides"].update(hidden_size=48, num_heads=3, num_kv_heads=3)
    tiny_config["model"]["vocab_size"] = 513
    err = _run(_epso(tiny_config, 3, tp_size=3, sequence_parallel=True), tmp_path, capsys, monkeypatch)
    assert "tp_size (3)" in err and "seq_len (32) must be divisible" in err


def test_etp_size_that_does_not_divide_the_experts_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """etp_size 3 over 3 processes and experts of intermediate size 32: the size and etp_size are named."""
    err = _run(_epso(tiny_config, 3, etp_size=3), tmp_path, capsys, monkeypatch)
    assert "the experts' intermediate_size of" in err and "(32) must be divisible by etp_size (3)" in err


def test_folded_sizes_that_do_not_cover_the_ranks_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """ep_size 2 x etp_size 2 folded over 2 processes: the MoE layout needs 4 ranks; both sizes and the ranks are
    named."""
    err = _run(_epso(tiny_config, 2, ep_size=2, etp_size=2), tmp_path, capsys, monkeypatch)
    assert "ep x etp (2 x 2 = 4) must divide the ranks of a pipeline stage (2" in err


def test_etp_size_with_the_reference_block_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """Expert tensor parallelism of a model built with the reference MoE block: the block kind is named."""
    tiny_config["model"]["moe_impl"] = "reference"
    err = _run(_epso(tiny_config, 2, etp_size=2), tmp_path, capsys, monkeypatch)
    assert "etp_size (2) > 1 needs moe_impl='fast' (FastSparseMoEBlock), not 'reference'" in err


def test_global_batch_counts_one_batch_per_tensor_parallel_group(tiny_config, tmp_path, capsys, monkeypatch):
    """2 processes at tp_size 2 read one batch between them: global_batch_size 16 of micro-batches of 4 needs 4
    accumulated micro-batches (not 2, as 2 data-parallel ranks would)."""
    tiny_config["data"]["global_batch_size"] = 16
    err = _run(_epso(tiny_config, 2, tp_size=2), tmp_path, capsys, monkeypatch)
    assert "data-parallel ranks (1)" in err and "set trainer.accumulate_grad_batches to 4" in err


def test_layers_the_pipeline_stages_do_not_divide_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """pp_size 2 x 2 virtual stages (interleaved 1F1B) of a 2-layer model over 2 processes: the layers and the
    stages are named before 2 processes start."""
    options = dict(pp_size=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    err = _run(_epso(tiny_config, 2, **options), tmp_path, capsys, monkeypatch)
    assert "num_layers (2) must be divisible by the pipeline stages (4 = pp_size x virtual stages)" in err


def test_processes_that_pp_size_does_not_divide_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """pp_size 2 over 3 processes: the number of processes is named."""
    err = _run(_epso(tiny_config, 3, pp_size=2), tmp_path, capsys, monkeypatch)
    assert "the number of processes (devices x nodes) (3) must be divisible by pp_size (2)" in err


def test_tied_embeddings_under_pipeline_parallelism_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """Tied word embeddings cannot live on the first and the last stage at once: named before launch."""
    tiny_config["model"]["model_overrides"]["tie_word_embeddings"] = True
    err = _run(_epso(tiny_config, 2, pp_size=2), tmp_path, capsys, monkeypatch)
    assert "pipeline parallelism (pp_size 2)" in err and "tie_word_embeddings=True" in err


def test_too_few_microbatches_for_1f1b_are_named(tiny_config, tmp_path, capsys, monkeypatch):
    """1F1B over 2 stages with 1 micro-batch per step: refused when the strategy is built, in one line."""
    err = _run(_epso(tiny_config, 2, pp_size=2, pp_microbatches=1), tmp_path, capsys, monkeypatch)
    assert "pp_microbatches (1) must be at least pp_size (2) for 1f1b" in err


def test_global_batch_counts_one_batch_per_pipeline(tiny_config, tmp_path, capsys, monkeypatch):
    """4 processes at pp_size 2 are 2 pipelines, 2 batches per step: global_batch_size 16 of micro-batches of 4
    needs 2 accumulated micro-batches (not 1, as 4 data-parallel ranks would)."""
    tiny_config["data"]["global_batch_size"] = 16
    err = _run(_epso(tiny_config, 4, pp_size=2), tmp_path, capsys, monkeypatch)
    assert "data-parallel ranks (2)" in err and "set trainer.accumulate_grad_batches to 2" in err


def test_vocabulary_smaller_than_the_data_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """A fixed vocab_size of 256 under data of 512 ids: both sizes and the fix, never a silent resize."""
    tiny_config["model"]["vocab_size"] = 256
    err = _run(tiny_config, tmp_path, capsys, monkeypatch)
    assert "vocab_size 256" in err and "(512 ids)" in err and "set model.vocab_size to 512 or more" in err


def test_global_batch_that_does_not_match_accumulation_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """global_batch_size 16 with micro-batch 4 on 1 process and no accumulation: the value to set is named."""
    tiny_config["data"]["global_batch_size"] = 16
    err = _run(tiny_config, tmp_path, capsys, monkeypatch)
    assert "data.global_batch_size (16)" in err and "set trainer.accumulate_grad_batches to 4" in err


@pytest.mark.parametrize(
    ("model_args", "expected"),
    [
        ({"init_from": "/nowhere/weights"}, "init_from /nowhere/weights: no such file or directory"),
        ({"model_overrides": {"hidden_sise": 64}}, "unknown MulaConfig fields ['hidden_sise']"),
        ({"min_lr": 1.0}, "min_lr (1.0) must be in [0, lr (0.003)]"),
    ],
    ids=["init_from-missing", "unknown-override", "bad-value"],
)
def test_values_refused_at_construction_are_one_line(tiny_config, tmp_path, capsys, monkeypatch, model_args, expected):
    """Values the classes refuse when LightningCLI instantiates them: one line with the value, no traceback."""
    tiny_config["model"].update(model_args)
    assert expected in _run(tiny_config, tmp_path, capsys, monkeypatch)


def test_init_from_that_does_not_fit_the_overrides_is_named(tiny_config, tmp_path, capsys, monkeypatch):
    """A model-only checkpoint whose tensors do not match the overridden config (another hidden size) is named from
    the file headers before launch."""
    from mula_lightning.models import MulaConfig, MulaForCausalLM
    from mula_lightning.models.checkpoint_io import save_model_only

    config = MulaConfig.from_name("mula-tiny-moe", **{**tiny_config["model"]["model_overrides"], "vocab_size": 512})
    path = save_model_only(MulaForCausalLM(config), tmp_path / "weights")
    tiny_config["model"].update(init_from=str(path), model_overrides={"intermediate_size": 48})
    err = _run(tiny_config, tmp_path, capsys, monkeypatch)
    assert "does not fit the model config" in err and "(4, 32, 32) vs model (4, 32, 48)" in err


def test_debug_shows_the_traceback(tiny_config, tmp_path, monkeypatch):
    """With --debug the exception itself propagates, for a bug report."""
    tiny_config["data"]["data_dir"] = str(tmp_path / "never-prepared")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    with pytest.raises(FileNotFoundError, match="never-prepared"):
        mula_cli.main(["fit", "--config", str(path), "--debug"])


def _finished_run(tmp_path, step: int):
    """A DualCheckpoint folder whose newest complete slot holds ``step`` (its marker: all that is read here)."""
    slot = tmp_path / "checkpoints" / "dual" / "slot_b"
    slot.mkdir(parents=True)
    (slot / "COMPLETE.json").write_text(json.dumps({"step": step, "files": {}}))
    return slot


def test_a_resume_already_at_max_steps_is_refused_naming_the_slot_and_both_steps(
    tiny_config, tmp_path, capsys, monkeypatch
):
    """``--ckpt_path last`` in the folder of a finished 6-step run with ``max_steps`` 6 (a launch drill run after the
    quick start in its folder) trained nothing and ended "succeeded": now one line names the slot and both steps."""
    slot = _finished_run(tmp_path, 6)
    tiny_config["trainer"]["max_steps"] = 6
    dual = {"dirpath": str(slot.parent), "every_n_train_steps": 2}
    tiny_config["trainer"]["callbacks"] = [{"class_path": "mula_lightning.callbacks.DualCheckpoint", "init_args": dual}]
    err = _run(tiny_config, tmp_path, capsys, monkeypatch, "--ckpt_path", "last")
    assert f"{slot} is at step 6 and trainer.max_steps is 6: nothing to train" in err, err


def test_the_launching_process_says_what_a_fit_resumes_from(tiny_config, tmp_path, capsys):
    """The slot ``last`` resolves to and its step of ``max_steps``; with no slot yet, that training starts at 0."""
    from mula_lightning.callbacks import DualCheckpoint
    from mula_lightning.preflight import check_resume

    trainer = Trainer(max_steps=10, callbacks=[DualCheckpoint(tmp_path / "checkpoints" / "dual", 2)], logger=False)
    assert "training starts at step 0" in check_resume(trainer, "last")
    slot = _finished_run(tmp_path, 6)
    assert check_resume(trainer, "last") == f"resuming from {slot} (step 6 of max_steps 10)"
    assert check_resume(trainer, str(slot)) == f"resuming from {slot} (step 6 of max_steps 10)"
    assert check_resume(trainer, None) is None


def test_a_relaunch_finds_the_run_its_own_launch_completed_and_a_later_launch_is_still_refused(tmp_path, monkeypatch):
    """A slot at ``max_steps`` marked after ``MULA_LAUNCH_STARTED`` is the run this launch finished (its ranks all
    ended, one failed at its exit): attempt 1's ``--ckpt_path last`` is let through with a line saying the run is
    complete. The same slot refuses the launch's first attempt, a launch started after it (a requeue, a resubmission)
    and a path named by the user, as before."""
    from mula_lightning.callbacks import DualCheckpoint
    from mula_lightning.preflight import check_resume
    from mula_lightning.utils.launch_env import ATTEMPT_ENV, LAUNCH_STARTED_ENV

    trainer = Trainer(max_steps=6, callbacks=[DualCheckpoint(tmp_path / "checkpoints" / "dual", 2)], logger=False)
    slot = _finished_run(tmp_path, 6)
    (slot / "COMPLETE.json").write_text(json.dumps({"step": 6, "files": {}, "time": 1000.0}))
    refused = "is at step 6 and trainer.max_steps is 6: nothing to train"
    monkeypatch.setenv(LAUNCH_STARTED_ENV, "999.5")
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    assert "saved by an earlier attempt of this launch: the run is complete" in check_resume(trainer, "last")
    with pytest.raises(ValueError, match=refused):
        check_resume(trainer, str(slot))  # the user's own path: their mistake, whoever launched it
    for attempt, started in (("0", "999.5"), ("1", "1000.5"), ("1", "")):
        monkeypatch.setenv(ATTEMPT_ENV, attempt)
        monkeypatch.setenv(LAUNCH_STARTED_ENV, started)
        with pytest.raises(ValueError, match=refused):
            check_resume(trainer, "last")
