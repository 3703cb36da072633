"""Pipeline parallelism of a Mula model: stages by layers, MoE losses in each stage's own backward, torch schedules.

A :class:`~mula_lightning.models.transformer.MulaForCausalLM` is cut into ``pp x virtual`` stages of consecutive
decoder layers (:func:`stage_layer_ranges`: equal counts, or the boundaries given): the first stage also holds the
embedding, the last the final norm and the LM head (the loss is the schedule's ``loss_fn`` on the last stage). Each
:class:`PipelineStageModule` shares its parameters with the model it was cut from and runs under
``torch.distributed.pipelining`` (:func:`build_schedule`: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` with several
stages per rank), which moves activations between stages with point-to-point sends; gradients are those of the mean
over the micro-batches (the loss is scaled by ``1 / microbatches`` before its backward rather than the gradients
after it, so that a sharded optimizer whose hooks take each gradient as it is produced sees them scaled).

Under a strategy, :func:`prune_to_stages` first removes from the (meta-device) model everything this rank's stages
do not hold, so nothing else is ever materialised, and the parameters keep their single-device names (checkpoint
keys, optimizer state keys). The zero-bubble schedules of ``torch.distributed.pipelining`` are not offered: they
split each backward into an input part and a later weight part that computes the weight gradients with
``torch.autograd.grad`` and assigns ``param.grad`` itself, so the post-accumulate-grad hooks through which the
sharded optimizer takes (and reduces) every gradient would never fire.

MoE auxiliary losses (load balancing, z) are computed in every stage and must reach that stage's backward: a stage
only hands activations to the next, and the schedules (interleaved and zero-bubble ones above all) backpropagate
each stage separately, so a loss returned alongside the activations would be dropped or double counted (torchtitan's
lesson). :class:`_StageAuxLoss` is an identity on the stage's output whose backward also feeds a gradient of one into
the stage's summed auxiliary loss (scaled by :attr:`PipelineStageModule.aux_grad_scale`, the cross-entropy's own
``1 / microbatches``), so each micro-batch's auxiliary losses enter exactly one backward: the total equals one
process averaging the micro-batches' losses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mula_lightning.models.transformer import MulaForCausalLM, rotary_cos_sin
from mula_lightning.moe.balancing import expert_bias_routers
from mula_lightning.moe.reference import MoEAux

__all__ = [
    "SCHEDULES",
    "PipelineStageModule",
    "balanced_boundaries",
    "build_schedule",
    "prune_to_stages",
    "split_into_stages",
    "stage_layer_ranges",
    "stages_of_rank",
]

#: ``pp_schedule`` name -> whether it runs several stages per rank
SCHEDULES = {"gpipe": False, "1f1b": False, "interleaved_1f1b": True}


def stage_layer_ranges(num_layers: int, num_stages: int, boundaries: list[int] | None = None) -> list[range]:
    """The decoder layers of each of ``num_stages`` stages: equal counts, or cut at ``boundaries`` (the first layer
    of every stage but the first, increasing).

    Raises:
        ValueError: naming the values when the stages do not divide the layers, or the boundaries do not cut
            ``num_layers`` layers into ``num_stages`` non-empty stages.
    """
    if boundaries is None:
        if num_stages < 1 or num_layers % num_stages:
            raise ValueError(
                f"num_layers ({num_layers}) must be divisible by the pipeline stages ({num_stages} = pp_size x "
                "virtual stages), or give the stage boundaries"
            )
        per = num_layers // num_stages
        return [range(s * per, (s + 1) * per) for s in range(num_stages)]
    cuts = [0, *boundaries, num_layers]
    if len(boundaries) != num_stages - 1 or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(
            f"stage boundaries {boundaries} must be {num_stages - 1} increasing layer indices inside (0, {num_layers})"
        )
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def stages_of_rank(pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs: ``pp_rank + v * pp_size`` for each virtual stage ``v`` (the
    interleaved schedules' loop order; one stage per rank without virtual stages)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank ({pp_rank}) must be in [0, pp_size ({pp_size}))")
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def balanced_boundaries(model: MulaForCausalLM, num_stages: int) -> list[int]:
    """Stage boundaries (see :func:`stage_layer_ranges`) that balance the stages by parameter count: contiguous
    layers, the embedding counted on the first stage and the final norm and LM head on the last, the largest stage
    as small as it can be (by dynamic programming over the cut points; works on the meta device), and among such
    cuts one whose stages are even otherwise (smallest sum of squared sizes).

    Raises:
        ValueError: fewer layers than stages.
    """
    layers = len(model.model.layers)
    if not 1 <= num_stages <= layers:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the model has {layers}")
    weights = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    weights[0] += sum(p.numel() for p in model.model.embed_tokens.parameters())
    weights[-1] += sum(p.numel() for p in (*model.model.norm.parameters(), *model.lm_head.parameters()))
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[s][i]: (largest stage, sum of squared stages) of the best cut of the first i layers into s stages;
    # cut[s][i]: where the last of those stages starts
    best = [[inf] * (layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, num_stages + 1):
        for i in range(s, layers + 1):
            for j in range(s - 1, i):
                size = prefix[i] - prefix[j]
                value = (max(best[s - 1][j][0], size), best[s - 1][j][1] + size * size)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], layers
    for s in range(num_stages, 1, -1):
        i = cut[s][i]
        bounds.append(i)
    return sorted(bounds)


class _LayerOnAnotherStage(nn.Module):
    """What is left of a decoder layer another pipeline rank holds: no parameters, and a forward that says so."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"decoder layer {self.index} lives on another pipeline stage: run a pipeline-parallel model with the "
            "strategy's pipeline_step (or MulaLM, which does)"
        )


