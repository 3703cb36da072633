"""``ModelOnlyCheckpoint``: persistent weights-only checkpoints (safetensors), kept forever, to restart from.

Why (Aurora paper, Section 4, "Persistent model checkpointing"): the two dual-checkpoint slots always hold the
*latest* state; when a loss curve diverges thousands of steps later, one needs the weights of an older, healthy
step. A full checkpoint per step kept is too big (with AdamW it also holds two moments per weight, and an fp32
master with bf16 parameters); the weights alone, in bf16, are about 6x (fp32 training) to 7x (bf16 parameters
with fp32 masters) smaller. Training restarts from them with fresh optimizer states.

Layout: ``dirpath/step-00001000/`` with ``model.safetensors`` (full tensors; beyond 5 GiB transformers' numbered
files and ``model.safetensors.index.json``), ``config.json`` (when the LightningModule holds a ``MulaForCausalLM``:
the format of :mod:`mula_lightning.models.checkpoint_io`, loadable with ``load_model_only``), ``trainer_state.json``
(step, epoch, dtype) and, with ``hf_export=True``, ``hf/`` (a transformers OLMoE / Mixtral / Llama directory). Under the
sharded strategies (``epso``, ``zero_topo``) no rank gathers the model: every rank writes what it holds and the files
are streamed out tensor by tensor (:mod:`mula_lightning.checkpoint.model_only_sharded`); otherwise the weights are
gathered and rank 0 writes. Either way the files go into a temporary directory renamed into place, so a ``step-*``
directory is always complete.

Restart: build the model, then :func:`restore_weights` (e.g. in ``configure_model``) and ``trainer.fit`` without
``ckpt_path``: weights from the checkpoint, optimizer states and schedulers fresh.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from mula_lightning.checkpoint.model_only_sharded import TRAINER_STATE_NAME
from mula_lightning.parallel.params import is_dtensor
from mula_lightning.utils.dist import is_distributed
from mula_lightning.utils.io import fsync_dir

WEIGHTS_NAME = "model.safetensors"


def _mula_model(module: nn.Module) -> Any:
    from mula_lightning.models import MulaForCausalLM

    return next((m for m in module.modules() if isinstance(m, MulaForCausalLM)), None)


def full_state_dict(module: nn.Module, strategy: Any = None) -> dict[str, torch.Tensor]:
    """Single-device state dict of ``module`` (its ``MulaForCausalLM`` if it holds one), experts gathered.

    Collective over the expert-parallel group when the strategy has a topology with ``ep_size > 1`` (over the
    tensor-parallel group too with ``tp_size > 1``), and over every
    rank under ``zero_topo``, whose parameters hold no storage between steps (their values live in the engine's
    shards: reading ``module.state_dict()`` there would read freed memory).
    """
    target = _mula_model(module) or module
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        from mula_lightning.parallel.zero.state_dict import full_model_state_dict

        return full_model_state_dict(engine, target)
    topology = getattr(strategy, "topology", None)
    if topology is not None and topology.ep_size * topology.etp_size > 1:
        from mula_lightning.parallel.expert_parallel import gather_expert_parallel_state_dict

        state = gather_expert_parallel_state_dict(target, topology.expert_group, topology.etp_size)
    else:
        state = dict(target.state_dict())
    # tensor-parallel weights (DTensors) gathered over their tp group, in state-dict order on every rank
    return {k: v.full_tensor() if is_dtensor(v) else v for k, v in state.items()}


def _sharded_state(strategy: Any, mula: nn.Module) -> tuple[dict[str, Any], Any] | None:
    """(this rank's logical-key state of ``mula``, DCP planner) under the sharded strategies, else None."""
    engine = getattr(strategy, "engine", None)
    if engine is not None:  # zero_topo: the pieces of the primary chunks
        from mula_lightning.checkpoint.scattered import SpreadReplicasSavePlanner
        from mula_lightning.parallel.zero.state_dict import model_state_dict

        return model_state_dict(engine, mula), SpreadReplicasSavePlanner()
    topology = getattr(strategy, "topology", None)
    if topology is not None:  # epso: expert slices as DTensors, the rest replicated (written DP-scattered)
        from mula_lightning.checkpoint.scattered import DPScatteredSavePlanner
        from mula_lightning.parallel.state_dict import model_state_dict as epso_state_dict

        return epso_state_dict(mula, topology), DPScatteredSavePlanner(
            topology.dp_size, topology.ep_size, topology.stage_size
        )
    return None


def save_weights(
    state: dict[str, torch.Tensor], path: str | Path, config: Any = None, meta: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None, hf_export: bool = False, data: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write a model-only directory (one process): safetensors, optional Mula config, metadata, optional HF copy, and
    the training data's tokenizer when ``data`` (``MulaLM.data_info``) is given."""
    from safetensors.torch import save_file

    from mula_lightning.checkpoint.export import write_tokenizer
    from mula_lightning.models.checkpoint_io import save_data_info, save_model_only

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()}
    if config is not None:
        save_model_only(tensors, tmp, config=config)
    else:
        tmp.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_NAME))
    if hf_export:
        if config is None:
            raise ValueError("hf_export=True needs a LightningModule holding a MulaForCausalLM (a config to convert)")
        from mula_lightning.models import MulaForCausalLM
        from mula_lightning.models.hf_convert import save_hf

        with torch.device("meta"):
            model = MulaForCausalLM(config)
        model.load_state_dict({k: v.cpu() for k, v in tensors.items()}, assign=True, strict=False)
        save_hf(model, tmp / "hf")
        if data is not None:
            write_tokenizer(tmp / "hf", data, config.vocab_size)
    if data is not None:
        save_data_info(tmp, data)
    info = {**(meta or {}), "dtype": str(dtype).replace("torch.", "") if dtype else "as trained"}
    (tmp / TRAINER_STATE_NAME).write_text(json.dumps(info, indent=1))
    for file in tmp.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def restore_weights(module: nn.Module, path: str | Path, strict: bool = True) -> int:
    """Load a model-only checkpoint into ``module`` (its ``MulaForCausalLM`` if it holds one); returns its step.

    The tensors are cast to the parameters' dtype. A module on the meta device gets the tensors assigned
    (the strategy then moves and, for expert parallelism, slices them). Optimizer states are not touched:
    restart ``trainer.fit`` without ``ckpt_path`` to train on with fresh ones.

    Raises:
        FileNotFoundError / KeyError: a missing file, or keys that do not match the module (named).
    """
    from safetensors.torch import load_file

    from mula_lightning.models.checkpoint_io import weight_files

    path = Path(path)
    file = path / WEIGHTS_NAME
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"{file}: missing (not a model-only checkpoint)")
    state = {}
    for part in files:
        state.update(load_file(str(part)))
    target = _mula_model(module) or module
    config = getattr(target, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = target.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if strict and (missing or unexpected):
        raise KeyError(f"{file}: does not match the model: missing {missing[:6]}, unexpected {unexpected[:6]}")
    meta = any(t.is_meta for t in expected.values())
    state = {k: v.to(expected[k].dtype) for k, v in state.items() if k in expected}
    target.load_state_dict(state, strict=strict, assign=meta)
    if meta and getattr(config, "tie_word_embeddings", False):
        target.lm_head.weight = target.model.embed_tokens.weight
    info = path / TRAINER_STATE_NAME
    return int(json.loads(info.read_text()).get("step", 0)) if info.is_file() else 0


class ModelOnlyCheckpoint(Callback):
    """Weights-only checkpoints every ``every_n_train_steps`` optimizer steps, one directory per step, kept.

    Args:
        dirpath: parent directory of the ``step-XXXXXXXX`` directories.
        every_n_train_steps: optimizer steps between saves.
        dtype: dtype the floating-point weights are stored in (``torch.bfloat16`` by default; ``None``: as trained).
        hf_export: also write a transformers directory (``hf/``) next to the weights.
        save_on_train_end: also save the last step when training ends normally, whatever the interval.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int,
        dtype: torch.dtype | None = torch.bfloat16,
        hf_export: bool = False,
        save_on_train_end: bool = True,
    ) -> None:
        if int(every_n_train_steps) < 1:
            raise ValueError(f"every_n_train_steps ({every_n_train_steps}) must be >= 1")
        self.dirpath = Path(dirpath)
        self.every = int(every_n_train_steps)
        self.dtype = dtype
        self.hf_export = hf_export
        self.save_on_train_end = save_on_train_end
        self.last_saved_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath), every_n_train_steps=self.every)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every or step == self.last_saved_step:
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        self.save(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The final weights, unless the interval just saved them (collective: every rank calls this)."""
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer, pl_module)

    def save(self, trainer: Any, pl_module: Any) -> Path:
        """Write ``step-XXXXXXXX`` (collective): under a sharded strategy every rank writes what it holds, nothing
        is gathered (:mod:`mula_lightning.checkpoint.model_only_sharded`); otherwise the full weights are gathered
        and rank 0 writes."""
        step = trainer.global_step
        self.last_saved_step = step
        path = self.dirpath / f"step-{step:08d}"
        mula = _mula_model(pl_module)
        meta = {"step": step, "epoch": trainer.current_epoch}
        data = getattr(pl_module, "data_info", None)  # MulaLM's: the tokenizer travels with the weights
        sharded = _sharded_state(trainer.strategy, mula) if mula is not None and trainer.world_size > 1 else None
        if sharded is not None:
            from mula_lightning.checkpoint.model_only_sharded import save_model_only_sharded

            state, planner = sharded
            return save_model_only_sharded(state, planner, mula.config, path, self.dtype, self.hf_export, meta, data)
        state = full_state_dict(pl_module, trainer.strategy)
        if trainer.global_rank == 0:
            save_weights(state, path, getattr(mula, "config", None), meta, self.dtype, self.hf_export, data)
        if is_distributed() and trainer.world_size > 1:
            dist.barrier()
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self.last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = int(state_dict.get("last_saved_step", -1))


def directory_bytes(path: str | Path) -> int:
    """Total size of the files under ``path`` (for size comparisons between checkpoint kinds)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


__all__ = ["ModelOnlyCheckpoint", "directory_bytes", "full_state_dict", "restore_weights", "save_weights"]
