"""The learning-rate schedules of :class:`~mula_lightning.lightning_module.MulaLM`, and what a resume does with them.

Three shapes after a linear warm-up (``MulaLM(lr_schedule=...)``): ``cosine`` to ``min_lr`` at the horizon
(:func:`warmup_cosine`, the Aurora recipes'); ``wsd``, warmup-stable-decay (:func:`warmup_stable_decay`): the peak
until the last ``decay_fraction`` of the horizon, then a ``linear`` or ``1-sqrt`` decay to ``min_lr``, so that a run
can be extended while it is stable and annealed from any checkpoint (MiniCPM, DeepSeek, Moonlight); ``constant``: the
peak after the warm-up.

Why a module of its own: the schedule is part of the run's state, not of its configuration. Before, the horizon
(``decay_steps: null`` = ``trainer.max_steps``) was resolved anew at every start, so the quick start's
``--trainer.max_steps 300 --ckpt_path last`` after a 200-step run moved the cosine under the running model, silently
(lr 3.0e-4 at step 199, 1.06e-3 at step 204; on a 7B run the same extension raises the rate several-fold). Now the
resolved schedule is saved in the scheduler's state, and a resume (:meth:`ScheduledLR.load_state_dict`):

* when only the horizon that ``decay_steps: null`` follows changed (another ``max_steps``): takes the new horizon if
  the rate of the step it resumes at stays the same (a WSD run extended in its stable phase, a constant schedule),
  else keeps the checkpoint's (a cosine: the rate stays at ``min_lr`` after the old horizon); one line says which;
* refuses any other change (``lr``, ``min_lr``, ``warmup_steps``, an explicit ``decay_steps``, the shape) with one
  line naming both values (:class:`ScheduleChangeError`);
* re-plans when asked (``MulaLM(replan_schedule=True)``, ``--model.replan_schedule true``): this run's schedule from
  the checkpoint's step on, the rate jumping to where the new schedule is at that step (annealing a WSD run from
  step S over the next D steps: ``decay_steps = S + D``, ``decay_fraction = D / (S + D)``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

__all__ = ["DECAY_SHAPES", "LR_SCHEDULES", "LRSchedule", "ScheduleChangeError", "ScheduledLR", "warmup_cosine",
           "warmup_stable_decay"]  # fmt: skip

#: ``MulaLM(lr_schedule=...)``
LR_SCHEDULES = ("cosine", "wsd", "constant")
#: the decay of ``wsd``: the fraction ``p`` of the decay done maps to ``1 - p`` or ``1 - sqrt(p)`` of the way down
DECAY_SHAPES = ("linear", "1-sqrt")


def _say(message: str) -> None:
    """One line on stderr from the global rank 0 (every rank resumes the same schedule)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, peak: float, minimum: float) -> float:
    """Learning rate at optimizer step ``step``: linear warm-up to ``peak``, cosine decay to ``minimum``.

    Step 0 uses ``peak / warmup_steps`` (never zero, so the first update is not wasted); the rate reaches ``peak``
    at ``step == warmup_steps``, follows half a cosine to ``minimum`` at ``decay_steps`` and stays there.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if step >= decay_steps:
        return minimum
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, warmup_steps: int, decay_steps: int, peak: float, minimum: float,
                        decay_fraction: float = 0.2, shape: str = "1-sqrt") -> float:  # fmt: skip
    """Learning rate at optimizer step ``step``: warm-up as :func:`warmup_cosine`, ``peak`` until the decay starts at
    ``decay_steps - round(decay_fraction x decay_steps)`` (not before the warm-up ends), then ``linear`` or ``1-sqrt``
    down to ``minimum`` at ``decay_steps``, and ``minimum`` after."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if step >= decay_steps:
        return minimum
    start = max(warmup_steps, decay_steps - round(decay_fraction * decay_steps))
    if step < start:
        return peak
    done = (step - start) / max(1, decay_steps - start)
    left = 1.0 - done if shape == "linear" else 1.0 - math.sqrt(done)
    return minimum + (peak - minimum) * left


class ScheduleChangeError(ValueError):
    """A resume asked for another learning-rate schedule than the checkpoint's, without ``replan_schedule``."""


