"""Run one training or evaluation step of a pipeline-parallel Mula model, inside a data / expert-parallel stage.

:class:`PipelineRunner` is what the ``epso`` strategies call (Fabric: ``strategy.pipeline_step``; the Trainer:
``MulaLM.training_step`` / ``validation_step`` through the same call). It owns this rank's stages of a model that
:func:`~mula_lightning.parallel.pipeline.prune_to_stages` cut down, and the ``torch.distributed.pipelining``
schedule over the topology's ``pp`` group, and answers the three things a training loop needs from a step that it
cannot see whole:

* **Gradients as one process would have them.** The schedule backpropagates every micro-batch's summed
  cross-entropy scaled by ``loss_scale / (real tokens of the whole batch)`` (``loss_scale`` is the Trainer's
  ``1 / accumulate_grad_batches``; labels of -100 do not count), so the step's loss is the mean over the batch's real
  tokens, as without pipelining, whatever the micro-batches' shares of masked labels (a fully masked one adds
  nothing); each stage's MoE auxiliary losses are weighted ``loss_scale / microbatches``. A
  :class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW` takes gradients as they are produced: its
  reductions are held back during the schedule (every micro-batch adds into the same buffers) and run once, at
  ``clip_grad_norm_`` / ``step``, like the last micro-batch of an accumulation window.
* **The loss on every rank.** Only the last stage sees the cross-entropy and each stage only its own layers'
  auxiliary losses: one all-reduce of two numbers over the ``pp`` group gives every rank of the pipeline the step's
  loss (the batch's per-token mean cross-entropy plus the mean over micro-batches of the weighted auxiliary losses,
  what one process running the micro-batches would report).
* **Evaluation**: a forward-only pass of the schedule that returns the summed cross-entropy of the batch.

Under context parallelism (``topology.cp_size > 1``) the ``cp`` ranks of a stage read the same batch: the first stage
embeds this rank's two chunks of every sequence (:func:`~mula_lightning.parallel.context_parallel.chunk_positions`),
every stage rotates by their global positions, and the last stage's targets are the chunks' next tokens taken from
the whole sequences; each rank's cross-entropy sums its own tokens over the whole batch's real targets, so the
``cp`` ranks' gradients add up to the batch's (the sharded optimizer sums them) and the reported loss is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mula_lightning.models.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, next_token_targets
from mula_lightning.models.transformer import MulaForCausalLM
from mula_lightning.moe.reference import MoEAux
from mula_lightning.parallel.context_parallel import chunk_positions
from mula_lightning.parallel.pipeline import SCHEDULES, build_schedule, split_into_stages
from mula_lightning.parallel.tensor_parallel import check_sequence_split
from mula_lightning.parallel.topology import MoETopology

__all__ = ["PipelineLoss", "PipelineRunner"]


@dataclass
class PipelineLoss:
    """One pipeline step's losses, equal on every rank of its pipeline (detached).

    Attributes:
        loss: ``lm_loss + aux_loss``.
        lm_loss: the next-token cross-entropy averaged over the batch's real tokens (labels other than -100).
        aux_loss: the mean over micro-batches of the weighted MoE auxiliary losses of every stage.
        moe_aux: per MoE layer of the model, the side outputs of its last micro-batch on this rank's stages, None
            for the layers other stages hold (what ``MoEStats`` all-reduces).
    """

    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    moe_aux: list[MoEAux]


class PipelineRunner:
    """This rank's stages of ``model`` and the schedule that runs them (see the module docstring).

    Args:
        model: a ``MulaForCausalLM`` pruned to this rank's stages (materialised, parallelised).
        topology: the layout (``pp_size``, ``pp_rank``, ``pp_group``).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        microbatches: micro-batches per step; None: one sequence each (the batch size).
        virtual_stages: stages per rank (``interleaved_1f1b``).
        boundaries: the first layer of every stage but the first (None: equal layer counts).
        device: where the activations live.
    """

    def __init__(
        self,
        model: MulaForCausalLM,
        topology: MoETopology,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int = 1,
        boundaries: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule ({schedule!r}) must be one of {tuple(SCHEDULES)}")
        self.model = model
        self.topology = topology
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.num_stages = topology.pp_size * virtual_stages
        self.stages = split_into_stages(model, topology.pp_rank, topology.pp_size, virtual_stages, boundaries)
        for _, module in self.stages:  # under sequence parallelism stages pass on 1/tp of each sequence
            module.sequence_split = topology.tp_size if topology.sequence_parallel else 1
        self.first = any(index == 0 for index, _ in self.stages)
        self.last = any(index == self.num_stages - 1 for index, _ in self.stages)
        # the last stage's loss runs the LM head fused with the cross-entropy, in chunks, as MulaForCausalLM does
        # with return_logits=False (a tensor-parallel head keeps its vocabulary-parallel loss over its logits)
        self.fused_loss = self.last and model._fused_loss_applies()
        for index, module in self.stages:
            module.hidden_out = self.fused_loss and index == self.num_stages - 1
        self.device = torch.device(device)
        self._schedules: dict[int, Any] = {}  # by micro-batch count (a last, shorter batch gets its own)
        self._raw: list[torch.Tensor] = []
        self._reduction = "mean"
        self._scale = 1.0
        self.cp = getattr(topology, "cp_size", 1)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss from the last stage's output: its normed hidden states when the loss is fused (the
        LM head's weight gradient is computed here, in chunks, and reaches the head in the backward), else logits."""
        if self.fused_loss:
            weight = self.model.lm_head.weight
            loss = linear_cross_entropy(output, weight, labels, self._reduction, self.model.loss_chunk_tokens,
                                        self.model.config.loss_backend, shifted=self.cp > 1)  # fmt: skip
        elif self.cp > 1:  # the chunks' targets, shifted already
            loss = self.model.loss_function(output, labels, self._reduction, shifted=True)
        else:
            loss = self.model.loss_function(output, labels, self._reduction)
        self._raw.append(loss.detach())
        scale = self._scale.to(loss.dtype) if isinstance(self._scale, torch.Tensor) else self._scale
        return loss * scale

    def _schedule(self, input_ids: torch.Tensor, evaluating: bool = False) -> tuple[Any, int]:
        if self.topology.sequence_parallel:  # the stages bypass the decoder's own check of the sequence length
            check_sequence_split(int(input_ids.shape[-1]) // self.cp, self.topology.tp_size)
        batch_size = int(input_ids.shape[0])
        count = self.microbatches or batch_size
        if batch_size % count and evaluating:  # a validation batch of another size: one sequence per micro-batch
            count = batch_size
        if batch_size % count:
            raise ValueError(
                f"the batch ({batch_size} sequences per rank) must be divisible by pp_microbatches ({count})"
            )
        if count not in self._schedules:
            self._schedules[count] = build_schedule(
                self.schedule_name, self.stages, self.num_stages, count, self.device, self._loss,
                group=self.topology.pp_group,
            )  # fmt: skip
        return self._schedules[count], count

    def _begin(self, reduction: str, scale: float | torch.Tensor, aux_scale: float) -> None:
        self._raw, self._reduction, self._scale = [], reduction, scale
        for _, module in self.stages:
            module.aux_history = []
            module.load_history = []
            module.aux_grad_scale = aux_scale

    def _cut(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunks of the batch under context parallelism: the tokens the first stage embeds and the
        next-token targets the last stage scores (the positions set on every stage); the batch itself without it."""
        if self.cp == 1:
            return input_ids, labels
        positions = chunk_positions(int(input_ids.shape[1]), self.cp, self.topology.cp_rank, input_ids.device)
        for _, module in self.stages:
            module.positions = positions
        return input_ids.index_select(1, positions), next_token_targets(labels).index_select(1, positions)

    def _context_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A rank's share of the cross-entropy summed over its ``cp`` ranks (float64 on the wire)."""
        if self.cp == 1:
            return value
        value = value.to(self.device, torch.float64).clone()
        dist.all_reduce(value, group=self.topology.cp_group)
        return value

    def _pipeline_sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """``values`` summed over this rank's part and then over the ``pp`` group (float64 on the wire)."""
        total = torch.stack([v.to(self.device, torch.float64) for v in values])
        if self.topology.pp_size > 1 and dist.is_initialized():
            dist.all_reduce(total, group=self.topology.pp_group)
        return total

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_scale: float = 1.0) -> PipelineLoss:
        """Forward and backward of every micro-batch of ``(input_ids, labels)`` (the same batch on every rank of the
        pipeline; only the first stage reads ``input_ids`` and the last ``labels``); the gradients are those of
        ``loss_scale x`` the step's loss. Collective over the ``pp`` group (and the stage's EP / TP groups)."""
        schedule, count = self._schedule(input_ids)
        # each micro-batch's summed cross-entropy over the batch's real tokens (ignored labels, -100, do not count):
        # the step's loss is the mean over the batch's real tokens, as one forward of the whole batch computes it, and
        # a fully masked micro-batch adds 0 instead of a NaN (a mean over its own tokens would be 0/0)
        tokens = self._real_tokens(labels) if self.last else None
        # (the schedule's loss function divides by the micro-batch count: multiplied back here)
        scale = loss_scale * count / tokens if tokens is not None else loss_scale
        self._begin("sum", scale, loss_scale / count)
        input_ids, targets = self._cut(input_ids, labels)
        args = (input_ids,) if self.first else ()
        kwargs = {"target": targets, "losses": []} if self.last else {}
        schedule.step(*args, **kwargs)
        # the last ``count`` forwards of each stage are the micro-batches' (a schedule's first step runs one more,
        # to infer the shapes it sends)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        lm = self._context_sum(torch.stack(self._raw[-count:]).sum()) / tokens if self.last else zero
        aux = [a for _, m in self.stages for a in m.aux_history[-count:]]
        for _, module in self.stages:
            module.add_loads(count)  # the micro-batches' expert loads, for the selection bias's update
        lm, aux = self._pipeline_sum([lm, (torch.stack(aux).sum() if aux else zero) / count])
        held = {i: a for _, m in self.stages for i, a in zip(m.last_aux_layers, m.last_aux)}
        config = self.model.config
        moe_aux = [held.get(i) for i in range(config.num_layers) if config.is_moe_layer(i)]
        return PipelineLoss(loss=lm + aux, lm_loss=lm, aux_loss=aux, moe_aux=moe_aux)

    def _real_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """The batch's next-token targets that count (labels shifted by one, -100 ignored), at least 1, as a float64
        tensor on the device (no host read)."""
        return (next_token_targets(labels) != IGNORE_INDEX).sum().clamp(min=1).to(self.device, torch.float64)

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed next-token cross-entropy of the batch (forward only), on every rank of the pipeline."""
        schedule, count = self._schedule(input_ids, evaluating=True)
        self._begin("sum", 1.0, 0.0)
        input_ids, targets = self._cut(input_ids, labels)
        args = (input_ids,) if self.first else ()
        kwargs = {"target": targets, "losses": []} if self.last else {}
        if hasattr(schedule, "eval"):
            schedule.eval(*args, **kwargs)
        else:  # torch before ``eval``: what it does, by hand
            previous, schedule._has_backward = schedule._has_backward, False
            try:
                schedule.step(*args, **kwargs)
            finally:
                schedule._has_backward = previous
        total = (
            self._context_sum(torch.stack(self._raw[-count:]).sum())
            if self.last
            else torch.zeros((), dtype=torch.float64)
        )
        return self._pipeline_sum([total])[0]
