"""``MoEStats``: per-layer expert load, imbalance, drops and router losses of every logged training step.

Why a callback: the numbers come for free from the forward pass (every MoE block returns a
:class:`~mula_lightning.moe.reference.MoEAux`), but turning them into global figures costs one collective, so it
runs only on the steps the Trainer logs (``log_every_n_steps``), on every rank alike.

Where the numbers come from, for any LightningModule: a module that sets ``last_moe_aux`` (a list of ``MoEAux``
of its last training micro-batch, as :class:`~mula_lightning.lightning_module.MulaLM` does) is read as it is;
otherwise the callback hooks every :class:`~mula_lightning.models.MulaForCausalLM` the module holds and keeps the
``moe_aux`` of its last training forward. A run with nothing to log (no MoE layer) gets one warning.

Per MoE layer ``i`` and logged step, over all ranks (each rank routes its own tokens; counts are summed, losses
averaged):

* ``moe/layer_{i}/imbalance``: max / mean of the (token, k) pairs per expert (1.0 = perfectly balanced);
* ``moe/layer_{i}/dropped_frac``: pairs dropped by the capacity factor / pairs routed (0 when dropless);
* ``moe/layer_{i}/load_balance_loss`` and ``moe/layer_{i}/z_loss``: the unweighted router losses;
* ``moe/layer_{i}/expert_{e}``: share of the layer's pairs that expert ``e`` received (for the report's heatmap;
  only while layers x experts <= ``max_expert_scalars``, so 64 x 240 experts do not flood a CSV);
* ``moe/layer_{i}/expert_bias_min`` and ``..._max``: the range of the layer's selection bias (auxiliary-loss-free
  balancing, only when the model has one);
* ``moe/imbalance_max`` and ``moe/dropped_frac``: the worst layer's imbalance, the overall drop fraction.

With a :class:`~lightning.pytorch.loggers.WandbLogger` it also sends, every ``wandb_every_n_steps`` steps, a
layers x experts heatmap image of the load shares and one histogram per layer (W&B is offline unless an API
key is configured; see :func:`mula_lightning.lightning_cli.default_loggers`).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from mula_lightning.models.transformer import MulaForCausalLM


class MoEStats(Callback):
    """Log expert load and router statistics of a Mula MoE run (see the module docstring for the keys).

    Args:
        max_expert_scalars: log per-expert shares as scalars only while layers x experts is at most this.
        wandb_every_n_steps: steps between W&B heatmaps / histograms (0 disables them).
    """

    def __init__(self, max_expert_scalars: int = 1024, wandb_every_n_steps: int = 100) -> None:
        super().__init__()
        self.max_expert_scalars = max_expert_scalars
        self.wandb_every_n_steps = wandb_every_n_steps
        self.last_load: torch.Tensor | None = None  # (L, E) shares of the last logged step, for inspection
        self.last_bias: torch.Tensor | None = None  # (L, E) selection biases of the last logged step, if any
        self._hooked_aux: list[Any] = []  # MoEAux of the last training forward of the hooked models
        self._handles: list[Any] = []
        self._warned = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Hook the MulaForCausalLM models of a module that does not report ``last_moe_aux`` itself."""
        if hasattr(pl_module, "last_moe_aux"):
            return
        for module in pl_module.modules():
            if isinstance(module, MulaForCausalLM):
                self._handles.append(module.register_forward_hook(self._keep_aux))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep_aux(self, module: Any, args: Any, output: Any) -> None:
        if module.training and getattr(output, "moe_aux", None):
            self._hooked_aux = [a.detach() for a in output.moe_aux]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        aux = getattr(pl_module, "last_moe_aux", None) if hasattr(pl_module, "last_moe_aux") else self._hooked_aux
        if not aux:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"MoEStats has nothing to log: {type(pl_module).__name__} sets no `last_moe_aux` and holds no "
                    "MulaForCausalLM with MoE layers"
                )
            return
        config = getattr(pl_module, "config", None)
        moe = getattr(config, "moe", None)
        with_bias = moe.uses_expert_bias if moe is not None else None  # the same on every rank, whatever it holds
        stats = self.global_stats(trainer, aux, getattr(config, "num_experts", None), pl_module.device, with_bias)
        load, imbalance, dropped_frac = stats["load"], stats["imbalance"], stats["dropped_frac"]
        self.last_load = load.cpu()
        self.last_bias = stats["expert_bias"].cpu() if "expert_bias" in stats else None
        log = dict(on_step=True, on_epoch=False, sync_dist=False)
        num_layers, num_experts = load.shape
        for i in range(num_layers):
            pl_module.log(f"moe/layer_{i}/imbalance", imbalance[i], **log)
            pl_module.log(f"moe/layer_{i}/dropped_frac", dropped_frac[i], **log)
            pl_module.log(f"moe/layer_{i}/load_balance_loss", stats["load_balance_loss"][i], **log)
            pl_module.log(f"moe/layer_{i}/z_loss", stats["z_loss"][i], **log)
            if "expert_bias" in stats:
                pl_module.log(f"moe/layer_{i}/expert_bias_min", stats["expert_bias"][i].min(), **log)
                pl_module.log(f"moe/layer_{i}/expert_bias_max", stats["expert_bias"][i].max(), **log)
            if num_layers * num_experts <= self.max_expert_scalars:
                for e in range(num_experts):
                    pl_module.log(f"moe/layer_{i}/expert_{e}", load[i, e], **log)
        pl_module.log("moe/imbalance_max", imbalance.max(), **log)
        pl_module.log("moe/dropped_frac", stats["dropped"].sum() / stats["routed"].sum().clamp(min=1), **log)
        step = trainer.global_step
        if self.wandb_every_n_steps and step % self.wandb_every_n_steps == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    self._to_wandb(logger, self.last_load, step, self.last_bias)

    @staticmethod
    def global_stats(
        trainer: Any, aux: list[Any], num_experts: int | None = None, device: Any = None, with_bias: bool | None = None
    ) -> dict[str, torch.Tensor]:
        """Sum the counts and average the losses of every layer over the ranks that ran it (one all-reduce).

        ``aux`` has one entry per MoE layer of the model; under pipeline parallelism a rank holds some layers only
        and reports ``None`` for the others (``num_experts`` and ``device`` then shape its zeros), so every rank
        all-reduces the same shape and each layer's losses are averaged over the ranks of its own stage.

        ``with_bias`` (default: whether a held layer has one) adds the routers' selection biases: every rank of a stage
        holds the same, so their mean over the ranks that ran the layer is the bias.

        Returns:
            ``tokens`` (L, E) pairs per expert (after drops), ``load`` (L, E) shares, ``imbalance`` (L,),
            ``dropped`` / ``routed`` / ``dropped_frac`` (L,), ``load_balance_loss`` and ``z_loss`` (L,), and with the
            bias ``expert_bias`` (L, E).
        """
        held = [a for a in aux if a is not None]
        experts = held[0].tokens_per_expert.numel() if held else int(num_experts)
        device = held[0].tokens_per_expert.device if held else device
        if with_bias is None:
            with_bias = any(a.expert_bias is not None for a in held)
        width = experts * (2 if with_bias else 1) + 4
        rows = [
            torch.zeros(width, device=device)
            if a is None
            else torch.cat(
                [
                    a.tokens_per_expert.float().reshape(-1),
                    torch.stack([a.num_dropped.float(), a.load_balance_loss.float(), a.z_loss.float()]),
                    *([a.expert_bias.float().reshape(-1).to(device)] if with_bias else []),
                    torch.ones(1, device=a.tokens_per_expert.device),  # this rank ran the layer
                ]
            )
            for a in aux
        ]
        packed = trainer.strategy.reduce(torch.stack(rows), reduce_op="sum")  # (L, width)
        world = packed[:, -1].clamp(min=1)  # the ranks that ran each layer
        tokens, dropped = packed[:, :experts], packed[:, experts]
        losses = packed[:, experts + 1 : experts + 3] / world.unsqueeze(1)
        kept = tokens.sum(dim=1)
        routed = kept + dropped
        mean = kept / tokens.shape[1]
        bias = {"expert_bias": packed[:, experts + 3 : -1] / world.unsqueeze(1)} if with_bias else {}
        return {
            **bias,
            "tokens": tokens,
            "load": tokens / kept.clamp(min=1).unsqueeze(1),
            "imbalance": tokens.max(dim=1).values / mean.clamp(min=1e-9),
            "dropped": dropped,
            "routed": routed,
            "dropped_frac": dropped / routed.clamp(min=1),
            "load_balance_loss": losses[:, 0],
            "z_loss": losses[:, 1],
        }

    @staticmethod
    def _heatmap(values: torch.Tensor, title: str, cmap: str) -> Any:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import wandb

        fig, ax = plt.subplots(figsize=(max(4.0, values.shape[1] * 0.25), max(2.5, values.shape[0] * 0.3)))
        image = ax.imshow(values.numpy(), aspect="auto", cmap=cmap)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(title)
        fig.colorbar(image, ax=ax)
        picture = wandb.Image(fig)
        plt.close(fig)
        return picture

    @staticmethod
    def _to_wandb(logger: WandbLogger, load: torch.Tensor, step: int, bias: torch.Tensor | None = None) -> None:
        import numpy as np
        import wandb

        entries: dict[str, Any] = {
            "moe/expert_load": MoEStats._heatmap(load, f"share of routed tokens, step {step}", "viridis"),
            "trainer/global_step": step,
        }
        if bias is not None:
            entries["moe/expert_bias"] = MoEStats._heatmap(bias, f"expert selection bias, step {step}", "coolwarm")
        edges = np.arange(load.shape[1] + 1)
        for i, row in enumerate(load.numpy()):
            entries[f"moe/layer_{i}/load_histogram"] = wandb.Histogram(np_histogram=(row, edges))
        logger.experiment.log(entries)
