"""A training micro-batch's forward and backward replayed as two CUDA graphs (``epso``'s ``cuda_graphs=True``).

Why: at small and medium shapes an MoE step is set by the host, not the GPU: a layer's routing, dispatch, experts and
combine launch dozens of small kernels, each costing the host a few microseconds. Captured once, the whole forward
(embedding, layers, the fused LM head + loss) and the whole backward each replay with one launch.

What makes it possible: the single-device dropless path never reads the device from the host (router counts, the
dispatch plan, the grouped GEMMs' offsets and the loss's token count stay on the device; tested on the meta device,
where every host read raises, and by CUDA's sync debug mode in ``benchmarks/gpu_check.py``), so its shapes depend on
the batch's shape alone.

How: :func:`torch.cuda.make_graphed_callables` captures :class:`_TrainingLoss` (the model's loss-only forward with
its outputs flattened to tensors) at the first training call, after its warm-up iterations on a side stream; the
model's instance ``forward`` then sends every call of the same shape with grad enabled, in training mode and with
``return_logits=False`` (what :class:`~mula_lightning.lightning_module.MulaLM` and a Fabric loop's training forward
do) through the graphs; anything else (validation, a batch of another shape, logits asked for) runs the model
eagerly. Parameter gradients leave the graph as tensors autograd accumulates eagerly, so the sharded optimizer's
post-accumulate hooks (its gradient buckets and their reductions) run as before, after the backward graph.

Limits (each refused with one warning, the run continuing eagerly): a CUDA device; one model-parallel rank (``ep_size``,
``etp_size``, ``tp_size``, ``pp_size``, ``cp_size`` of 1: expert parallelism exchanges token counts through the host,
expert tensor, tensor, pipeline and context parallelism run collectives inside the forward); dropless routing (a
capacity factor makes the number of routed rows depend on the data); no global-batch balancing (its running count of the
step's tokens lives outside a capture); no router jitter noise under activation checkpointing (its recomputation would
need the generator's state, which a capture cannot read); no module hooks on the model when the capture happens; a step
that passes the probe (one eager forward + backward under CUDA's sync debug mode, after a warm-up run) and a capture
that succeeds. Data parallelism is allowed: gradients are reduced after the backward graph (no overlap with it). Costs:
one extra copy of the parameter gradients (the graph's static outputs), and at the first step the probe's two runs and
the capture's warm-up iterations (3 forward + backward). The graphs hold the parameters' storage: replacing a parameter
tensor after the capture (not an in-place load) leaves them stale. The graphs hold one set of activations: a training
forward while an earlier replay's backward has not run yet (two micro-batches' forwards, then one backward of their sum)
runs eagerly, with one warning naming the pattern, since a replay would overwrite the activations the pending backward
reads."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from mula_lightning.models.transformer import MulaForCausalLM, MulaOutput
from mula_lightning.moe.balancing import expert_bias_routers
from mula_lightning.moe.reference import MoEAux

#: the MoEAux fields, in the order their tensors leave the graph (None fields are left out, the spec says which)
_AUX_FIELDS = ("aux_loss", "load_balance_loss", "z_loss", "tokens_per_expert", "num_dropped", "expert_bias",
               "seq_balance_loss")  # fmt: skip

#: ``(adapter, sample_args) -> graphed callable``: CUDA's capture; a test passes an eager stand-in on the CPU
Capture = Callable[[nn.Module, tuple[torch.Tensor, ...]], Callable[..., tuple[torch.Tensor, ...]]]


def graph_refusal(model: nn.Module, device: torch.device, topology: Any = None) -> str | None:
    """Why ``model``'s training step cannot be captured here (one line naming the values), or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"a CUDA device is needed (this run is on {device.type})"
    names = ("ep_size", "etp_size", "tp_size", "pp_size", "cp_size")
    sizes = {name: int(getattr(topology, name, 1) or 1) for name in names}
    parallel = {name: size for name, size in sizes.items() if size > 1}
    if parallel:
        named = ", ".join(f"{name}={size}" for name, size in parallel.items())
        return f"one model-parallel rank is needed ({named}: their collectives run inside the forward)"
    models = [m for m in model.modules() if isinstance(m, MulaForCausalLM)]
    if not models:
        return f"{type(model).__name__} holds no MulaForCausalLM"
    for m in models:
        factor = m.config.capacity_factor
        if factor is not None and m.config.num_experts > 0:
            return f"dropless routing is needed (capacity_factor={factor}: the routed rows depend on the data)"
        if m.config.num_experts > 0 and m.config.balance_scope == "global_batch":
            return "balance_scope 'global_batch' keeps a running count of the step's tokens on the host's routers"
    checkpointed = any(m.__dict__.get("_mula_checkpointed") for m in model.modules())
    for name, module in model.named_modules():
        jitter = float(getattr(module, "jitter_noise", 0.0) or 0.0)
        if jitter > 0 and checkpointed:
            return f"{name} draws router jitter noise ({jitter}) under activation checkpointing"
    return None


