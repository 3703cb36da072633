"""``DualCheckpoint``: full training state in two alternating slots, crash-safe, for the Trainer and for Fabric.

Why: Lightning's ``ModelCheckpoint`` overwrites ``last.ckpt`` (and a sharded checkpoint directory) in place, so a
job killed during that save has nothing to resume from; the Aurora paper keeps two checkpoints and overwrites the
older one. The write and resume protocol lives in :mod:`mula_lightning.checkpoint.slots`; this module maps it onto
Lightning:

* Trainer: every ``every_n_train_steps`` optimizer steps (at the end of the batch that completed the step, never
  in the middle of a gradient-accumulation window) ``trainer.save_checkpoint`` writes the state into the older
  slot: with the ``epso`` strategy a DCP directory (model, optimizer shards by their owners), with Lightning's
  own strategies the usual file. The Trainer's checkpoint holds the model, the optimizers, the LR schedulers,
  the loops (step counters) and, for data loaders with ``state_dict`` / ``load_state_dict`` (``MulaDataModule``),
  the data position; the protocol adds every rank's RNG states (Python, NumPy, torch, accelerator).
* ``trainer.fit(..., ckpt_path="last")`` resumes: the callback is a ``ModelCheckpoint`` subclass so that
  Lightning asks it for the last checkpoint. Lightning resolves ``"last"`` before the process group exists, so
  the callback answers with the newest marker and, when the strategy loads it (process group up, model built),
  re-resolves collectively: the newest slot every rank sees as complete, with its checksums and the model's
  signature checked; the other slot is used when the newest one is damaged or from another model config.
  The RNG states are restored right before the first batch after the resume.
* Fabric: :meth:`DualCheckpoint.save_fabric` / :meth:`DualCheckpoint.load_fabric` (or :func:`resolve_last` for a
  path to pass to ``fabric.load``).

Lineage: every marker carries the run's id. A resume adopts the id of the slot it loads; a fresh run draws a new
one. A fresh run that finds slots of another run in ``dirpath`` refuses to start (they would outlive its own older
slots, and a later ``ckpt_path="last"`` could pick the other run's step): resume it (``ckpt_path="last"``), give a
new ``dirpath``, or pass ``overwrite=True`` (the other run's markers are removed before the first save).

Asynchronous saves (``async_save=True``): at the step, the slot is cleared and this rank's state is copied to host
memory (the sharded strategies' ``stage_checkpoint``; Lightning's own strategies: the checkpoint dict), into the
buffers of the previous save (:class:`~mula_lightning.checkpoint.async_slots.StagingBuffers`); a background
thread writes it and completes the slot with the same protocol (:mod:`mula_lightning.checkpoint.async_slots`), while
training goes on. At most one save is in flight: the next save, the end of training and :meth:`DualCheckpoint.wait`
wait for it, and a wait is logged with its length (a Fabric loop calls ``wait()`` before it exits, or its last
save may be cut short with the process). A kill during the background write leaves the previous slot as
the newest complete one, as for a synchronous save.

Metadata: the Trainer's checkpoint is made plain data before it is written (configs as dicts, paths as str, NumPy
scalars as numbers, enums by value: :mod:`mula_lightning.utils.plain_data`), and a value the safe reader would
refuse fails the save that writes it, naming the entry, instead of the resume after the next failure.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from mula_lightning.checkpoint.async_slots import AsyncSlotSaver, stage_to_host
from mula_lightning.checkpoint.slots import (
    MARKER_NAME,
    SLOT_NAMES,
    STATE_NAME,
    invalidate_slots,
    load_rng,
    model_signature,
    newest_marked_slot,
    read_marker,
    resolve_last,
    save_slot,
    slot_lineages,
)
from mula_lightning.utils.dist import broadcast_object, rank_world
from mula_lightning.utils.plain_data import to_plain_data
from mula_lightning.utils.safe_load import load_torch_file


class CheckpointLineageError(RuntimeError):
    """A fresh run found another run's checkpoint slots in its ``dirpath`` and was not told what to do with them."""