def _refuse_whole_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"this rank holds pipeline stages {module.pipeline_stages} of the model (layers {module.pipeline_layers}), "
        "not the whole model: run it with the strategy's pipeline_step (MulaLM does)"
    )


def prune_to_stages(
    model: MulaForCausalLM,
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
    boundaries: list[int] | str | None = None,
) -> list[int]:
    """Remove from ``model`` (in place, on the meta device before materialisation) every part this rank's stages do
    not hold: the other stages' decoder layers (each left as a parameterless placeholder, so the kept layers keep
    their single-device indices and names), the embedding unless it holds stage 0, the final norm and LM head unless
    it holds the last stage. Returns the decoder layers kept. The pruned model's own forward refuses to run.

    ``boundaries``: the first layer of every stage but the first, ``"params"`` to balance the stages by parameter
    count (:func:`balanced_boundaries`, computed here on the whole model), or None for equal layer counts; the cuts
    used are kept as ``model.pipeline_boundaries`` (what :func:`split_into_stages` takes by default).

    Raises:
        ValueError: a module that is not a ``MulaForCausalLM``, stages that do not fit its layers, or tied word
            embeddings (the embedding and the LM head live on different stages).
    """
    if not isinstance(model, MulaForCausalLM):
        raise ValueError(f"pipeline parallelism splits a MulaForCausalLM by layers; got {type(model).__name__}")
    total = pp_size * virtual_stages
    if boundaries == "params":
        boundaries = balanced_boundaries(model, total)
    elif isinstance(boundaries, str):
        raise ValueError(f"pp_boundaries ({boundaries!r}) must be a list of layer indices, 'params' or None")
    ranges = stage_layer_ranges(model.config.num_layers, total, boundaries)
    mine = stages_of_rank(pp_rank, pp_size, virtual_stages)
    if pp_size > 1 and model.config.tie_word_embeddings:
        raise ValueError(
            f"pipeline parallelism (pp_size {pp_size}) puts the embedding on the first stage and the LM head on the "
            f"last: {model.config.name} ties them (tie_word_embeddings=True)"
        )
    kept = sorted(i for s in mine for i in ranges[s])
    for i in range(model.config.num_layers):
        if i not in kept:
            model.model.layers[i] = _LayerOnAnotherStage(i)
    if 0 not in mine:
        model.model.embed_tokens = None
    if total - 1 not in mine:
        model.model.norm = None
        model.lm_head = None
    model.pipeline_stages, model.pipeline_layers = mine, kept
    model.pipeline_boundaries = [r.start for r in ranges[1:]]
    model.register_forward_pre_hook(_refuse_whole_forward)
    return kept


