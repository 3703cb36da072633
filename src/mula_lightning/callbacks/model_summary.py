"""``MulaModelSummary``: Lightning's model summary with the whole model's parameters, not one rank's shard (issue 76).

Lightning's summary sums ``p.numel()`` over the module on rank 0 after the strategy set it up. Under expert
parallelism each rank holds ``1 / ep`` of the experts (under pipeline parallelism its stage's layers only), so the
tiny MoE on DP 2 x EP 2 printed 2.1 M parameters of its 2.89 M, and a 7B run a fraction of its size. For a module
holding a Mula model (``pl_module.config`` with ``num_params``) this summary counts the model from its config (what
``mula models`` and ``mula plan`` count) in the model's row, the totals and the size; frozen parameters are counted
whole the same way (an expert slice times the experts' split). Other modules get Lightning's summary unchanged.
``mula fit`` puts it in place of Lightning's default summary.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary

from mula_lightning.parallel.params import is_dtensor, is_expert_param

__all__ = ["MulaModelSummary", "MulaRichModelSummary", "replace_model_summary"]


class _WholeModel(Summary):
    """The summary of ``pl_module`` with its Mula model counted from the config (see the module)."""

    def __init__(self, pl_module: Any, max_depth: int, expert_split: int) -> None:
        self._mula_model = pl_module.model
        self._whole = int(pl_module.config.num_params())
        self._expert_split = expert_split
        super().__init__(pl_module, max_depth=max_depth)

    def _outside_model(self, trainable_only: bool = False) -> int:
        inside = {id(p) for p in self._mula_model.parameters()}
        outside = [p for p in self._model.parameters() if id(p) not in inside]
        return sum(p.numel() for p in outside if p.requires_grad or not trainable_only)

    @property
    def param_nums(self) -> list[int]:
        return [
            self._whole if layer._module is self._mula_model else layer.num_parameters
            for layer in self._layer_summary.values()
        ]

    @property
    def total_parameters(self) -> int:
        return self._whole + self._outside_model()

    @property
    def trainable_parameters(self) -> int:
        frozen = 0
        for name, p in self._mula_model.named_parameters():
            if not p.requires_grad:  # an expert slice of 1 / (ep x etp) of the experts: counted whole
                split = self._expert_split if is_expert_param(name) and not is_dtensor(p) else 1
                frozen += p.numel() * split
        return self._whole - frozen + self._outside_model(trainable_only=True)


class _WholeModelSummary:
    """What both of Lightning's summary callbacks (plain and Rich) compute, with the Mula model counted whole."""

    def _summary(self, trainer: Any, pl_module: Any) -> Any:
        config, model = getattr(pl_module, "config", None), getattr(pl_module, "model", None)
        if model is None or not callable(getattr(config, "num_params", None)):
            return super()._summary(trainer, pl_module)
        topology = getattr(trainer.strategy, "topology", None)
        split = int(getattr(topology, "ep_size", 1) or 1) * int(getattr(topology, "etp_size", 1) or 1)
        return _WholeModel(pl_module, max_depth=self._max_depth, expert_split=split)


class MulaModelSummary(_WholeModelSummary, ModelSummary):
    """Lightning's ``ModelSummary`` counting a Mula model whole (see the module)."""


class MulaRichModelSummary(_WholeModelSummary, RichModelSummary):
    """Lightning's ``RichModelSummary`` (its default where ``rich`` is installed) counting a Mula model whole."""


def replace_model_summary(trainer: Any) -> None:
    """Put :class:`MulaModelSummary` (or its Rich twin) in place of the summary Lightning added
    (``enable_model_summary``), keeping its depth; a summary class the user configured is left alone."""
    twins = {ModelSummary: MulaModelSummary, RichModelSummary: MulaRichModelSummary}
    for index, callback in enumerate(trainer.callbacks):
        twin = twins.get(type(callback))
        if twin is not None:
            trainer.callbacks[index] = twin(max_depth=callback._max_depth, **callback._summarize_kwargs)
