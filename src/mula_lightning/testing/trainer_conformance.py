"""Differential testing of the Trainer's own loop: accumulation, ``gradient_clip_val``, a skipped step through an
``optimizer_step`` override, a step-interval scheduler, a gradient-norm hook and a resume mid-run, on every strategy
and layout against one process (issue 71).

Why: the loop programs of :mod:`mula_lightning.testing.conformance` drive Fabric call by call; Lightning's Trainer
makes the same calls in its own order, through its own closure, precision plugin and checkpoint restore, so the
engines meet them there too: the backwards of an accumulation window run inside the strategy's
``block_backward_sync`` (the last one synchronised), the zero_grad of a window comes after its first forward, the
clip runs inside ``optimizer.step(closure)``, a documented override that runs the closure and skips ``step()`` leaves
a reduction in flight that the next window's ``zero_grad`` meets, the scheduler steps after every window (stepped or
not), and a resume rebuilds the optimizer and scheduler from a checkpoint. A :class:`TrainerProgram` is such a loop;
:meth:`TrainerProgram.calls` writes it as the Fabric calls it makes, which :func:`~mula_lightning.testing.
conformance.reference_run` plays in one process (with Lightning's loss division by the accumulation), and
:func:`check_trainer_program` compares every loss, returned norm, learning rate and every rank's full weights.
Lightning's DDP strategy is the control: it passing says the translation to calls is Lightning's loop.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch

from mula_lightning.testing.conformance import (
    FREEZES,
    LAYOUTS,
    MAX_NORM,
    LoopProgram,
    batch,
    first_difference,
    freeze,
    idle_last_expert,
    model_config,
    optimizer_of,
    reference_run,
)

__all__ = ["TRAINER_LAYOUTS", "TrainerProgram", "check_trainer_program", "run_trainer_program", "trainer_programs"]

#: the layouts the Trainer runs (Lightning's DDP is the control)
TRAINER_LAYOUTS = (
    "ddp",
    "epso none",
    "epso ep_aware ep2",
    "epso ep_aware tp2",
    "epso dp ep2 dp2",
    "zero_topo zero3",
    "zero_topo 3-level",
    "zero_topo zero3 ep2",
    "epso ep_aware ep2 muon",
)


@dataclasses.dataclass(frozen=True)
class TrainerProgram:
    """One Trainer run: one accumulation window per epoch, each window stepped or skipped.

    Attributes:
        layout: a key of :data:`~mula_lightning.testing.conformance.LAYOUTS` in :data:`TRAINER_LAYOUTS`.
        windows: per window ``"step"`` (``optimizer.step(closure=...)``) or ``"skip"`` (the closure alone: the
            override Lightning documents for a step to leave out, e.g. on a non-finite loss).
        accumulate: ``accumulate_grad_batches``.
        clip: ``gradient_clip_val=MAX_NORM`` (by norm), or no clipping.
        log_norm: ``on_before_optimizer_step`` queries the global gradient norm (what a norm-logging callback does).
        resume_after: windows trained by a first Trainer, which saves a checkpoint; a second Trainer (new module,
            new optimizer and scheduler) resumes from it for the rest. None: one Trainer trains every window.
        frozen: name prefixes of parameters frozen before set-up.
        slow_rank: a rank that sleeps before each backward and zero_grad, or None.
        idle_expert: the routers never choose the last expert.
    """

    layout: str
    windows: tuple[str, ...]
    accumulate: int = 1
    clip: bool = True
    log_norm: bool = False
    resume_after: int | None = None
    frozen: tuple[str, ...] = ()
    slow_rank: int | None = None
    idle_expert: bool = False

    def calls(self) -> tuple[str, ...]:
        """The Fabric calls the Trainer makes: per window a zero_grad (after the first forward, before its backward),
        the window's backwards (all but the last inside ``no_backward_sync``), then for a stepped window the norm
        hook, the clip and the step; the scheduler after every window."""
        calls: list[str] = []
        for window in self.windows:
            calls += ["zero_grad", *["backward_no_sync"] * (self.accumulate - 1), "backward"]
            if window == "step":
                calls += ["norm"] * self.log_norm + ["clip"] * self.clip + ["step"]
            calls.append("scheduler")
        return tuple(calls)

    def to_code(self) -> str:
        """The program as a test a person can paste."""
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"check_trainer_program(TrainerProgram({fields}))"


def _module_class() -> type:
    """The LightningModule of the programs (a class built on first use: Lightning is imported in the ranks)."""
    from lightning.pytorch import LightningModule

    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict
    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.strategies.protocol import ShardingStrategy

    class LoopModule(LightningModule):
        """The Mula model of the loop programs, on the meta device for the sharded strategies (materialised and
        cast for DDP, as the reference is); each window's micro-batches are the loop programs' ``batch(micro,
        data rank)``; records what the loop sees."""

        def __init__(self, program: TrainerProgram, record: dict[str, Any]) -> None:
            super().__init__()
            self.program, self.record = program, record
            self.model = None
            if LAYOUTS[program.layout][1] == "ddp":
                self.model = init_weights(MulaForCausalLM(model_config()), seed=0).to(torch.float64)
                self._prepare()

        def _prepare(self) -> None:
            freeze(self.model, self.program.frozen)

        def configure_model(self) -> None:
            if self.model is None:
                with torch.device("meta"):
                    self.model = MulaForCausalLM(model_config())
                self._prepare()

        def on_fit_start(self) -> None:
            if self.program.idle_expert:  # on the materialised model (buffers are set after the strategy builds)
                idle_last_expert(self.model)

        def _pause(self) -> None:
            if self.program.slow_rank == self.global_rank:
                time.sleep(0.02)

        def training_step(self, micro: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 0 and self.current_epoch > 0:  # what the scheduler left for this window
                self.record["lrs"].append([g["lr"] for g in self.trainer.optimizers[0].param_groups])
            sampler = self.trainer.strategy.distributed_sampler_kwargs
            x = batch(self.current_epoch * self.program.accumulate + int(micro), sampler["rank"] if sampler else 0)
            out = self.model(x, labels=x)
            loss = out.loss + out.aux_loss
            self.record["losses"].append(loss.item())
            return loss

        def _gradient_reductions(self) -> int:
            return sum(r.tag.startswith("optimizer.") for r in self.record["ledger"].records)

        def on_before_backward(self, loss: torch.Tensor) -> None:
            self._pause()
            self._reductions_before = self._gradient_reductions()

        def on_after_backward(self) -> None:
            self.record["reductions"].append(self._gradient_reductions() - self._reductions_before)

        def on_before_zero_grad(self, optimizer: Any) -> None:
            self._pause()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if not self.program.log_norm:
                return
            strategy = self.trainer.strategy
            if isinstance(strategy, ShardingStrategy):
                norm = strategy.global_grad_norm(optimizer)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
            self.record["norms"].append(norm.item())

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if self.program.windows[epoch] == "skip":
                optimizer_closure()  # Lightning's documented way to leave a step out: the closure runs, no step
                return
            optimizer.step(closure=optimizer_closure)
            weights = full_state_dict(self.model, self.trainer.strategy)
            self.record["steps"].append(
                ([g["lr"] for g in optimizer.param_groups], {k: v.detach().clone() for k, v in weights.items()})
            )

        def configure_optimizers(self) -> Any:
            optimizer = optimizer_of(self.program.layout, self.model.named_parameters())
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    return LoopModule


def _trainer_strategy(kind: str, options: dict[str, Any]) -> Any:
    from mula_lightning.strategies import EPSOStrategy, ZeroTopoStrategy

    options = {k: v for k, v in options.items() if k != "optimizer"}
    if kind == "epso":
        return EPSOStrategy(bucket_numel=700, **options)
    if kind == "zero_topo":
        return ZeroTopoStrategy(block_size=16, **options)
    return kind


def _fit(program: TrainerProgram, world_size: int, epochs: int, record: dict[str, Any], save: str | None,
         resume: str | None) -> Any:  # fmt: skip
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from mula_lightning.parallel.ledger import CommLedger

    _, kind, options = LAYOUTS[program.layout]
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=_trainer_strategy(kind, options), precision="64-true",
        accumulate_grad_batches=program.accumulate, gradient_clip_val=MAX_NORM if program.clip else None,
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    module = _module_class()(program, record)
    # one window per epoch: the micro-batches' positions in it (training_step turns them into token batches)
    loader = DataLoader(list(range(program.accumulate)), batch_size=None, shuffle=False)
    with CommLedger() as record["ledger"]:  # the gradient reductions each backward launches
        trainer.fit(module, loader, ckpt_path=resume)
    del record["ledger"]
    if save:
        trainer.save_checkpoint(save)
    return trainer


def run_trainer_program(rank: int, world_size: int, program: TrainerProgram, folder: str) -> dict[str, Any]:
    """Rank function of ``run_distributed_test``: train ``program`` (two Trainers when it resumes, the checkpoint in
    ``folder``) and record what the loop sees, in :func:`~mula_lightning.testing.conformance.run_program`'s form."""
    record: dict[str, Any] = {"losses": [], "norms": [], "lrs": [], "steps": [], "reductions": []}
    # a program may step its scheduler before the optimizer's first step (a skipped first window): torch says so
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
    windows = len(program.windows)
    if program.resume_after:
        path = f"{folder}/resume.ckpt"
        _fit(program, world_size, program.resume_after, record, save=path, resume=None)
        trainer = _fit(program, world_size, windows, record, save=None, resume=path)
    else:
        trainer = _fit(program, world_size, windows, record, save=None, resume=None)
    record["lrs"].append([g["lr"] for g in trainer.optimizers[0].param_groups])  # after the last window
    sampler = trainer.strategy.distributed_sampler_kwargs
    record["data_rank"] = sampler["rank"] if sampler else rank
    return record


