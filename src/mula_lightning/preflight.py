"""Check a ``mula fit / validate / test`` configuration in the launching process, before any process is started.

LightningCLI instantiates the model, the DataModule and the Trainer in the process the user started; the Trainer
starts the other processes only inside ``trainer.fit``. Everything that can be known from the configuration is
checked here, in between, so that a mistake costs one line (see :mod:`mula_lightning.cli`) instead of a traceback
from every rank after the processes and process groups are up:

* the data: the folder holds a prepared dataset (manifest, every shard with its size and dtype), with the
  configured ``seq_len`` and ``tokenizer`` (:attr:`MulaDataModule.manifest`);
* the vocabulary: the model's embedding rows hold every id of the data (:meth:`MulaLM.resolve_vocab`);
* the layout: ``ep_size`` divides the number of processes (``devices x num_nodes``) and the experts of the model;
  ``tp_size`` divides the processes, the heads, key/value heads, dense intermediate size and vocabulary, and under
  sequence parallelism the data's ``seq_len``; ``data.global_batch_size`` is micro-batch x data-parallel ranks
  (``processes / tp_size``: the ``tp`` ranks of a group read one batch) x ``accumulate_grad_batches``;
* the starting weights: ``model.init_from`` exists, its config is readable (at construction) and, for a model-only
  checkpoint, every tensor has the shape of the model (file headers only);
* a resume (:func:`check_resume`): the slot ``ckpt_path`` names (``last``: the newest of the ``DualCheckpoint``
  folder) is not already at ``max_steps`` (a finished run resumed trains nothing and ends "successfully": a launch
  drill run after the quick start in the same folder did exactly that), and the launching process says which slot and
  step the run resumes from. A relaunch by ``mula launch`` whose slot was saved by the same launch is let through (the
  run finished and a rank failed at its exit: the relaunch ends at once, and the launch succeeds).

The same checks run again where they always ran (``MulaLM.setup``, the strategy's setup), so a module used without
the CLI keeps them; here they only run earlier. Everything runs in every process the Trainer starts as well, cheaply.
"""

from __future__ import annotations

import os
from typing import Any

from mula_lightning.checkpoint.init_source import MODEL_ONLY, InitWeights
from mula_lightning.lightning_module import MulaLM, check_layout
from mula_lightning.strategies.protocol import strategy_pipeline, strategy_tensor_parallel
from mula_lightning.utils.launch_env import ATTEMPT_ENV, LAUNCH_STARTED_ENV

__all__ = ["check_before_launch", "check_resume"]