def _hooked_modules(model: nn.Module) -> list[str]:
    return [
        name or type(model).__name__
        for name, m in model.named_modules()
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    ]


class _TrainingLoss(nn.Module):
    """The captured callable: the model's loss-only forward, its outputs as a flat tuple of tensors (the LM loss, the
    weighted auxiliary loss, each layer's MoE statistics, and each expert-bias router's load of this forward)."""

    def __init__(self, model: MulaForCausalLM) -> None:
        super().__init__()
        self.model = model
        #: the expert-bias routers, found once (a plain list: not submodules of this wrapper; the model is final)
        self.routers = expert_bias_routers(model)
        self.aux_spec: list[tuple[str, ...]] = []  # per MoE layer, the MoEAux fields present (set by each run)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        routers = self.routers
        for router in routers:  # this forward's load alone: the caller adds it to what the step gathered so far
            router.pending_load = None
        out = type(self.model).forward(self.model, input_ids, labels=labels, return_logits=False)
        flat = [out.loss, out.aux_loss]
        self.aux_spec = []
        for aux in out.moe_aux:
            present = tuple(f for f in _AUX_FIELDS if getattr(aux, f) is not None)
            self.aux_spec.append(present)
            flat.extend(getattr(aux, f) for f in present)
        flat.extend(r.pending_load if r.pending_load is not None else torch.zeros_like(r.e_score_correction_bias)
                    for r in routers)  # fmt: skip
        return tuple(flat)