def _new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _layout(strategy: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "world_size": int(getattr(strategy, "world_size", 1)),
    }
    if getattr(strategy, "engine", None) is not None:  # zero_topo: its expert-parallel degree
        layout["ep_size"] = int(getattr(strategy, "ep_size", 1))
    topology = getattr(strategy, "topology", None)
    if topology is not None:
        layout.update(
            dp_size=topology.dp_size, ep_size=topology.ep_size, tp_size=topology.tp_size, etp_size=topology.etp_size
        )
    return layout


def _module_signature(strategy: Any, module: nn.Module) -> dict[str, list[int]]:
    """Logical key -> full shape of a (possibly expert-parallel) module, as the strategy would save it."""
    module = getattr(module, "module", module)  # Fabric's wrapper
    engine = getattr(strategy, "engine", None)
    if engine is not None:  # zero_topo: the single-device shapes its pieces stand for (expert slices included)
        from mula_lightning.parallel.zero.state_dict import model_state_dict as zero_state_dict

        return model_signature(zero_state_dict(engine, module))
    topology = getattr(strategy, "topology", None)
    if topology is not None:
        from mula_lightning.parallel.state_dict import model_state_dict

        return model_signature(model_state_dict(module, topology))
    return model_signature(module.state_dict())


def _inside(path: str | Path, directory: str | Path) -> bool:
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