def check_before_launch(trainer: Any, model: Any, datamodule: Any, stage: str = "fit") -> None:
    """Raise the first configuration error (a ``ValueError`` / ``FileNotFoundError`` naming the values), or nothing.

    Args:
        trainer: the instantiated (not yet running) ``Trainer``.
        model: the LightningModule; checks that need :class:`MulaLM` are skipped for another module.
        datamodule: the DataModule or None; the data checks need a ``manifest`` attribute.
        stage: ``"fit"``, ``"validate"`` or ``"test"`` (the batch-size rule is a training rule).
    """
    manifest = getattr(datamodule, "manifest", None) if datamodule is not None else None  # loads and verifies
    processes = int(trainer.num_devices) * int(trainer.num_nodes)
    if not isinstance(model, MulaLM):
        return
    if manifest is not None:
        model.resolve_vocab(manifest)
    check_layout(model.config, trainer.strategy, processes, getattr(manifest, "seq_len", None))
    if stage == "fit" and datamodule is not None and getattr(datamodule, "global_batch_size", None):
        shared = strategy_tensor_parallel(trainer.strategy)[0] * strategy_pipeline(trainer.strategy)["pp_size"]
        _check_global_batch(trainer, datamodule, processes // shared)  # tp and pp ranks of a group read one batch
    init_from = model.hparams.get("init_from")
    if init_from:
        weights = InitWeights(init_from)
        if weights.kind == MODEL_ONLY:  # shapes from the file header; other kinds are read (and checked) at setup
            weights.check(model.config)


def _check_global_batch(trainer: Any, datamodule: Any, batches: int) -> None:
    """``global_batch_size`` = micro-batch x data-parallel ranks x accumulated micro-batches (``batches``: the ranks
    that read distinct micro-batches, the processes over the tensor-parallel degree, unless the DataModule sets
    ``dp_size``)."""
    dp = datamodule.dp_size or batches
    per_step = datamodule.micro_batch_size * dp
    accumulate = trainer.accumulate_grad_batches
    if datamodule.global_batch_size != per_step * accumulate:
        need = datamodule.global_batch_size / per_step
        fix = (
            f"set trainer.accumulate_grad_batches to {int(need)}"
            if need == int(need) and need >= 1
            else (f"choose a global batch that is a multiple of {per_step}")
        )
        raise ValueError(
            f"data.global_batch_size ({datamodule.global_batch_size}) must equal micro_batch_size "
            f"({datamodule.micro_batch_size}) x data-parallel ranks ({dp}) x trainer.accumulate_grad_batches "
            f"({accumulate}) = {per_step * accumulate}: {fix}"
        )


def check_resume(trainer: Any, ckpt_path: str | None) -> str | None:
    """The line saying what a ``fit`` resumes from (None without ``ckpt_path``); a ``ValueError`` when the checkpoint
    is already at ``trainer.max_steps``.

    ``ckpt_path="last"`` is looked up in the Trainer's ``DualCheckpoint`` folders as Lightning will (the newest marked
    slot; none: the run starts at step 0, as Lightning does); a path to a slot is read from its marker; other paths
    (a ``.ckpt`` file) are named without a step.
    """
    from pathlib import Path

    from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint
    from mula_lightning.checkpoint.slots import newest_marked_slot, read_marker

    if not ckpt_path:
        return None
    slot: Path | None = None
    if ckpt_path == "last":
        folders = [c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, DualCheckpoint)]
        found = [s for s in (newest_marked_slot(f) for f in folders) if s is not None]
        if not found:
            where = ", ".join(str(f) for f in folders) or "no DualCheckpoint folder"
            return f"--ckpt_path last: no complete checkpoint in {where}: training starts at step 0"
        slot = found[0]
    elif Path(ckpt_path).is_dir():
        slot = Path(ckpt_path)
    if slot is None:
        return f"resuming from {ckpt_path}"
    marker = read_marker(slot)
    if marker is None:
        return f"resuming from {slot}"
    step, max_steps = int(marker["step"]), int(trainer.max_steps)
    if 0 < max_steps <= step and ckpt_path == "last" and _saved_by_this_launch(marker):
        return (
            f"{slot} is at step {step} of max_steps {max_steps}, saved by an earlier attempt of this launch: the run "
            "is complete (a rank failed after its last save): nothing is trained"
        )
    if 0 < max_steps <= step:
        raise ValueError(
            f"--ckpt_path {ckpt_path}: {slot} is at step {step} and trainer.max_steps is {max_steps}: nothing to "
            "train; raise --trainer.max_steps to continue it, or start a new run in another checkpoint folder"
        )
    of = f" of max_steps {max_steps}" if max_steps > 0 else ""
    return f"resuming from {slot} (step {step}{of})"


def _saved_by_this_launch(marker: dict[str, Any]) -> bool:
    """Whether a slot's marker was written during this ``mula launch`` (an attempt after its first): its ranks all
    finished and one failed at its exit, so the launcher's relaunch finds the run complete; a requeued or new launch
    (a later start) still gets the refusal."""
    try:
        attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
        started = float(os.environ.get(LAUNCH_STARTED_ENV, "") or "inf")
        written = float(marker.get("time") or 0.0)
    except ValueError:
        return False
    return attempt > 0 and written >= started