class LRSchedule:
    """The factor of the peak rate at a step, as a ``LambdaLR`` function whose settings travel in the scheduler's
    state (torch saves a callable object's ``__dict__``; a plain function or lambda is not saved).

    Args:
        warmup_steps, decay_steps, peak, minimum: as :func:`warmup_cosine` (``decay_steps``: the horizon).
        kind: one of :data:`LR_SCHEDULES`.
        decay_fraction, decay_shape: the decay of ``wsd`` (:func:`warmup_stable_decay`).
    """

    def __init__(self, warmup_steps: int, decay_steps: int, peak: float, minimum: float, kind: str = "cosine",
                 decay_fraction: float = 0.2, decay_shape: str = "1-sqrt") -> None:  # fmt: skip
        if kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule {kind!r} is not one of {LR_SCHEDULES}")
        if decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape {decay_shape!r} is not one of {DECAY_SHAPES}")
        if not 0.0 <= decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction ({decay_fraction}) must be in [0, 1]")
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.peak, self.minimum = float(peak), float(minimum)
        self.kind, self.decay_fraction, self.decay_shape = kind, float(decay_fraction), decay_shape

    def rate(self, step: int) -> float:
        """The learning rate at ``step``."""
        if self.kind == "wsd":
            return warmup_stable_decay(step, self.warmup_steps, self.decay_steps, self.peak, self.minimum,
                                       self.decay_fraction, self.decay_shape)  # fmt: skip
        if self.kind == "constant":
            return self.peak * (step + 1) / self.warmup_steps if step < self.warmup_steps else self.peak
        return warmup_cosine(step, self.warmup_steps, self.decay_steps, self.peak, self.minimum)

    def __call__(self, step: int) -> float:
        if self.peak <= 0:  # lr 0 (a frozen run: weights load, nothing moves) keeps every rate at 0
            return 0.0
        return self.rate(step) / self.peak

    def settings(self) -> dict[str, Any]:
        """What defines this schedule's rates (the fields another kind ignores left out), for comparing two."""
        out = {"kind": self.kind, "warmup_steps": self.warmup_steps, "peak": self.peak}
        if self.kind != "constant":
            out |= {"decay_steps": self.decay_steps, "minimum": self.minimum}
        if self.kind == "wsd":
            out |= {"decay_fraction": self.decay_fraction, "decay_shape": self.decay_shape}
        return out

    def describe(self) -> str:
        head = f"peak {self.peak:g} after {self.warmup_steps} warm-up steps"
        if self.kind == "constant":
            return f"{head}, constant"
        if self.kind == "wsd":
            start = max(self.warmup_steps, self.decay_steps - round(self.decay_fraction * self.decay_steps))
            return f"{head}, stable to step {start}, {self.decay_shape} to {self.minimum:g} at step {self.decay_steps}"
        return f"{head}, cosine to {self.minimum:g} at step {self.decay_steps}"


#: the settings a resume may differ in, as the user names them
_NAMES = {"kind": "lr_schedule", "warmup_steps": "warmup_steps", "decay_steps": "decay_steps", "peak": "lr",
          "minimum": "min_lr", "decay_fraction": "decay_fraction", "decay_shape": "decay_shape"}  # fmt: skip


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over an :class:`LRSchedule` that keeps the checkpoint's schedule on a resume (see the module).

    Args:
        optimizer: the optimizer (its groups' ``lr`` are the peak).
        schedule: this run's resolved schedule.
        horizon_follows_max_steps: ``decay_steps`` was not given (it follows ``trainer.max_steps``): a resume with
            another ``max_steps`` takes or keeps the horizon (see the module) instead of refusing.
        replan: on a resume, use this run's schedule instead of the checkpoint's.
    """

    def __init__(self, optimizer: Any, schedule: LRSchedule, horizon_follows_max_steps: bool = False,
                 replan: bool = False) -> None:  # fmt: skip
        self.schedule, self.horizon_follows_max_steps, self.replan = schedule, horizon_follows_max_steps, replan
        super().__init__(optimizer, schedule)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for key in ("schedule", "horizon_follows_max_steps", "replan"):  # the object, and this run's own choices
            state.pop(key, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = dict(vars(self.schedule))
        base_lrs = list(self.base_lrs)
        saved = (state_dict.get("lr_lambdas") or [None])[0]
        super().load_state_dict(state_dict)  # torch puts the saved settings into self.schedule
        if saved is None:  # a checkpoint of a plain lambda (before the schedule was saved): this run's schedule
            vars(self.schedule).update(mine)
            return
        # a checkpoint of the first saved schedule (cosine only) holds no kind, fraction or shape: a cosine
        for key in ("kind", "decay_fraction", "decay_shape"):
            if key not in saved:
                setattr(self.schedule, key, "cosine" if key == "kind" else mine[key])
        old_settings = self.schedule.settings()
        ours = LRSchedule(**mine)
        new_settings = ours.settings()
        changed = {
            key: (old_settings.get(key), new_settings.get(key))
            for key in dict.fromkeys([*old_settings, *new_settings])
            if old_settings.get(key) != new_settings.get(key)
        }
        if not changed:
            return
        step = self.last_epoch
        if self.replan:
            self._take(mine, base_lrs, f"resume: the learning-rate schedule is re-planned: {ours.describe()}")
            return
        if set(changed) == {"decay_steps"} and self.horizon_follows_max_steps:
            old, new = changed["decay_steps"]
            if math.isclose(self.schedule.rate(step), ours.rate(step), rel_tol=1e-12):  # no jump at the resume
                message = (
                    f"resume: the schedule's horizon moves from step {old} to {new} with trainer.max_steps; the rate "
                    f"at step {step} is unchanged ({ours.describe()})"
                )
                self._take(mine, base_lrs, message)
                return
            _say(
                f"resume: keeping the checkpoint's learning-rate schedule ({self.schedule.describe()}); "
                f"decay_steps follows trainer.max_steps, which would make it {new} now and move the rate at step "
                f"{step} (--model.replan_schedule true to take it)"
            )
            return
        names = ", ".join(f"{_NAMES[key]} {old!r} (checkpoint) vs {new!r} (now)" for key, (old, new) in changed.items())
        raise ScheduleChangeError(
            f"the checkpoint was trained with another learning-rate schedule: {names}; resume with the checkpoint's "
            "values, or set model.replan_schedule: true (--model.replan_schedule true) to switch to the new one"
        )

    def _take(self, mine: dict[str, Any], base_lrs: list[float], message: str) -> None:
        """Switch to this run's schedule (``mine``) at the checkpoint's step, the rate set now."""
        vars(self.schedule).update(mine)
        self.base_lrs = base_lrs
        for group, lr in zip(self.optimizer.param_groups, self._lrs_now(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        _say(message)

    def _lrs_now(self) -> list[float]:
        return [base * self.schedule(self.last_epoch) for base in self.base_lrs]
