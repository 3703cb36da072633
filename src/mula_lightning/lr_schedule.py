"""The learning-rate schedule of :class:`~mula_lightning.lightning_module.MulaLM`, and what a resume does with it.

Warm-up then cosine (:func:`warmup_cosine`). Why a module of its own: the schedule is part of the run's state, not of
its configuration. Before, the horizon (``decay_steps: null`` = ``trainer.max_steps``) was resolved anew at every
start, so the quick start's ``--trainer.max_steps 300 --ckpt_path last`` after a 200-step run moved the cosine under
the running model, silently (lr 3.0e-4 at step 199, 1.06e-3 at step 204; on a 7B run the same extension raises the
rate several-fold). Now the resolved schedule (warm-up, horizon, peak, minimum) is saved in the scheduler's state,
and a resume (:meth:`WarmupCosineLR.load_state_dict`):

* keeps the checkpoint's schedule when only the horizon that ``decay_steps: null`` follows changed (a longer
  ``max_steps``: the rate stays at ``min_lr`` after the old horizon), and says so in one line;
* refuses any other change (``lr``, ``min_lr``, ``warmup_steps``, an explicit ``decay_steps``) with one line naming
  both values (:class:`ScheduleChangeError`);
* re-plans when asked (``MulaLM(replan_schedule=True)``, ``--model.replan_schedule true``): this run's schedule from
  the checkpoint's step on, the rate jumping to where the new schedule is at that step.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

__all__ = ["ScheduleChangeError", "WarmupCosine", "WarmupCosineLR", "warmup_cosine"]


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


class ScheduleChangeError(ValueError):
    """A resume asked for another learning-rate schedule than the checkpoint's, without ``replan_schedule``."""


class WarmupCosine:
    """The factor of the peak rate at a step, as a ``LambdaLR`` function whose settings travel in the scheduler's
    state (torch saves a callable object's ``__dict__``; a plain function or lambda is not saved)."""

    def __init__(self, warmup_steps: int, decay_steps: int, peak: float, minimum: float) -> None:
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.peak, self.minimum = float(peak), float(minimum)

    def __call__(self, step: int) -> float:
        if self.peak <= 0:  # lr 0 (a frozen run: weights load, nothing moves) keeps every rate at 0
            return 0.0
        return warmup_cosine(step, self.warmup_steps, self.decay_steps, self.peak, self.minimum) / self.peak

    def describe(self) -> str:
        return (
            f"peak {self.peak:g} after {self.warmup_steps} warm-up steps, cosine to {self.minimum:g} at step "
            f"{self.decay_steps}"
        )


#: the settings a resume may differ in, as the user names them
_NAMES = {"warmup_steps": "warmup_steps", "decay_steps": "decay_steps", "peak": "lr", "minimum": "min_lr"}


class WarmupCosineLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over a :class:`WarmupCosine` that keeps the checkpoint's schedule on a resume (see the module).

    Args:
        optimizer: the optimizer (its groups' ``lr`` are the peak).
        schedule: this run's resolved schedule.
        horizon_follows_max_steps: ``decay_steps`` was not given (it follows ``trainer.max_steps``): a resume with
            another ``max_steps`` keeps the checkpoint's horizon instead of refusing.
        replan: on a resume, use this run's schedule instead of the checkpoint's.
    """

    def __init__(self, optimizer: Any, schedule: WarmupCosine, horizon_follows_max_steps: bool = False,
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
        changed = {key: (saved.get(key), value) for key, value in mine.items() if saved.get(key) != value}
        if not changed:
            return
        if self.replan:
            vars(self.schedule).update(mine)
            self.base_lrs = base_lrs
            for group, lr in zip(self.optimizer.param_groups, self._lrs_now(), strict=True):
                group["lr"] = lr
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
            _say(f"resume: the learning-rate schedule is re-planned: {self.schedule.describe()}")
            return
        if set(changed) == {"decay_steps"} and self.horizon_follows_max_steps:
            old, new = changed["decay_steps"]
            message = (
                f"resume: keeping the checkpoint's learning-rate schedule ({self.schedule.describe()}); "
                f"decay_steps follows trainer.max_steps, which would make it {new} now "
                f"(--model.replan_schedule true to stretch the cosine to it)"
            )
            _say(message)
            return
        names = ", ".join(f"{_NAMES[key]} {old!r} (checkpoint) vs {new!r} (now)" for key, (old, new) in changed.items())
        raise ScheduleChangeError(
            f"the checkpoint was trained with another learning-rate schedule: {names}; resume with the checkpoint's "
            "values, or set model.replan_schedule: true (--model.replan_schedule true) to switch to the new one"
        )

    def _lrs_now(self) -> list[float]:
        return [base * self.schedule(self.last_epoch) for base in self.base_lrs]