class DualCheckpoint(ModelCheckpoint):
    """Full checkpoints every ``every_n_train_steps`` steps into two alternating slots of ``dirpath``.

    Args:
        dirpath: directory of the two slots (``slot_a``, ``slot_b``; each holds ``state.ckpt``, the per-rank RNG
            files and, once complete, ``COMPLETE.json``).
        every_n_train_steps: optimizer steps between checkpoints.
        verify_checksums: on resume, check every file's checksum (split over the ranks; each file is read once).
        phase_hook: called with each protocol phase name during a save (fault injection in tests).
        save_on_train_end: also save the last step when training ends normally (``max_steps`` reached, a stop
            requested), whatever the interval: a short run, or the steps after the last multiple, are not lost.
        overwrite: a fresh run (not resumed from ``dirpath``) whose ``dirpath`` holds another run's slots removes
            their markers before its first save; without it such a run refuses to start (see the module docstring).
        async_save: stage each save to host memory at its step and write it in a background thread (see the module
            docstring); the state is copied once per save, so a rank needs host memory for its part of the state.

    Resume with ``trainer.fit(model, ckpt_path="last")`` (Trainer) or :meth:`load_fabric` (Fabric).
    """

    #: slots completed by any DualCheckpoint of this process (an in-job restart resumes from ``last`` once one was)
    completed_in_process = 0

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int,
        verify_checksums: bool = True,
        phase_hook: Any = None,
        save_on_train_end: bool = True,
        overwrite: bool = False,
        async_save: bool = False,
    ) -> None:
        if int(every_n_train_steps) < 1:
            raise ValueError(f"every_n_train_steps ({every_n_train_steps}) must be >= 1")
        super().__init__(dirpath=str(dirpath), save_top_k=0, save_last=False, enable_version_counter=False)
        self.dirpath = str(dirpath)
        self.every = int(every_n_train_steps)
        self.verify_checksums = verify_checksums
        self.phase_hook = phase_hook
        self.save_on_train_end = save_on_train_end
        self.overwrite = overwrite
        self.run_id: str | None = None  # this run's lineage: adopted on resume, drawn by the first save otherwise
        self.last_saved_step = -1
        self.saves_this_process = 0  # slots completed by this process (``mula launch`` resumes from them)
        self.resumed_from: Path | None = None
        self._restore_rng_pending = False
        self._saver = AsyncSlotSaver() if async_save else None

    @property
    def async_save(self) -> bool:
        return self._saver is not None

    def wait(self) -> float:
        """Wait for the asynchronous save in flight, if any (collective: every rank calls it); returns the seconds
        waited. Raises ``CheckpointWriteError`` when that save failed (no marker was written)."""
        return 0.0 if self._saver is None else self._saver.wait()

    def _completed(self, slot: Path) -> None:
        self.saves_this_process += 1
        DualCheckpoint.completed_in_process += 1

    # ------------------------------------------------------------------ Trainer hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "_dual_checkpoint_load", None) is not None:
            return
        original = strategy.load_checkpoint

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            if checkpoint_path is not None and _inside(checkpoint_path, self.dirpath):
                checkpoint_path = self._agreed_slot(_module_signature(strategy, strategy.model)) / STATE_NAME
            return original(checkpoint_path, *args, **kwargs)

        strategy._dual_checkpoint_load = load_checkpoint
        strategy.load_checkpoint = load_checkpoint  # instance attribute: only this trainer's strategy is affected

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """A fresh run checks ``dirpath`` for another run's slots before its first step, not at its first save."""
        self._claim_lineage()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Everything but the tensors as plain data, so that Lightning's own strategies (which ``torch.save`` the
        dict as it is) write what the safe reader loads; the sharded strategies normalise their metadata too."""
        for key in list(checkpoint):
            if key not in ("state_dict", "optimizer_states"):
                checkpoint[key] = to_plain_data(checkpoint[key])

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._restore_rng_pending:
            self._restore_rng_pending = False
            self._restore_rng(trainer.world_size)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # the max_steps stop is saved here, inside the loop like every interval save, so that its loop counters
        # resume the same way (a save in on_train_end holds the counters of a finished batch: the log steps of the
        # resumed run would be shifted by one); other ends of training are saved in on_train_end
        last = self.save_on_train_end and 0 < trainer.max_steps <= step
        if step == 0 or (step % self.every and not last) or step == self.last_saved_step:
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():  # the step in progress is not finished
            return
        self.save(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pass

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The final step, unless the interval just saved it (every rank calls this: the save is collective)."""
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.wait()  # the last save is complete before fit returns (and before a launcher reads the slots)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": self.dirpath, "every_n_train_steps": self.every, "last_saved_step": self.last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = int(state_dict.get("last_saved_step", -1))

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """Lightning's ``ckpt_path="last"`` lookup: the newest marker (re-checked collectively when loading)."""
        best = newest_marked_slot(self.dirpath)
        if best is None:  # a damaged marker still means a resume was intended: let the collective check explain
            damaged = [Path(self.dirpath) / n for n in SLOT_NAMES if (Path(self.dirpath) / n / MARKER_NAME).exists()]
            return {str(damaged[0])} if damaged else set()
        return {str(best / STATE_NAME)}

    # ------------------------------------------------------------------ saving / resuming
    def save(self, trainer: Any) -> Path:
        """Write the Trainer's full state into the slot that is not the newest valid one, now (collective)."""
        self._claim_lineage()
        step = trainer.global_step
        self.last_saved_step = step  # before the save, so the checkpoint's own copy of this callback says so
        signature = model_signature(trainer.strategy.lightning_module_state_dict())

        def write(path: Path) -> None:
            trainer.save_checkpoint(path)
            if path.is_file() and rank_world()[0] == 0:  # Lightning's own single-file format: prove it loads
                load_torch_file(path, mmap=True)

        if self._saver is not None:
            return self._saver.save(
                self.dirpath,
                step,
                lambda: _staged_trainer_checkpoint(trainer),
                layout=_layout(trainer.strategy),
                signature=signature,
                phase_hook=self.phase_hook,
                run_id=self.run_id,
                on_complete=self._completed,
            )
        # the state collected and agreed on every rank before any rank writes (a rank that fails to collect must not
        # leave the others waiting in DCP's collectives or a barrier); a strategy with a save of its own that this
        # module does not know (FSDP, DeepSpeed) writes through trainer.save_checkpoint as it defines it
        prepared = _writes_prepared_state(trainer.strategy, "lightning.pytorch.strategies")
        slot = save_slot(
            self.dirpath,
            step,
            None if prepared else write,
            prepare=(lambda: _staged_trainer_checkpoint(trainer, copy=False)) if prepared else None,
            layout=_layout(trainer.strategy),
            signature=signature,
            phase_hook=self.phase_hook,
            run_id=self.run_id,
        )
        self._completed(slot)
        return slot

    def _claim_lineage(self) -> None:
        """Give a fresh run its lineage id (collective, once): refuse, or with ``overwrite`` invalidate, the slots of
        another run found in ``dirpath``. A resumed run already holds the id of the slot it loaded."""
        if self.run_id is not None:
            return
        problem, run_id, discard = "", None, False
        if rank_world()[0] == 0:  # one rank reads the markers: on a shared file system others may see them late
            others = slot_lineages(self.dirpath)
            discard = bool(others) and self.overwrite
            if others and not self.overwrite:
                found = ", ".join(f"{n} (step {step}, run {rid or 'unknown'})" for n, (step, rid) in others.items())
                problem = (
                    f"{self.dirpath} holds checkpoints of another run: {found}. A new run would interleave its slots "
                    "with them and a later resume could pick the other run's step. Resume it (ckpt_path='last', "
                    "`mula fit ... --ckpt_path last`), choose a new dirpath, or pass DualCheckpoint(overwrite=True) "
                    "to discard them"
                )
            run_id = _new_run_id()
        problem, run_id, discard = broadcast_object((problem, run_id, discard))
        if problem:
            raise CheckpointLineageError(problem)
        if discard:  # collective: every rank takes this branch on rank 0's word, never on its own view of the disk
            invalidate_slots(self.dirpath)
        self.run_id = run_id

    def _adopt_lineage(self, slot: Path) -> None:
        marker = read_marker(slot) or {}
        self.run_id = marker.get("run_id") or _new_run_id()

    def _agreed_slot(self, signature: dict[str, list[int]] | None) -> Path:
        slot = resolve_last(self.dirpath, signature, self.verify_checksums)
        if slot is None:
            raise FileNotFoundError(f"{self.dirpath}: no complete checkpoint slot to resume from")
        self.resumed_from = slot
        self._adopt_lineage(slot)
        self._restore_rng_pending = True
        return slot

    def _restore_rng(self, world_size: int) -> None:
        marker = read_marker(self.resumed_from) or {}
        if int(marker.get("world_size", -1)) != world_size:
            warnings.warn(
                f"{self.resumed_from}: saved by {marker.get('world_size')} ranks, resumed on {world_size}; the RNG "
                "states are not restored (random streams will differ from an uninterrupted run)",
                stacklevel=2,
            )
            return
        load_rng(self.resumed_from)

    # ------------------------------------------------------------------ Fabric
    def should_save(self, step: int) -> bool:
        """Whether a Fabric loop should call :meth:`save_fabric` after optimizer step ``step``."""
        return step > 0 and step % self.every == 0

    def save_fabric(self, fabric: Any, state: dict[str, Any], step: int) -> Path:
        """Save Fabric ``state`` (modules, optimizers, schedulers, plain values) as step ``step`` (collective)."""
        modules = [v for v in state.values() if isinstance(v, nn.Module)]
        signature = _module_signature(fabric.strategy, modules[0]) if modules else None
        self._claim_lineage()
        if self._saver is not None:
            return self._saver.save(
                self.dirpath,
                step,
                lambda: _staged_fabric_state(fabric, state),
                layout=_layout(fabric.strategy),
                signature=signature,
                phase_hook=self.phase_hook,
                run_id=self.run_id,
                on_complete=self._completed,
            )
        prepared = _writes_prepared_state(fabric.strategy, "lightning.fabric.strategies")  # as for the Trainer
        slot = save_slot(
            self.dirpath,
            step,
            None if prepared else (lambda path: fabric.save(path, state)),
            prepare=(lambda: _staged_fabric_state(fabric, state, copy=False)) if prepared else None,
            layout=_layout(fabric.strategy),
            signature=signature,
            phase_hook=self.phase_hook,
            run_id=self.run_id,
        )
        self._completed(slot)
        return slot

    def load_fabric(self, fabric: Any, state: dict[str, Any]) -> dict[str, Any] | None:
        """Restore ``state`` in place from the newest slot every rank sees as complete, and the RNG states.

        Returns:
            ``fabric.load``'s remainder (the entries not in ``state``), or ``None`` when no slot exists yet.
        """
        modules = [v for v in state.values() if isinstance(v, nn.Module)]
        signature = _module_signature(fabric.strategy, modules[0]) if modules else None
        slot = resolve_last(self.dirpath, signature, self.verify_checksums)
        if slot is None:
            return None
        self.resumed_from = slot
        self._adopt_lineage(slot)
        remainder = fabric.load(slot / STATE_NAME, state)
        self._restore_rng(fabric.world_size)
        return remainder


