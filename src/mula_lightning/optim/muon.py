"""Muon for the hidden layers' matrices, AdamW for the rest: the optimizer Moonlight and Kimi K2 train MoE models with.

Why: Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", arXiv 2502.16982) orthogonalises each weight
matrix's momentum with a few Newton-Schulz iterations before applying it; Moonlight reports about twice AdamW's
compute efficiency. ``torch.optim.Muon`` takes 2-D parameters only and knows nothing of the AdamW it must be paired
with; an MoE model's experts are 3-D tensors (one matrix per expert). This module is the single-device math, shared
by :class:`MuonAdamW` (one device, ``ddp``) and the sharded Muon of ``epso``
(:mod:`mula_lightning.parallel.sharded_muon`), so the update exists once.

The split (:func:`muon_param_groups`, :func:`is_muon_matrix`):

* **Muon**: every matrix of the decoder layers: attention projections, dense MLPs, shared experts, and each expert's
  matrices as separate 2-D matrices (the stored ones: ``gate_up_proj[e]`` is one ``2I x H`` matrix, as transformers
  stores it), orthogonalised batched (one ``bmm`` per shape, not a loop over experts);
* **AdamW**: the embeddings and the LM head, norms, biases, the routers and any "matrix" with a side of 1 (a gate
  vector such as ``shared_expert_gate``).

Semantics are ``torch.optim.Muon``'s: momentum 0.95 with Nesterov (``buf = lerp(buf, g, 1 - mu)``, update
``lerp(g, buf, mu)``), 5 Newton-Schulz steps with its coefficients on the update scaled to unit Frobenius norm,
decoupled weight decay ``p *= 1 - lr * wd``, and the learning rate adjusted per matrix shape; the default
``adjust_lr_fn="match_rms_adamw"`` (``0.2 * sqrt(max(A, B))``, Moonlight's) lets one ``lr`` and ``weight_decay``
serve both halves. The iteration runs in bfloat16 as torch's does, except for float64 parameters (the exact parity
checks), which iterate in float64. The momentum is kept in float32 (float64 for float64 parameters): one state per
element, half of AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mula_lightning.optim.adamw import adamw_update_pieces_
from mula_lightning.utils.precision import at_least_float32

__all__ = [
    "MUON_DEFAULTS",
    "MuonAdamW",
    "adjusted_lr",
    "is_muon_matrix",
    "muon_param_groups",
    "muon_update_",
    "newton_schulz",
    "newton_schulz_flops",
]

#: torch.optim.Muon's coefficients and epsilon (Keller Jordan's quintic iteration)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")

#: the Muon hyper-parameters of a param group, with their defaults (``lr`` and ``weight_decay`` are shared)
MUON_DEFAULTS: dict[str, Any] = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_coefficients": NS_COEFFICIENTS,
    "ns_eps": NS_EPS,
    "adjust_lr_fn": "match_rms_adamw",
}


def newton_schulz(
    update: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The approximate orthogonalisation ``U S' V^T`` of each matrix of ``update`` (``(..., A, B)``; leading dims are a
    batch, iterated with ``bmm``), as ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` computes it for one.

    Args:
        dtype: the iteration's dtype (``None``: bfloat16, as torch's, or float64 for a float64 input).
    """
    if update.ndim < 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices; got a tensor of shape {tuple(update.shape)}")
    a, b, c = coefficients
    if dtype is None:
        dtype = torch.float64 if update.dtype == torch.float64 else torch.bfloat16
    x = update.to(dtype, copy=True)
    tall = update.size(-2) > update.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller side squared
        x = x.mT
    batch = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    x = x.reshape(*batch, *x.shape[-2:])
    return x.mT if tall else x


