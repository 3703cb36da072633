"""Where a training step's time goes, by part of the model and of the loop: a table of shares from one profiled step.

Used by ``benchmarks/train.py --profile`` for every contender (``MulaLM`` and transformers' ``OlmoeForCausalLM``
alike: both name their modules as transformers does). How a microsecond is attributed:

* **forward, per part**: forward pre / post hooks open and close a ``record_function("part::<part>")`` range around
  the modules of each part (``embed_tokens`` -> embedding, ``self_attn`` -> attention, the layer norms, ``mlp.gate``
  -> router, ``mlp.experts`` -> experts, shared experts, ``lm_head``); an MoE block's own time outside its router and
  experts is its dispatch and combine (Mula's block runs through ``forward_with_aux``, wrapped the same way), the
  top model's own time outside its layers is residual adds and the loss over the vocabulary; Mula's fused LM head +
  loss (``linear_cross_entropy``, whose forward runs the head's backward GEMMs too) is its own part, by its
  ``mula::linear_cross_entropy`` range;
* **backward, per part**: each autograd node's ``evaluate_function`` event carries the sequence number of the
  forward op that created it; the forward op's part names the backward one (``MmBackward0`` of an expert GEMM is
  "experts"). ``AccumulateGrad`` (where the sharded optimizer's gradient hooks run) is its own row;
* **collectives**: every ``c10d`` / gloo / NCCL event, wherever it runs (inside a gradient hook, the optimizer step,
  a loss all-reduce): its own row;
* **optimizer step**: torch's ``Optimizer.step#...`` range (torch's AdamW and the project's ``ShardedAdamW``) outside
  the closure (Lightning runs ``training_step`` and ``backward`` inside ``optimizer.step(closure)``, so its closure's
  own code lands here too); the sharded optimizer's own ranges split off its AdamW update (``mula::adamw_update``),
  its wait for the gradient reduce-scatters (``mula::gradient_sync``) and its weight all-gather
  (``mula::weight_all_gather``): waiting on a collective is no event of its own, so without them the wait
  would read as update time (as DDP's waits for its all-reduces read as "backward: outside autograd nodes");
* **LightningModule step**: ``training_step`` outside the model (losses summed, logging), and ``backward`` outside the
  autograd nodes;
* **outside**: the rest of the step's wall time: Lightning's loop, hooks and callbacks, the data loader, and Python
  between them.

Each event's *self* time counts once, in the first labelled range met walking up from it. The profiler adds a
per-op cost (a few microseconds), so shares are what to read, not absolute times; on a GPU the CPU-side times of
asynchronous kernels are launch times (use a CUDA activity trace there).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

#: (module-name pattern, part) in the order tried: the first match labels the module
PARTS = (
    (re.compile(r"(^|\.)embed_tokens$"), "embedding"),
    (re.compile(r"\.self_attn$"), "attention"),
    (re.compile(r"(layernorm|(^|\.)norm)$"), "norms"),
    (re.compile(r"\.mlp\.gate$"), "router"),
    (re.compile(r"\.mlp\.experts$"), "experts"),
    (re.compile(r"\.mlp\.shared_experts?$"), "shared experts"),
    (re.compile(r"\.mlp$"), "mlp"),  # an MoE block (its own time: dispatch + combine) or a dense MLP
    (re.compile(r"(^|\.)lm_head$"), "LM head"),
)
#: the fused LM head + loss's own range (:data:`mula_lightning.models.linear_cross_entropy.PROFILER_RANGE`): the head's
#: three GEMMs and the loss run in its forward, so it is a part of its own rather than "model: residuals + loss"
FUSED_HEAD_LOSS = ("mula::linear_cross_entropy", "LM head + loss (fused: its backward GEMMs run in the forward)")
COLLECTIVE = re.compile(r"c10d::|^gloo:|^nccl:|record_param_comms|ProcessGroup")
EVALUATE = "autograd::engine::evaluate_function: "


def _part_of(name: str, module: torch.nn.Module) -> str | None:
    for pattern, part in PARTS:
        if pattern.search(name):
            if part == "mlp":
                return "MoE dispatch + combine" if hasattr(module, "experts") else "dense MLP"
            return part
    return None


def _ranged(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapped


def label_parts(model: torch.nn.Module, lightning_module: Any | None = None) -> None:
    """Put a ``record_function`` range around every labelled module's forward (see :data:`PARTS`), the top model's
    forward ("model: residuals + loss"), and the LightningModule's ``training_step`` and ``backward``."""
    stack: list[Any] = []

    def enter(label: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            rf = record_function(label)
            rf.__enter__()
            stack.append(rf)

        return hook

    def leave(*_: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        part = "model: residuals + loss" if module is model else _part_of(name, module)
        if part is None:
            continue
        if hasattr(module, "forward_with_aux"):  # Mula's MoE block: the layer calls this, not __call__
            module.forward_with_aux = _ranged(f"part::{part}", module.forward_with_aux)
            continue
        module.register_forward_pre_hook(enter(f"part::{part}"))
        module.register_forward_hook(leave)
    if lightning_module is not None:
        lightning_module.training_step = _ranged("step::training_step", lightning_module.training_step)
        lightning_module.backward = _ranged("step::backward", lightning_module.backward)


def _category(event: Any, forward_part: dict[int, str]) -> str | None:
    node = event
    while node is not None:
        name = node.name
        if COLLECTIVE.search(name):
            return "collectives"
        if name.startswith(EVALUATE):
            if "AccumulateGrad" in name:
                return "backward: AccumulateGrad (gradient hooks)"
            return f"backward: {forward_part.get(node.sequence_nr, 'other')}"
        if name.startswith("part::"):
            return f"forward: {name[6:]}"
        if name == FUSED_HEAD_LOSS[0]:
            return f"forward: {FUSED_HEAD_LOSS[1]}"
        if name == "mula::gradient_sync":  # the sharded optimizer waiting for its reduce-scatters
            return "gradient sync (waits for the reduce-scatters)"
        if name == "mula::weight_all_gather":
            return "weight all-gather (sharded optimizer)"
        if name == "mula::adamw_update":
            return "optimizer: AdamW update of the owned shard"
        if name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad"):
            return "optimizer step (torch's AdamW; sharded: zero_grad, Lightning's closure outside the model)"
        if name == "step::training_step":
            return "LightningModule training_step (outside the model)"
        if name == "step::backward":
            return "backward: outside autograd nodes (DDP: waits for its all-reduces)"
        node = node.cpu_parent
    return None


def _forward_parts(events: list[Any]) -> dict[int, str]:
    """Sequence number of each autograd node -> the part whose range the forward op that made it ran in.

    An op records the sequence counter as it finds it; only an op that creates a node advances it. So ops run without
    a node before it (index arithmetic under ``no_grad``, say) share the number of the next node made, and the op that
    made the node is the *last* forward event carrying that number (a custom autograd Function's own event, after the
    dispatch arithmetic that preceded it).
    """
    latest: dict[int, tuple[float, str]] = {}
    for e in events:
        if e.sequence_nr < 0 or e.name.startswith(EVALUATE):
            continue
        node, part = e.cpu_parent, None
        while node is not None:
            if node.name.startswith(EVALUATE):
                part = None  # an op run by the backward itself
                break
            if part is None and node.name.startswith("part::"):
                part = node.name[6:]
            if part is None and node.name == FUSED_HEAD_LOSS[0]:
                part = FUSED_HEAD_LOSS[1]
            node = node.cpu_parent
        else:
            start = e.time_range.start
            if e.sequence_nr not in latest or start >= latest[e.sequence_nr][0]:
                latest[e.sequence_nr] = (start, part or "model: residuals + loss")
    return {seq: part for seq, (_, part) in latest.items()}


def shares(profiler: Any, wall_us: float) -> dict[str, float]:
    """Microseconds per category of the profiled window (``wall_us`` long); "outside" takes what no range holds."""
    events = list(profiler.events())
    forward_part = _forward_parts(events)
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        category = _category(e, forward_part)
        if category is not None:
            totals[category] += e.self_cpu_time_total
    totals["outside (Lightning loop, hooks, callbacks, data)"] = max(0.0, wall_us - sum(totals.values()))
    return dict(totals)


def table(results: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per category, one column of shares per contender (most expensive first)."""
    names = list(results)
    categories = sorted(
        {c for r in results.values() for c in r}, key=lambda c: -max(r.get(c, 0) for r in results.values())
    )
    lines = ["| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in categories:
        cells = []
        for n in names:
            total = sum(results[n].values())
            cells.append(f"{100 * results[n].get(c, 0.0) / total:.1f}%" if total else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| step (ms, profiled) | " + " | ".join(f"{sum(results[n].values()) / 1e3:.0f}" for n in names) + " |")
    return "\n".join(lines)