class _StageAuxLoss(torch.autograd.Function):
    """Identity on a stage's output; its backward also gives the stage's auxiliary loss the gradient ``scale`` (the
    micro-batch's weight in the step's loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device, scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device, scale = ctx.aux_meta
        return grad, torch.full(shape, scale, dtype=dtype, device=device), None


class PipelineStageModule(nn.Module):
    """The part of a Mula model one pipeline stage runs: decoder layers ``layers`` (their parameters shared with
    ``model``), with the embedding on the first stage and the final norm and LM head on the last.

    ``forward`` takes token ids (first stage) or hidden states (the others) and returns hidden states, or logits on
    the last stage (its normed hidden states with :attr:`hidden_out`). The MoE side outputs of its last forward are
    in :attr:`last_aux` (detached, for statistics), and :attr:`aux_history` holds the weighted auxiliary loss of
    every forward since it was last emptied (for logging).
    """

    #: the gradient each micro-batch's auxiliary loss gets in its backward (set by :func:`build_schedule`: the
    #: micro-batch's weight in the step's loss)
    aux_grad_scale: float = 1.0
    #: the ways tensor parallelism's sequence parallelism splits the activations a stage passes on along the
    #: sequence (1 without it): the rotary tables are those of the whole sequence
    sequence_split: int = 1
    #: the last stage returns the normed hidden states instead of logits, for a loss that runs the LM head fused
    #: with the cross-entropy (set by :class:`~mula_lightning.parallel.pipeline_runner.PipelineRunner`)
    hidden_out: bool = False
    #: under context parallelism, the global positions of this rank's chunks (RoPE rotates by them; set per step by
    #: the runner); None: ``0..T-1``
    positions: torch.Tensor | None = None

    def __init__(self, model: MulaForCausalLM, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.layer_ids = list(layers)
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})  # single-device indices
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.last_aux: list[MoEAux] = []
        self.last_aux_layers: list[int] = []  # the decoder layer of each entry of last_aux
        self.aux_history: list[torch.Tensor] = []
        #: this stage's routers whose selection bias moves, and the loads each forward routed through them (not
        #: added to their ``pending_load``: the runner adds the micro-batches' only, not a shape-inference forward's)
        self.bias_routers = expert_bias_routers(self.layers)
        self.load_history: list[list[torch.Tensor | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bias_routers:
            return self._forward(x)
        before = [r.pending_load for r in self.bias_routers]
        for router in self.bias_routers:
            router.pending_load = None
        try:
            return self._forward(x)
        finally:
            self.load_history.append([r.pending_load for r in self.bias_routers])
            for router, load in zip(self.bias_routers, before):
                router.pending_load = load

    def add_loads(self, count: int) -> None:
        """Add the loads of the last ``count`` forwards (a step's micro-batches) to the routers' pending loads."""
        for loads in self.load_history[-count:] if count else []:
            for router, load in zip(self.bias_routers, loads):
                if load is not None:
                    router.pending_load = load if router.pending_load is None else router.pending_load + load
        self.load_history = []

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            if x.dim() != 2:
                raise ValueError(f"the first stage takes input_ids (batch, seq_len), got shape {tuple(x.shape)}")
            seq_len = x.shape[1]
            x = self.embed_tokens(x)
        else:
            seq_len = x.shape[1] * self.sequence_split
        cos, sin = rotary_cos_sin(self.config, seq_len, x.device, x.dtype, self.positions)
        aux, ids = [], []
        for index, layer in zip(self.layer_ids, self.layers.values()):
            x, layer_aux = layer(x, cos, sin)
            if layer_aux is not None:
                aux.append(layer_aux)
                ids.append(index)
        self.last_aux = [a.detach() for a in aux]
        self.last_aux_layers = ids
        if aux:  # this stage's auxiliary losses enter this stage's backward
            total = torch.stack([a.aux_loss for a in aux]).sum()
            self.aux_history.append(total.detach())
            x = _StageAuxLoss.apply(x, total, self.aux_grad_scale)
        if self.norm is not None:
            x = self.norm(x) if self.hidden_out else self.lm_head(self.norm(x))
        return x


def split_into_stages(
    model: MulaForCausalLM, pp_rank: int, pp_size: int, virtual_stages: int = 1, boundaries: list[int] | None = None
) -> list[tuple[int, PipelineStageModule]]:
    """This rank's stages of ``model`` as ``(stage index, module)``: stage ``pp_rank + v * pp_size`` for each virtual
    stage ``v`` (the interleaved schedules' loop order), ``pp_size * virtual_stages`` stages in all.

    Raises:
        ValueError: for a module that is not a ``MulaForCausalLM``, or stages that do not fit its layers.
    """
    if not isinstance(model, MulaForCausalLM):
        raise ValueError(f"pipeline parallelism splits a MulaForCausalLM by layers; got {type(model).__name__}")
    total = pp_size * virtual_stages
    if boundaries is None:  # the cuts the model was pruned with, if it was
        boundaries = getattr(model, "pipeline_boundaries", None)
    ranges = stage_layer_ranges(model.config.num_layers, total, boundaries)
    return [
        (index, PipelineStageModule(model, ranges[index], index == 0, index == total - 1))
        for index in stages_of_rank(pp_rank, pp_size, virtual_stages)
    ]


def build_schedule(
    name: str,
    stages: list[tuple[int, PipelineStageModule]],
    num_stages: int,
    microbatches: int,
    device: torch.device,
    loss_fn: Any,
    group: Any = None,
) -> Any:
    """A ``torch.distributed.pipelining`` schedule ``name`` over this rank's ``stages`` (:func:`split_into_stages`).

    ``schedule.step(input_ids)`` on the first stage's rank, ``schedule.step(target=labels, losses=[])`` on the last
    stage's, ``schedule.step()`` elsewhere (the interleaved schedules take all three on every rank that holds those
    stages) runs forward and backward of every micro-batch. ``loss_fn(output, target)`` is one micro-batch's loss;
    the schedule backpropagates it scaled by ``1 / microbatches`` (and each stage's auxiliary losses with it), so the
    gradients are the mean's (``losses`` holds the scaled values).

    Raises:
        ValueError: an unknown schedule, several stages per rank for a single-stage schedule, or fewer micro-batches
            than pipeline ranks for 1F1B.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule ({name!r}) must be one of {tuple(SCHEDULES)}")
    if not SCHEDULES[name] and len(stages) != 1:
        raise ValueError(f"pp_schedule {name!r} runs one stage per rank; got {len(stages)} (use interleaved_1f1b)")
    pp_size = num_stages // len(stages)
    if name != "gpipe" and microbatches < pp_size:
        raise ValueError(f"pp_microbatches ({microbatches}) must be at least pp_size ({pp_size}) for {name}")
    for _, module in stages:
        module.aux_grad_scale = 1.0 / microbatches

    def mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / microbatches

    pipeline_stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in stages]
    kwargs = dict(loss_fn=mean_loss, scale_grads=False)
    if name == "gpipe":
        return ScheduleGPipe(pipeline_stages[0], microbatches, **kwargs)
    if name == "1f1b":
        return Schedule1F1B(pipeline_stages[0], microbatches, **kwargs)
    return ScheduleInterleaved1F1B(pipeline_stages, microbatches, **kwargs)