def _writes_prepared_state(strategy: Any, base_module: str) -> bool:
    """Whether a synchronous save can collect ``strategy``'s state first and write it afterwards, as the
    asynchronous one does: the sharded strategies (``stage_checkpoint``), and Lightning's strategies whose
    ``save_checkpoint`` is the base class's (DDP, one device: rank 0 writes the checkpoint it was given)."""
    if hasattr(strategy, "stage_checkpoint"):
        return True
    import importlib

    base = importlib.import_module(base_module).Strategy
    return type(strategy).save_checkpoint is base.save_checkpoint


def _staged_trainer_checkpoint(trainer: Any, copy: bool = True) -> Any:
    """The Trainer's checkpoint of this step in host memory, and ``write(path, group)`` for the background thread
    (``copy=False``: the live state, for a synchronous write)."""
    strategy = trainer.strategy
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    if hasattr(strategy, "stage_checkpoint"):  # the sharded strategies: this rank's pieces, DCP over ``group``
        return strategy.stage_checkpoint(checkpoint, copy=copy)
    staged = stage_to_host(checkpoint) if copy else checkpoint  # Lightning's own strategies: one file, by rank 0

    def write(path: Path, group: Any) -> None:
        if rank_world()[0] == 0:
            strategy.checkpoint_io.save_checkpoint(staged, path)
            load_torch_file(path, mmap=True)  # prove it loads, as a synchronous save does

    return write


