"""Differential testing of training loops: a user's loop, written as a program of calls, on a strategy against one
process with DDP's gradient semantics.

Why: the sharded engines hold gradients in their own buffers and reduce them at moments they choose, so every call a
loop may make (a backward inside ``no_backward_sync`` or not, a clip, a norm query, a step, a ``zero_grad`` without a
step, a scheduler step) meets hand-written bookkeeping; each engine test checked the loop its author imagined, and
two reviews in a row found silent wrong training on loops users write (issue 71). Here a loop is data: a
:class:`LoopProgram` names a layout, a set-up order, frozen parameters, a slow rank and a sequence of calls; the same
program runs on every rank of a real strategy (Fabric, gloo, float64) and on :func:`reference_run`, one process
standing for the data-parallel ranks with plain ``torch.optim.AdamW`` and the same scheduler, and
:func:`check_program` compares every loss, every returned norm, the learning rates and every rank's full weights
after every step.

The reference's semantics are DDP's: a backward inside ``no_backward_sync`` accumulates each rank's gradient
locally; a synchronised backward adds the mean over the ranks of what each accumulated; a clip or a norm query sees
the reduced gradients; ``zero_grad`` drops everything, reduced or not (a skipped step when no step came before it).
:func:`valid_calls` keeps programs inside what DDP defines the same way on every rank: no clip, norm or step while a
rank holds gradients it has not reduced (DDP would act on unreduced, per-rank gradients), a save and load only
between steps (after a step or ``zero_grad``: checkpoints hold no gradients), no step without a
backward since the last one (torch's AdamW skips parameters without a gradient; the engines step them with zeros),
and a ``zero_grad`` between a step and the next backward (torch's step keeps the gradients, so a backward after it
adds the old step's gradient to the new one; the sharded engines' step clears them, as ``zero_grad`` would: a loop
that wants the old gradient again is not modelled).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import zlib
from typing import Any

import torch

__all__ = ["CALLS", "FREEZES", "LAYOUTS", "RELOAD_INTO", "SETUPS", "LoopProgram", "batch", "check_program",
           "first_difference", "freeze", "idle_last_expert", "loop_programs", "model_config", "optimizer_of",
           "param_groups", "reference_run", "run_program", "seeded_programs", "valid_calls"]  # fmt: skip

#: the calls of a loop program: a forward + backward of the next micro-batch (synchronised, or inside
#: ``no_backward_sync``), ``clip_gradients`` (returns the norm), a gradient-norm query, ``optimizer.step()``,
#: ``optimizer.zero_grad()``, ``scheduler.step()``, and ``fabric.save`` of the model and optimizer then ``fabric.load``
#: of them in place (between steps: no gradient held), which must change nothing, or ``save_reload``: the same save,
#: then the loop goes on in a new Fabric of the layout's :data:`RELOAD_INTO` partner (another sharding, often another
#: strategy) with a new model, optimizer and scheduler loaded from it
CALLS = ("backward", "backward_no_sync", "clip", "norm", "step", "zero_grad", "scheduler", "save_load",
         "save_reload")  # fmt: skip
#: how the model, optimizer and scheduler are set up: ``fabric.setup(model, optimizer, scheduler=...)`` with the
#: scheduler built first; ``fabric.setup(model, optimizer)`` then a scheduler of the returned optimizer; Lightning's
#: two-call set-up with the scheduler built on the user's optimizer before or after ``setup_optimizers``
SETUPS = ("setup_with_scheduler", "setup_then_scheduler", "two_call_scheduler_before", "two_call_scheduler_after")
#: layout name -> (world size, strategy, strategy options); every layout runs float64 on gloo. Pipeline parallelism
#: is not here: its loop is ``pipeline_step``, not a forward and a backward
LAYOUTS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "ddp": (2, "ddp", {}),
    "epso none": (2, "epso", dict(sharded_optimizer="none")),
    "epso dp": (2, "epso", dict(sharded_optimizer="dp")),
    "epso ep_aware": (2, "epso", dict(sharded_optimizer="ep_aware")),
    "epso ep_aware ep2": (2, "epso", dict(sharded_optimizer="ep_aware", ep_size=2)),
    "epso ep_aware tp2": (2, "epso", dict(sharded_optimizer="ep_aware", tp_size=2)),
    "epso dp ep2 dp2": (4, "epso", dict(sharded_optimizer="dp", ep_size=2)),
    "zero_topo zero3": (2, "zero_topo", dict(ranks_per_node=2, weight_size=2, grad_size=2)),
    "zero_topo 3-level": (4, "zero_topo", dict(ranks_per_node=2, ranks_per_gpu=2)),
    "zero_topo zero3 ep2": (2, "zero_topo", dict(ranks_per_node=2, weight_size=2, grad_size=2, ep_size=2)),
    # Muon with its AdamW split (the reference: MuonAdamW on one process); ``optimizer`` is not a strategy option
    "epso ep_aware muon": (2, "epso", dict(sharded_optimizer="ep_aware", optimizer="muon")),
    "epso ep_aware ep2 muon": (2, "epso", dict(sharded_optimizer="ep_aware", ep_size=2, optimizer="muon")),
    "epso dp ep2 dp2 muon": (4, "epso", dict(sharded_optimizer="dp", ep_size=2, optimizer="muon")),
    "epso ep_aware ep2 dp2 muon": (4, "epso", dict(sharded_optimizer="ep_aware", ep_size=2, optimizer="muon")),
    # context parallelism: the cp ranks of a group read one batch and hold two chunks of each sequence; folded with
    # expert parallelism over the same ranks (cp2 ep2 on 2 ranks), and beside data parallelism (cp2 ep2 dp2)
    "epso ep_aware cp2": (2, "epso", dict(sharded_optimizer="ep_aware", cp_size=2)),
    "epso dp cp2 ep2": (2, "epso", dict(sharded_optimizer="dp", cp_size=2, ep_size=2)),
    "epso ep_aware cp4": (4, "epso", dict(sharded_optimizer="ep_aware", cp_size=4)),
    "epso ep_aware cp2 ep2 dp2": (4, "epso", dict(sharded_optimizer="ep_aware", cp_size=2, ep_size=2)),
    "epso ep_aware cp2 tp2": (4, "epso", dict(sharded_optimizer="ep_aware", cp_size=2, tp_size=2)),
    "epso ep_aware cp2 tp2 sp": (
        4,
        "epso",
        dict(sharded_optimizer="ep_aware", cp_size=2, tp_size=2, sequence_parallel=True),
    ),
}
#: the layout a ``save_reload`` goes on in: the same world size and the same data ranks (rank r reads what it read),
#: another layout of the states (a checkpoint is written in single-device keys, so any layout reads it)
RELOAD_INTO = {
    "ddp": "ddp",
    "epso none": "epso ep_aware ep2",
    "epso dp": "zero_topo zero3",
    "epso ep_aware": "epso dp",
    "epso ep_aware ep2": "zero_topo zero3 ep2",
    "epso ep_aware tp2": "epso ep_aware tp2",
    "epso dp ep2 dp2": "zero_topo 3-level",
    "zero_topo zero3": "epso none",
    "zero_topo 3-level": "epso dp ep2 dp2",
    "zero_topo zero3 ep2": "epso ep_aware",
    "epso ep_aware muon": "epso ep_aware ep2 muon",
    "epso ep_aware ep2 muon": "epso ep_aware muon",
    "epso dp ep2 dp2 muon": "epso ep_aware ep2 dp2 muon",
    "epso ep_aware ep2 dp2 muon": "epso dp ep2 dp2 muon",
    "epso ep_aware cp2": "epso dp cp2 ep2",
    "epso dp cp2 ep2": "epso ep_aware cp2",
    "epso ep_aware cp4": "epso ep_aware cp4",
    "epso ep_aware cp2 ep2 dp2": "epso ep_aware cp2 ep2 dp2",
    "epso ep_aware cp2 tp2": "epso ep_aware cp2 tp2",
    "epso ep_aware cp2 tp2 sp": "epso ep_aware cp2 tp2",
}
#: parameter sets a program may freeze (name prefixes): none, the embedding (root unit), a layer's input norm under
#: its trainable attention, a whole attention, a layer's router and experts, a router alone under trainable experts,
#: one expert matrix (every expert's down projection) beside a trainable one, the final norm and the head
FREEZES: tuple[tuple[str, ...], ...] = (
    (),
    ("model.embed_tokens",),
    ("model.layers.0.input_layernorm",),
    ("model.layers.1.self_attn",),
    ("model.layers.0.mlp",),
    ("model.layers.0.mlp.gate",),
    ("model.layers.1.mlp.experts.down_proj",),
    ("model.norm", "lm_head"),
)
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.1)  # eps large: Adam sees a gradient's scale
MAX_NORM = 0.05  # small: clipping fires, so a wrong norm changes the update
V, T = 96, 8  # vocabulary, tokens per sequence (a multiple of 2 x cp for every context-parallel layout)


@dataclasses.dataclass(frozen=True)
class LoopProgram:
    """One training loop: where it runs, how it is set up, and the calls every rank makes in order.

    Attributes:
        layout: a key of :data:`LAYOUTS`.
        setup: one of :data:`SETUPS`.
        calls: the loop, names from :data:`CALLS`.
        frozen: name prefixes of parameters frozen (``requires_grad_(False)``) before set-up.
        slow_rank: a rank that sleeps before each backward and ``zero_grad`` (the others run ahead into
            reductions still in flight), or None.
        idle_expert: every router's selection bias keeps the last expert from every token (under EP its rank
            computes, reduces and steps an expert that saw nothing: zero gradients, weight decay only).
    """

    layout: str
    setup: str
    calls: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    slow_rank: int | None = None
    idle_expert: bool = False

    def to_code(self) -> str:
        """The program as a test a person can paste (the shrunk form of a failing program)."""
        return (
            "check_program(LoopProgram(\n"
            f"    layout={self.layout!r}, setup={self.setup!r}, frozen={self.frozen!r}, slow_rank={self.slow_rank!r},\n"
            f"    idle_expert={self.idle_expert!r}, calls={self.calls!r},\n))"
        )


def valid_calls(calls: tuple[str, ...]) -> bool:
    """Whether DDP defines ``calls`` the same on every rank (see the module docstring)."""
    unreduced = backward_since_step = stepped = False
    for call in calls:
        if call.startswith("backward") and stepped:
            return False
        if call == "backward_no_sync":
            unreduced = backward_since_step = True
        elif call == "backward":
            unreduced, backward_since_step = False, True
        else:
            acts_on_unreduced = call in ("clip", "norm", "step") and unreduced
            steps_nothing = call == "step" and not backward_since_step
            saves_gradients = call.startswith("save") and backward_since_step
            if acts_on_unreduced or steps_nothing or saves_gradients:
                return False
        if call in ("step", "zero_grad"):
            unreduced = backward_since_step = False
            stepped = call == "step"
    return True


def calls_of_rounds(rounds: list[tuple[Any, ...]]) -> tuple[str, ...]:
    """A loop's calls from its rounds: ``(zero_grad first, segments, step or skip, scheduler step[, 0 / 1 / 2: no
    save, a save and load in place, a save and reload into another layout])``, a segment being ``(backwards inside
    no_backward_sync, then one synchronised backward, then these norm / clip calls)``; a skipped round ends in
    ``zero_grad`` without a step. Every such loop satisfies :func:`valid_calls`."""
    calls: list[str] = []
    stepped = False  # the last round ended in a step with no zero_grad after it
    for zero_first, segments, step, scheduler, *save in rounds:
        calls += ["zero_grad"] if zero_first or stepped else []
        for no_sync, extras in segments:
            calls += ["backward_no_sync"] * no_sync + ["backward", *extras]
        calls += (["step"] if zero_first else ["step", "zero_grad"]) if step else ["zero_grad"]
        stepped = step and zero_first
        calls += ["scheduler"] if scheduler else []
        calls += [[], ["save_load"], ["save_reload"]][int(save[0])] if save else []
    return tuple(calls)


def loop_programs(layout: str) -> Any:
    """A ``hypothesis`` strategy of loop programs on ``layout``: any set-up order, frozen set and slow rank, one to
    three rounds of one to three segments (see :func:`calls_of_rounds`), an idle expert or not. Shrinking goes
    towards fewer rounds and calls, no frozen parameters, no slow rank, no idle expert and the first set-up order."""
    from hypothesis import strategies as st

    segment = st.tuples(st.integers(0, 2), st.sampled_from([(), ("norm",), ("clip",), ("norm", "clip")]))
    round_ = st.tuples(
        st.booleans(), st.lists(segment, min_size=1, max_size=3), st.booleans(), st.booleans(), st.integers(0, 2)
    )
    return st.builds(
        lambda setup, rounds, *axes: LoopProgram(layout, setup, calls_of_rounds(rounds), *axes),
        st.sampled_from(SETUPS),
        st.lists(round_, min_size=1, max_size=3),
        st.sampled_from(FREEZES),
        st.sampled_from([None, 1]),
        st.booleans(),
    )


def seeded_programs(layout: str, examples: int) -> Any:
    """A decorator for a ``@given`` test of ``layout``'s programs: ``examples`` programs drawn from a seed of the
    layout's name, no example database, no deadline (the fixed share of ``make test``; ``make fuzz`` draws fresh ones).

    Why a seed per layout: ``hypothesis``'s ``derandomize`` seeds from the test's source, so every parametrised layout
    drew the very same programs and an edit of the test's body changed which; a layout's own seed gives each layout
    other programs (more of the grammar covered per second) and keeps them when the test is edited.
    """
    from hypothesis import HealthCheck, seed, settings

    def decorate(test: Any) -> Any:
        configured = settings(
            max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )(test)
        return seed(zlib.crc32(layout.encode()))(configured)

    return decorate


def model_config() -> Any:
    """Two MoE layers of width 16, 4 experts top-2, routers with a selection bias (zero unless a program idles an
    expert): seconds per program on gloo."""
    from mula_lightning.models import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=8, num_experts=4, top_k=2, moe_impl="fast", expert_bias=True,
    )  # fmt: skip


def batch(micro: int, rank: int) -> torch.Tensor:
    """Data rank ``rank``'s token ids of micro-batch ``micro`` (its labels too)."""
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 * micro + rank))