def check_trainer_program(program: TrainerProgram, timeout: float = 300) -> None:
    """Run ``program`` on its layout's ranks and its calls in one process (Lightning divides each micro-batch's loss
    by the accumulation before its backward; the reference does too); raise an ``AssertionError`` that prints the
    program as code and names the first quantity that differs."""
    from mula_lightning.testing.distributed import run_pooled_test

    if program.layout not in TRAINER_LAYOUTS:
        raise ValueError(f"layout {program.layout!r} is not one the Trainer runs here: {TRAINER_LAYOUTS}")
    if not program.windows or set(program.windows) - {"step", "skip"}:
        raise ValueError(f"windows must be a non-empty sequence of 'step' and 'skip', not {program.windows}")
    if program.resume_after is not None and not 0 < program.resume_after < len(program.windows):
        raise ValueError(f"resume_after ({program.resume_after}) must be in [1, {len(program.windows) - 1}]")
    folder = tempfile.mkdtemp(prefix="mula-trainer-loop-")
    try:
        world = LAYOUTS[program.layout][0]
        results = run_pooled_test(run_trainer_program, world, program=program, folder=folder, timeout=timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    loop = LoopProgram(program.layout, "setup_with_scheduler", program.calls(), program.frozen, None,
                       program.idle_expert)  # fmt: skip
    reference = reference_run(loop, max(r["data_rank"] for r in results) + 1, loss_scale=1.0 / program.accumulate)
    # the Trainer's clip returns its norm to nobody: compare the norm hook's only
    kinds = [call for call in loop.calls if call in ("norm", "clip")]
    reference["norms"] = [norm for kind, norm in zip(kinds, reference["norms"], strict=True) if kind == "norm"]
    for rank, got in enumerate(results):
        problem = first_difference(got, reference, rank) or _reduced_inside_a_window(program, got, rank)
        if problem:
            raise AssertionError(f"{problem}\nthe program:\n{program.to_code()}")


def _reduced_inside_a_window(program: TrainerProgram, got: dict[str, Any], rank: int) -> str | None:
    """``epso`` reduces an accumulation window's gradients once, in its last backward (the Trainer runs the others
    inside ``block_backward_sync``): the same losses would hide a reduction per micro-batch. (``zero_topo`` reduces
    into its gradient shards at every backward by design; DDP's reducer is not in the ledger.)"""
    if LAYOUTS[program.layout][1] != "epso":
        return None
    for i, count in enumerate(got["reductions"]):
        if count and (i + 1) % program.accumulate:
            return f"rank {rank}: backward {i} (not the last of its window) launched {count} gradient reductions"
    return None


def trainer_programs(layout: str) -> Any:
    """A ``hypothesis`` strategy of Trainer programs on ``layout``: one to four windows with at least one step,
    accumulation 1-3, clipping or not, the norm hook or not, a resume after any window or none, any frozen set,
    slow rank and idle expert."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> TrainerProgram:
        windows = tuple(draw(st.lists(st.sampled_from(["step", "skip"]), min_size=1, max_size=4)))
        windows = windows if "step" in windows else (*windows[:-1], "step")
        resume = draw(st.none() | st.integers(1, max(len(windows) - 1, 1)))
        return TrainerProgram(
            layout, windows, accumulate=draw(st.integers(1, 3)), clip=draw(st.booleans()),
            log_norm=draw(st.booleans()), resume_after=resume if resume is not None and resume < len(windows) else None,
            frozen=draw(st.sampled_from(FREEZES)), slow_rank=draw(st.sampled_from([None, 1])),
            idle_expert=draw(st.booleans()),
        )  # fmt: skip

    return build()