def newton_schulz_flops(shape: Iterable[int], steps: int = 5) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`newton_schulz` on a ``(..., A, B)`` tensor: per step and
    matrix, the Gram matrix ``m x m`` over ``n``, its square ``m^3`` and the update ``m x n`` over ``m``
    (``m = min(A, B)``, ``n = max(A, B)``). Also the cost the sharded Muon balances owners by."""
    *batch, rows, cols = tuple(shape)
    m, n = min(rows, cols), max(rows, cols)
    return 2 * math.prod(batch) * steps * (2 * m * m * n + m**3)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Iterable[int]) -> float:
    """The learning rate of one matrix of ``shape`` (its last two dims ``A x B``: out x in), as torch's Muon adjusts
    it: ``"original"`` ``sqrt(max(1, A / B))``, ``"match_rms_adamw"`` ``0.2 * sqrt(max(A, B))``,
    ``"spectral_unclamped"`` ``sqrt(A / B)``."""
    rows, cols = tuple(shape)[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")


@torch.no_grad()
def muon_update_(
    params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor], group: dict[str, Any]
) -> None:
    """One Muon step of ``group``'s hyper-parameters on matrices (2-D) and batches of matrices (3-D: experts), in
    place: momenta and weights updated, the Newton-Schulz iteration batched over every matrix of one shape.

    ``grads`` may be of another dtype than the momenta (a float32 gradient buffer of bf16 weights: the weights are
    then float32 master copies the caller passes instead).
    """
    lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
    updates: list[torch.Tensor] = []
    for grad, buf in zip(grads, momenta):
        grad = grad if grad.dtype == buf.dtype else grad.to(buf.dtype)
        buf.lerp_(grad, 1 - mu)
        updates.append(grad.lerp(buf, mu) if group["nesterov"] else buf)
    by_shape: dict[tuple[tuple[int, int], torch.dtype, torch.device], list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault((tuple(u.shape[-2:]), u.dtype, u.device), []).append(i)
    for (shape, _, _), indices in by_shape.items():
        stacked = (
            torch.cat([updates[i].reshape(-1, *shape) for i in indices])
            if len(indices) > 1
            else updates[indices[0]].reshape(-1, *shape)
        )
        ortho = newton_schulz(stacked, group["ns_steps"], tuple(group["ns_coefficients"]), group["ns_eps"])
        step_lr = adjusted_lr(lr, group["adjust_lr_fn"], shape)
        offset = 0
        for i in indices:
            p = params[i]
            count = p.numel() // (shape[0] * shape[1])
            p.mul_(1 - lr * wd)
            p.add_(ortho[offset : offset + count].reshape(p.shape).to(p.dtype), alpha=-step_lr)
            offset += count


def _is_sharded(param: Any) -> bool:
    """A DTensor sharded over its mesh (FSDP2's and tensor parallelism's parameters)."""
    return hasattr(param, "placements") and any(p.is_shard() for p in param.placements)


def is_muon_matrix(name: str, param: torch.Tensor, routers: set[int] | None = None) -> bool:
    """Whether Muon trains ``param`` (see the module docstring): a matrix (or a batch of expert matrices) of a decoder
    layer with both sides longer than 1, not a router's weight (``routers``: ids of router parameters; without it,
    the names ``...mlp.gate.weight`` and ``...shared_expert_gate.weight``)."""
    if param.ndim < 2 or ".layers." not in f".{name}" or min(param.shape[-2:]) <= 1:
        return False
    if routers is not None:
        return id(param) not in routers
    return not (name.endswith("mlp.gate.weight") or "shared_expert_gate" in name)


def router_param_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters of the model's routers (:class:`~mula_lightning.moe.router.Router` modules)."""
    from mula_lightning.moe.router import Router

    return {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters(recurse=False)}


def muon_param_groups(model: nn.Module, **muon_hyper: Any) -> list[dict[str, Any]]:
    """``[{"params": Muon's matrices, "use_muon": True, **muon_hyper}, {"params": the rest, "use_muon": False}]`` of
    ``model``'s trainable parameters (empty groups left out): the split of the module docstring. Build another list
    to override it (any group with ``use_muon`` set)."""
    routers = router_param_ids(model)
    muon, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if is_muon_matrix(name, p, routers) else rest).append(p)
    groups = [{"params": muon, "use_muon": True, **muon_hyper}, {"params": rest, "use_muon": False}]
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, two updates: Muon for the groups with ``use_muon=True``, AdamW for the others.

    One optimizer object, so Lightning's loop, one LR scheduler (it scales every group's ``lr``), gradient clipping
    and checkpoints see one thing; ``epso`` replaces it by its sharded form with the same groups.

    Args:
        params: param groups, each with ``use_muon`` (:func:`muon_param_groups` builds them); a plain list of
            tensors is split by dimension (2-D and up: Muon).
        lr, weight_decay: shared by both updates (``adjust_lr_fn="match_rms_adamw"`` makes that sound).
        betas, eps: AdamW's.
        momentum, nesterov, ns_steps, ns_coefficients, ns_eps, adjust_lr_fn: Muon's (torch.optim.Muon's meaning).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        adjust_lr_fn: str | None = "match_rms_adamw",
    ) -> None:
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum ({momentum}) must be in [0, 1)")
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [
                {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
                {"params": [p for p in params if p.ndim < 2], "use_muon": False},
            ]
            params = [g for g in params if g["params"]]
        defaults = dict(
            lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_eps=ns_eps, adjust_lr_fn=adjust_lr_fn,
            use_muon=False,
        )  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            flat = [p for p in group["params"] if group["use_muon"] and p.ndim < 2]
            if flat:
                raise ValueError(
                    f"Muon trains matrices: a group with use_muon=True holds a tensor of shape {tuple(flat[0].shape)}"
                )
            sharded = [p for p in group["params"] if group["use_muon"] and _is_sharded(p)]
            if sharded:
                raise ValueError(
                    f"Muon needs whole matrices: a matrix of shape {tuple(sharded[0].shape)} is sharded over ranks "
                    f"(placements {tuple(sharded[0].placements)}: FSDP or tensor parallelism); use strategy 'epso', "
                    "which gives each matrix to one rank whole"
                )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                momenta = []
                for p in live:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, dtype=at_least_float32(p.dtype))
                    momenta.append(state["momentum_buffer"])
                muon_update_(live, [p.grad for p in live], momenta, group)
            else:
                self._adamw_step(live, group)
        return loss

    def _adamw_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch's AdamW on ``params`` (its fused kernel where the device has one): per-parameter step counts."""
        by_step: dict[int, list[Any]] = {}
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["step"] += 1
            pieces = (p.view(-1), p.grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), 0)
            by_step.setdefault(int(state["step"].item()), []).append(pieces)
        for step, pieces in by_step.items():
            adamw_update_pieces_(pieces, [group], step)