def param_groups(named: Any) -> list[dict[str, Any]]:
    """Two groups of the trainable parameters: the norms without weight decay, everything else with it."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [
        {"params": [p for n, p in named if not n.endswith("norm.weight")]},
        {"params": [p for n, p in named if n.endswith("norm.weight")], "weight_decay": 0.0},
    ]


def optimizer_of(layout: str, named: Any) -> torch.optim.Optimizer:
    """The layout's single-device optimizer on ``named`` parameters: ``torch.optim.AdamW`` of :func:`param_groups`, or
    for a Muon layout :class:`~mula_lightning.optim.muon.MuonAdamW` with Muon on the layers' matrices and the AdamW
    half split as :func:`param_groups` splits it."""
    if LAYOUTS[layout][2].get("optimizer") != "muon":
        return torch.optim.AdamW(param_groups(named), **HP)
    from mula_lightning.optim.muon import MuonAdamW, is_muon_matrix

    named = [(n, p) for n, p in named if p.requires_grad]
    muon = [(n, p) for n, p in named if is_muon_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_muon_matrix(n, p)]
    groups = [{"params": [p for _, p in muon], "use_muon": True}, *param_groups(rest)]
    return MuonAdamW([g for g in groups if g["params"]], **HP)


def _scheduler(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> None:
    """``requires_grad_(False)`` on the parameters whose names start with one of ``prefixes``."""
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)


def idle_last_expert(model: torch.nn.Module) -> None:
    """Keep every router from choosing its last expert (a selection bias far below any score)."""
    for module in model.modules():
        if getattr(module, "has_expert_bias", False):
            with torch.no_grad():
                module.e_score_correction_bias[-1] = -1e4


def _strategy(kind: str, options: dict[str, Any]) -> Any:
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    options = {k: v for k, v in options.items() if k != "optimizer"}
    if kind == "epso":
        return FabricEPSOStrategy(bucket_numel=700, **options)  # several buckets per family
    if kind == "zero_topo":
        return FabricZeroTopoStrategy(block_size=16, **options)
    return kind


def _build(program: LoopProgram, layout: str, world_size: int) -> dict[str, Any]:
    """A Fabric of ``layout`` and the program's model, optimizer and scheduler, set up in the program's order."""
    from lightning.fabric import Fabric

    from mula_lightning.models import MulaForCausalLM, init_weights
    from mula_lightning.strategies.protocol import ShardingStrategy

    _, kind, options = LAYOUTS[layout]
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(kind, options), precision="64-true")
    fabric.launch()  # a second Fabric in the same processes (a reload) finds the process group there
    if kind == "ddp":  # materialised as the reference is, then replicated
        model = init_weights(MulaForCausalLM(model_config()), seed=0).to(torch.float64)
    else:  # the sharded strategies' documented path: built on the meta device, materialised by the strategy
        with fabric.init_module(empty_init=True):
            model = MulaForCausalLM(model_config())
    freeze(model, program.frozen)
    scheduler, held_bytes = None, 0
    if program.setup.startswith("setup_"):
        optimizer = optimizer_of(layout, model.named_parameters())
        if program.setup == "setup_with_scheduler":
            scheduler = _scheduler(optimizer)
            model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
        else:
            model, optimizer = fabric.setup(model, optimizer)
            scheduler = _scheduler(optimizer)
    else:
        model = fabric.setup_module(model)
        if kind == "zero_topo":  # sharded at setup_module, frozen parameters too: no parameter holds storage now
            held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.module.parameters()}
            held_bytes = sum(held.values())
        optimizer = optimizer_of(layout, model.module.named_parameters())
        if program.setup == "two_call_scheduler_before":
            scheduler = _scheduler(optimizer)
        optimizer = fabric.setup_optimizers(optimizer)
        if scheduler is None:
            scheduler = _scheduler(optimizer)
    if program.idle_expert:
        idle_last_expert(model)
    sampler = fabric.strategy.distributed_sampler_kwargs
    sharded = fabric.strategy if isinstance(fabric.strategy, ShardingStrategy) else None
    return dict(fabric=fabric, model=model, optimizer=optimizer, scheduler=scheduler, sharded=sharded,
                data_rank=sampler["rank"] if sampler else fabric.global_rank, held_bytes=held_bytes)  # fmt: skip


def run_program(rank: int, world_size: int, program: LoopProgram) -> dict[str, Any]:
    """Rank function of ``run_distributed_test``: run ``program`` on its layout and record what the loop sees (this
    rank's losses, the norms returned, the learning rates the optimizer holds after each scheduler step, and after
    each step the learning rates and the full weights; under ``zero_topo``'s two-call set-up, the bytes the
    parameters hold after ``setup_module``, which must be none: the module is sharded there, frozen parameters too)."""
    from mula_lightning.callbacks.model_only_checkpoint import full_state_dict

    run = _build(program, program.layout, world_size)
    record: dict[str, Any] = {"data_rank": run["data_rank"], "losses": [], "norms": [], "lrs": [], "steps": [],
                              "held_bytes": run["held_bytes"]}  # fmt: skip
    micro = 0
    # a program may step its scheduler before the optimizer's first step (a skipped first step): torch says so
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
    for call in program.calls:
        fabric, model, optimizer, scheduler = run["fabric"], run["model"], run["optimizer"], run["scheduler"]
        slow = program.slow_rank == rank and call in ("backward", "backward_no_sync", "zero_grad")
        if slow:
            time.sleep(0.02)
        if call in ("backward", "backward_no_sync"):
            x = batch(micro, run["data_rank"])
            micro += 1
            with fabric.no_backward_sync(model, enabled=call == "backward_no_sync"):
                out = model(x, labels=x)
                loss = out.loss + out.aux_loss
                fabric.backward(loss)
            record["losses"].append(loss.item())
        elif call == "clip":
            record["norms"].append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        elif call == "norm":
            if run["sharded"] is not None:
                norm = run["sharded"].global_grad_norm(optimizer)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            record["norms"].append(norm.item())
        elif call == "step":
            optimizer.step()
            weights = {k: v.detach().clone() for k, v in full_state_dict(model, fabric.strategy).items()}
            record["steps"].append(([g["lr"] for g in optimizer.param_groups], weights))
        elif call == "zero_grad":
            optimizer.zero_grad()
        elif call == "scheduler":
            scheduler.step()
            record["lrs"].append([g["lr"] for g in optimizer.param_groups])  # what the next step will use
        elif call in ("save_load", "save_reload"):
            run = _save_and_load(program, run, world_size, reload=call == "save_reload")
        else:
            raise ValueError(f"unknown call {call!r}; the calls are {CALLS}")
    return record


def _save_and_load(program: LoopProgram, run: dict[str, Any], world_size: int, reload: bool) -> dict[str, Any]:
    """``fabric.save`` of the model, optimizer and scheduler state into a fresh folder, then ``fabric.load`` of them
    in place, or (``reload``) into a new Fabric of the layout's :data:`RELOAD_INTO` partner and its new objects; the
    folder removed (every rank waits for the others at each end). Returns the objects the loop goes on with."""
    import shutil
    import tempfile

    fabric = run["fabric"]
    folder = fabric.broadcast(tempfile.mkdtemp(prefix="mula-loop-") if fabric.global_rank == 0 else None)
    path = f"{folder}/checkpoint"
    fabric.save(
        path, {"model": run["model"], "optimizer": run["optimizer"], "scheduler": run["scheduler"].state_dict()}
    )
    if reload:
        into = _build(program, RELOAD_INTO[program.layout], world_size)
        if into["data_rank"] != run["data_rank"]:
            raise ValueError(f"{RELOAD_INTO[program.layout]!r} reads other data than {program.layout!r}")
        run, fabric = into, into["fabric"]
    state = {"model": run["model"], "optimizer": run["optimizer"], "scheduler": run["scheduler"].state_dict()}
    remainder = fabric.load(path, state)
    run["scheduler"].load_state_dict(remainder.get("scheduler", state["scheduler"]))
    fabric.barrier()
    if fabric.global_rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return run


def reference_run(program: LoopProgram, data_ranks: int, loss_scale: float = 1.0) -> dict[str, Any]:
    """``program`` in one process standing for ``data_ranks`` DDP ranks (float64, ``torch.optim.AdamW``): per
    backward each rank's loss, the norms returned, and after each step the learning rates and the weights.
    ``loss_scale`` multiplies each loss before its backward (the Trainer divides by the accumulation)."""
    from mula_lightning.models import MulaForCausalLM, init_weights

    model = init_weights(MulaForCausalLM(model_config()), seed=0).to(torch.float64)
    freeze(model, program.frozen)
    if program.idle_expert:
        idle_last_expert(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_of(program.layout, model.named_parameters())
    scheduler = _scheduler(optimizer)
    reduced = [torch.zeros_like(p) for p in params]
    local = [[torch.zeros_like(p) for p in params] for _ in range(data_ranks)]
    record: dict[str, Any] = {"losses": [], "norms": [], "lrs": [], "steps": []}
    micro = 0
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
    for call in program.calls:
        if call in ("backward", "backward_no_sync"):
            losses = []
            for r in range(data_ranks):
                x = batch(micro, r)
                out = model(x, labels=x)
                loss = out.loss + out.aux_loss
                for acc, g in zip(local[r], torch.autograd.grad(loss * loss_scale, params)):
                    acc.add_(g)
                losses.append(loss.item())
            micro += 1
            record["losses"].append(losses)
            if call == "backward":  # DDP all-reduces what each rank accumulated: the mean over the ranks
                for i, acc in enumerate(reduced):
                    acc.add_(sum(local[r][i] for r in range(data_ranks)) / data_ranks)
                    for r in range(data_ranks):
                        local[r][i].zero_()
        elif call in ("clip", "norm"):
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reduced]))
            record["norms"].append(norm.item())
            if call == "clip":
                scale = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)
                for g in reduced:
                    g.mul_(scale)
        elif call == "step":
            for p, g in zip(params, reduced):
                p.grad = g.clone()
            optimizer.step()
            optimizer.zero_grad()
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            record["steps"].append(([g["lr"] for g in optimizer.param_groups], weights))
            for g in reduced:
                g.zero_()
        elif call == "zero_grad":
            for g in [*reduced, *(t for acc in local for t in acc)]:
                g.zero_()
        elif call == "scheduler":
            scheduler.step()
            record["lrs"].append([g["lr"] for g in optimizer.param_groups])
    return record


#: relative tolerances: norms and weights are float64 end to end (a wrong reduction is off by O(1)); the losses come
#: back through Fabric's 64-true output conversion, in the default dtype (float32)
RTOL = {"losses": 1e-6, "norms": 1e-12, "weights": 1e-12}


def check_program(program: LoopProgram, timeout: float = 180) -> None:
    """Run ``program`` on its layout and on :func:`reference_run`; raise an ``AssertionError`` that prints the
    program as code and names the first quantity that differs (call index, rank, tensor)."""
    from mula_lightning.testing.distributed import run_pooled_test

    if not valid_calls(program.calls):
        raise ValueError(f"DDP does not define these calls the same on every rank: {program.calls}")
    world = LAYOUTS[program.layout][0]
    results = run_pooled_test(run_program, world, program=program, timeout=timeout)
    reference = reference_run(program, max(r["data_rank"] for r in results) + 1)
    for rank, got in enumerate(results):
        problem = first_difference(got, reference, rank)
        if problem:
            raise AssertionError(f"{problem}\nthe program:\n{program.to_code()}")


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1.0)


def first_difference(got: dict[str, Any], reference: dict[str, Any], rank: int) -> str | None:
    """The first quantity in which ``rank``'s record differs from the reference's, named (the call's index, the
    tensor), or None when everything agrees (see :data:`RTOL`)."""
    if got.get("held_bytes"):
        return f"rank {rank}: parameters hold {got['held_bytes']} bytes after zero_topo's setup_module (not sharded)"
    for i, (loss, losses) in enumerate(zip(got["losses"], reference["losses"])):
        want = losses[got["data_rank"]]
        if not _close(loss, want, RTOL["losses"]):
            return f"rank {rank}: loss of backward {i} is {loss!r}, one process has {want!r}"
    for i, (norm, want) in enumerate(zip(got["norms"], reference["norms"])):
        if not _close(norm, want, RTOL["norms"]):
            return f"rank {rank}: norm {i} (clip or norm call) is {norm!r}, one process has {want!r}"
    for i, (lrs, want) in enumerate(zip(got["lrs"], reference["lrs"])):
        if any(not _close(a, b, 1e-15) for a, b in zip(lrs, want, strict=True)):
            return f"rank {rank}: learning rates after scheduler step {i} are {lrs}, one process has {want}"
    if len(got["steps"]) != len(reference["steps"]):
        return f"rank {rank}: {len(got['steps'])} steps recorded, one process {len(reference['steps'])}"
    for i, ((lrs, weights), (want_lrs, want_weights)) in enumerate(zip(got["steps"], reference["steps"])):
        if any(not _close(a, b, 1e-15) for a, b in zip(lrs, want_lrs, strict=True)):
            return f"rank {rank}: learning rates after step {i} are {lrs}, one process has {want_lrs}"
        for name, want in want_weights.items():
            value = weights[name].to(want.dtype)
            scale = max(want.abs().max().item(), 1.0)
            diff = (value - want).abs().max().item()
            if not diff <= RTOL["weights"] * scale:
                return f"rank {rank}: {name} after step {i} differs from one process's by {diff:.3g} (of {scale:.3g})"
    return None
