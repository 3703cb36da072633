"""Check a ``mula fit / validate / test`` configuration in the launching process, before any process is started.

LightningCLI instantiates the model, the DataModule and the Trainer in the process the user started; the Trainer
starts the other processes only inside ``trainer.fit``. Everything that can be known from the configuration is
checked here, in between, so that a mistake costs one line (see :mod:`mula_lightning.cli`) instead of a traceback
from every rank after the processes and process groups are up:

* the data: the folder holds a prepared dataset (manifest, every shard with its size and dtype), with the
  configured ``seq_len`` and ``tokenizer`` (:attr:`MulaDataModule.manifest`);
* the vocabulary: the model's embedding rows hold every id of the data (:meth:`MulaLM.resolve_vocab`);
* the layout: ``ep_size`` divides the number of processes (``devices x num_nodes``) and the experts of the model;
  ``data.global_batch_size`` is micro-batch x data-parallel ranks x ``accumulate_grad_batches``;
* the starting weights: ``model.init_from`` exists, its config is readable (at construction) and, for a model-only
  checkpoint, every tensor has the shape of the model (file headers only).

The same checks run again where they always ran (``MulaLM.setup``, the strategy's setup), so a module used without
the CLI keeps them; here they only run earlier. Everything runs in every process the Trainer starts as well, cheaply.
"""

from __future__ import annotations

from typing import Any

from mula_lightning.checkpoint.init_source import MODEL_ONLY, InitWeights
from mula_lightning.lightning_module import MulaLM
from mula_lightning.parallel.topology import check_divisible
from mula_lightning.strategies.protocol import strategy_ep_size

__all__ = ["check_before_launch"]


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
    ep_size = strategy_ep_size(trainer.strategy)
    if ep_size > 1:
        config = model.config
        if not config.is_moe:
            raise ValueError(f"ep_size ({ep_size}) > 1 needs an MoE model; {config.name} is dense")
        check_divisible(config.num_experts, ep_size, f"num_experts of {config.name}", "ep_size")
        check_divisible(processes, ep_size, "the number of processes (devices x nodes)", "ep_size")
    if stage == "fit" and datamodule is not None and getattr(datamodule, "global_batch_size", None):
        _check_global_batch(trainer, datamodule, processes)
    init_from = model.hparams.get("init_from")
    if init_from:
        weights = InitWeights(init_from)
        if weights.kind == MODEL_ONLY:  # shapes from the file header; other kinds are read (and checked) at setup
            weights.check(model.config)


def _check_global_batch(trainer: Any, datamodule: Any, processes: int) -> None:
    """``global_batch_size`` = micro-batch x data-parallel ranks x accumulated micro-batches (every rank reads its own
    micro-batches under every strategy here, so the data-parallel ranks are the processes unless set)."""
    dp = datamodule.dp_size or processes
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