class GraphedTrainingForward:
    """Replaces a :class:`MulaForCausalLM`'s ``forward`` on the instance (its parameters and state dict unchanged):
    training calls of the captured shape replay the graphs, any other call runs the class's forward.

    Args:
        model: the model, on its CUDA device, parallelised and materialised (its parameters final).
        capture: ``(callable, sample_args) -> graphed``; default :func:`torch.cuda.make_graphed_callables`.
        warmup_iters: eager iterations before the capture (CUDA's side-stream warm-up; kernels, autotuning).
    """

    def __init__(self, model: MulaForCausalLM, capture: Capture | None = None, warmup_iters: int = 3) -> None:
        self.model = model
        self.adapter = _TrainingLoss(model)
        self._capture = capture
        self.warmup_iters = warmup_iters
        self.graphed: Callable[..., tuple[torch.Tensor, ...]] | None = None
        self.key: tuple[Any, ...] | None = None  # (shape, dtype, device) of input_ids and labels at the capture
        self.refused: str | None = None  # why the capture was given up (the model then runs eagerly)
        self.replays = 0
        self.eager_calls = 0
        #: the losses a replay returned, while its backward has not run (weak: a loss dropped unused frees it)
        self._pending: list[weakref.ref] = []
        self._warned_pending = False
        model.forward = self.__call__  # instance attribute: nn.Module.__call__ finds it before the class's

    def uninstall(self) -> None:
        """Give the model its class's forward back (the graphs are dropped)."""
        self.model.__dict__.pop("forward", None)
        self.graphed = None

    @staticmethod
    def _key(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[Any, ...]:
        return tuple((t.shape, t.dtype, t.device) for t in (input_ids, labels))

    def __call__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_reduction: str = "mean",
        return_logits: bool = True,
    ) -> MulaOutput:
        graphable = (
            labels is not None
            and not return_logits
            and loss_reduction == "mean"
            and self.model.training
            and torch.is_grad_enabled()
            and self.refused is None
        )
        if graphable and self.graphed is None:
            self._capture_now(input_ids, labels)
        if graphable and self.graphed is not None and self._backward_pending():
            graphable = False  # a replay would overwrite the activations the pending backward reads
            if not self._warned_pending:
                self._warned_pending = True
                _warn_once_pending()
        if not graphable or self.graphed is None or self._key(input_ids, labels) != self.key:
            self.eager_calls += 1
            return type(self.model).forward(self.model, input_ids, labels, loss_reduction, return_logits)
        return self._replay(input_ids, labels)

    def _capture_now(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        hooked = _hooked_modules(self.model)
        if hooked:
            self.refused = f"modules with hooks cannot be captured ({', '.join(hooked[:4])})"
            _warn(self.refused)
            return
        routers = self.adapter.routers
        kept = [r.pending_load for r in routers]  # the probe's, warm-up's and capture's forwards must not count
        if input_ids.device.type == "cuda":
            self.refused = self._probe(input_ids, labels)
            if self.refused is not None:
                for router, load in zip(routers, kept):
                    router.pending_load = load
                _warn(self.refused)
                return
        capture = self._capture or _cuda_capture(self.warmup_iters)
        autocast = torch.is_autocast_enabled(input_ids.device.type)
        context = (
            torch.autocast(
                input_ids.device.type, dtype=torch.get_autocast_dtype(input_ids.device.type), cache_enabled=False
            )  # fmt: skip
            if autocast
            else nullcontext()
        )
        try:
            with context:  # the graphs' own input tensors: copies (the caller's batch may be reused or aliased)
                self.graphed = capture(self.adapter, (input_ids.clone(), labels.clone()))
        except RuntimeError as err:
            self.refused = f"the capture failed ({str(err).splitlines()[0][:120]})"
            _warn(self.refused)
        finally:
            for router, load in zip(routers, kept):
                router.pending_load = load
        self.key = self._key(input_ids, labels)

    def _probe(self, input_ids: torch.Tensor, labels: torch.Tensor) -> str | None:
        """One eager forward + backward under CUDA's sync debug mode before the capture: a host synchronisation (a
        fallback reading group sizes, say) raises here, cleanly, instead of invalidating the capture. The gradients
        are returned, not accumulated (no optimizer hook runs)."""
        params = [p for p in self.adapter.parameters() if p.requires_grad]

        def run() -> None:
            flat = self.adapter(input_ids, labels)
            torch.autograd.grad(flat[0] + flat[1], params, allow_unused=True)

        run()  # first: lazy initialisation and kernel autotuning synchronise, legitimately, once
        torch.cuda.synchronize(input_ids.device)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        except RuntimeError as err:
            return f"the step synchronises with the host ({str(err).splitlines()[0][:120]})"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return None

    def _backward_pending(self) -> bool:
        """Whether a replay's backward has not run while a loss it returned is still alive."""
        return any(ref() is not None for ref in self._pending)

    def _replay(self, input_ids: torch.Tensor, labels: torch.Tensor) -> MulaOutput:
        routers = self.adapter.routers
        kept = [r.pending_load for r in routers]
        # the graphs' static outputs, which the next replay overwrites: copied (the copies stay in the autograd graph)
        # so that what a caller keeps of a micro-batch (its loss, its MoE statistics) stays that micro-batch's
        raw = self.graphed(input_ids, labels)
        flat = [t.clone() for t in raw]
        self.replays += 1
        graph_outputs = [t for t in raw if t.requires_grad]
        if graph_outputs:  # pending until the backward reaches the graph's outputs (or the losses are dropped)
            self._pending = [weakref.ref(flat[0]), weakref.ref(flat[1])]
            register_multi_grad_hook(graph_outputs, lambda grads: self._pending.clear(), mode="any")
        loss, aux_loss = flat[0], flat[1]
        moe_aux, i = [], 2
        for present in self.adapter.aux_spec:
            fields = {f: flat[i + j] for j, f in enumerate(present)}
            i += len(present)
            moe_aux.append(MoEAux(**fields))
        for router, before, load in zip(routers, kept, flat[i:]):
            router.pending_load = load if before is None else before + load
        return MulaOutput(logits=None, loss=loss, aux_loss=aux_loss, moe_aux=moe_aux)


def _cuda_capture(warmup_iters: int) -> Capture:
    def capture(adapter: nn.Module, sample_args: tuple[torch.Tensor, ...]) -> Callable[..., tuple[torch.Tensor, ...]]:
        # allow_unused_input: a parameter the loss does not reach (a frozen path) gets no gradient, as eagerly
        return torch.cuda.make_graphed_callables(
            adapter, sample_args, num_warmup_iters=warmup_iters, allow_unused_input=True
        )

    return capture


def _warn_once_pending() -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(
        "cuda_graphs=True: a training forward ran while the previous replay's backward had not (several forwards "
        "before one backward): it runs eagerly, as replaying would overwrite the activations that backward reads; "
        "run each micro-batch's backward before the next forward to replay every one"
    )


def _warn(reason: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(f"cuda_graphs=True: the training steps run eagerly: {reason}")


def install_cuda_graphs(module: nn.Module, device: torch.device, topology: Any = None) -> list[GraphedTrainingForward]:
    """Install :class:`GraphedTrainingForward` on every :class:`MulaForCausalLM` of ``module``; where
    :func:`graph_refusal` gives a reason, warn once with it and install nothing (the run stays eager)."""
    reason = graph_refusal(module, device, topology)
    if reason is not None:
        _warn(reason)
        return []
    return [GraphedTrainingForward(m) for m in module.modules() if isinstance(m, MulaForCausalLM)]