def _staged_fabric_state(fabric: Any, state: dict[str, Any], copy: bool = True) -> Any:
    """Fabric ``state`` of this step in host memory, and ``write(path, group)`` for the background thread
    (``copy=False``: the live state, for a synchronous write)."""
    from lightning.fabric.fabric import _unwrap_objects

    strategy = fabric.strategy
    state = _unwrap_objects(state)
    if hasattr(strategy, "stage_checkpoint"):  # the sharded strategies: this rank's pieces, DCP over ``group``
        return strategy.stage_checkpoint(state, copy=copy)
    converted = strategy._convert_stateful_objects_in_state(state, filter={})  # as fabric.save does
    staged = stage_to_host(converted) if copy else converted

    def write(path: Path, group: Any) -> None:
        if rank_world()[0] == 0:
            strategy.checkpoint_io.save_checkpoint(checkpoint=staged, path=path)

    return write


def resolve_last_checkpoint(dirpath: str | Path, module: nn.Module | None = None, strategy: Any = None) -> Path | None:
    """Path of the ``state.ckpt`` of the newest slot every rank sees as complete (for ``fabric.load``), or None.

    Collective when a process group is initialised. With ``module`` (and the strategy, for expert-parallel
    layouts) slots saved from another model config are skipped.
    """
    signature = _module_signature(strategy, module) if module is not None else None
    slot = resolve_last(dirpath, signature)
    return None if slot is None else slot / STATE_NAME


__all__ = ["CheckpointLineageError", "DualCheckpoint", "resolve_last_checkpoint"]
