"""``MulaLM``: the LightningModule that pretrains a Mula model (the Aurora paper's Section 2.1 recipe).

What it owns, and why each piece is here rather than elsewhere:

* **Model construction** in :meth:`MulaLM.configure_model`. Under the ``epso`` strategy the model is built on
  the meta device (no memory, even for the 220B preset) and the strategy materialises, expert-shards and
  broadcasts it from ``(seed, parameter name)``. Under any other strategy (``ddp``, one device, ...) this module
  materialises it itself with :func:`~mula_lightning.models.init_weights` and the same seed, so both start
  bit-identical.
* **Starting weights**: drawn from ``seed`` (every layout starts from the same model), or read from ``init_from``
  (a model-only checkpoint, an upcycled model, a DualCheckpoint slot or a transformers directory: see
  :mod:`mula_lightning.checkpoint.init_source`), with a fresh optimizer and schedule. The config then comes from
  the source; ``model_overrides`` may change what does not change a shape (``moe_impl``, ``capacity_factor``, ...).
* **Vocabulary** from the data (:meth:`resolve_vocab`, run in :meth:`setup` before ``configure_model``, and by
  ``mula fit`` before any process starts): a preset named without ``vocab_size`` takes the prepared dataset's
  vocabulary; a vocabulary the user fixed (``vocab_size``, ``model_overrides``, a ``MulaConfig`` or the
  ``init_from`` model) is kept and must cover the data's ids, else a ``ValueError`` names both sizes and the fix:
  never a silent resize. A DataModule given a ``tokenizer`` refuses data prepared with another one.
* **The recipe**: AdamW (peak 4e-4, betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on all parameters), linear
  warm-up for 2500 steps, cosine decay to 4e-5, gradient clipping at 1.0 only after the warm-up. Clipping goes
  through :meth:`configure_gradient_clipping` -> :meth:`clip_gradients`, i.e. through the precision plugin the
  strategy controls, so the sharded strategies clip their sharded gradients by the global norm.
* **Metrics**: training loss = LM loss + weighted MoE auxiliary losses; validation loss is the mean over real
  tokens (validation padding rows carry labels -100), all-reduced over ranks by torchmetrics, and perplexity
  is its exponential. ``flops_per_batch`` (model FLOPs from the active parameter count) feeds the throughput
  callback's MFU, which is logged only when ``peak_tflops`` is given.

The module deliberately does not override ``on_before_batch_transfer``: :class:`MulaDataModule` counts consumed
training samples there for exact resume.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import MeanMetric

from mula_lightning.checkpoint.export import CHECKPOINT_KEY
from mula_lightning.checkpoint.init_source import InitWeights, init_source_config
from mula_lightning.lr_schedule import LRSchedule, ScheduledLR
from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.moe.balance_scope import enable_global_batch_balance, reset_balance_window
from mula_lightning.moe.balancing import install_expert_bias_update
from mula_lightning.moe.reference import MoEAux
from mula_lightning.optim import OPTIMIZERS
from mula_lightning.optim.adamw import FUSED_ADAMW_DEVICES
from mula_lightning.optim.muon import MuonAdamW, muon_param_groups
from mula_lightning.parallel.topology import check_divisible
from mula_lightning.strategies.protocol import (
    ShardingStrategy,
    strategy_cp_size,
    strategy_ep_size,
    strategy_pipeline,
    strategy_tensor_parallel,
)


def single_device_adamw(params: Any, **hyper: Any) -> torch.optim.AdamW:
    """torch's AdamW, through its fused kernel (one pass per parameter group: ``torch._fused_adamw_``) where every
    parameter lives on a device that has one (``FUSED_ADAMW_DEVICES``, the list the sharded optimizers use), else
    torch's default implementation.

    Why: on one device, under ``ddp`` and in ``benchmarks/model_step.py`` the update is torch's own; its default on
    CPU is a loop of several elementwise passes per parameter. Parameters on the meta device (the sharded strategies
    build the model there and replace this optimizer by their own sharded AdamW) take the default, which accepts them.
    """
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = bool(tensors) and all(t.device.type in FUSED_ADAMW_DEVICES and t.is_floating_point() for t in tensors)
    return torch.optim.AdamW(params, fused=fused or None, **hyper)


def check_layout(config: MulaConfig, strategy: Any, processes: int, seq_len: int | None = None) -> None:
    """Raise a ``ValueError`` naming the values when the strategy's layout does not fit the model or the processes:
    ``ep_size`` (an MoE model, dividing its experts and the processes), ``tp_size`` (dividing the processes, the
    attention and key/value heads, a dense MLP's intermediate size and the vocabulary; an untied LM head), both
    folded over the same ranks, under sequence parallelism the data's sequence length, ``pp_size`` (dividing the
    processes, its stages x virtual stages the layers; untied embeddings) and ``cp_size`` (dividing the processes
    beside ``tp_size``, its ``2 x cp_size`` chunks the data's sequence length; routers balancing per micro-batch)."""
    ep_size = strategy_ep_size(strategy)
    cp_size = strategy_cp_size(strategy)
    if cp_size > 1:
        _check_context_parallel(config, strategy, processes, cp_size, seq_len)
    tp_size, sequence_parallel, etp_size = strategy_tensor_parallel(strategy)
    pipeline = strategy_pipeline(strategy)
    pp_size = pipeline["pp_size"]
    if pp_size > 1:
        from mula_lightning.parallel.mesh import ParallelDims
        from mula_lightning.parallel.pipeline import stage_layer_ranges

        check_divisible(processes, pp_size, "the number of processes (devices x nodes)", "pp_size")
        ParallelDims(processes, pp=pp_size, tp=tp_size, ep=ep_size, etp=etp_size)  # the stage's ranks fold ep x etp
        stages, boundaries = pp_size * pipeline["pp_virtual_stages"], pipeline["pp_boundaries"]
        if boundaries == "params":  # any cut into contiguous stages will do, as long as there are enough layers
            boundaries = list(range(1, stages)) if config.num_layers >= stages else None
        stage_layer_ranges(config.num_layers, stages, boundaries)  # layers that do not cut into the stages, named
        if config.tie_word_embeddings:
            raise ValueError(
                f"pipeline parallelism (pp_size {pp_size}) puts the embedding on the first stage and the LM head on "
                f"the last: {config.name} ties them (tie_word_embeddings=True)"
            )
    if ep_size > 1:
        if not config.is_moe:
            raise ValueError(f"ep_size ({ep_size}) > 1 needs an MoE model; {config.name} is dense")
        check_divisible(config.num_experts, ep_size, f"num_experts of {config.name}", "ep_size")
        check_divisible(processes, ep_size, "the number of processes (devices x nodes)", "ep_size")
    if etp_size > 1:
        if not config.is_moe:
            raise ValueError(f"etp_size ({etp_size}) > 1 needs an MoE model; {config.name} is dense")
        if config.moe_impl != "fast":
            raise ValueError(
                f"etp_size ({etp_size}) > 1 needs moe_impl='fast' (FastSparseMoEBlock), not {config.moe_impl!r}"
            )
        check_divisible(
            config.intermediate_size, etp_size, f"the experts' intermediate_size of {config.name}", "etp_size"
        )
    if tp_size > 1 or etp_size > 1:
        from mula_lightning.parallel.mesh import ParallelDims
        from mula_lightning.parallel.tensor_parallel import check_tensor_parallel

        check_divisible(processes, tp_size, "the number of processes (devices x nodes)", "tp_size")
        ParallelDims(processes, tp=tp_size, ep=ep_size, etp=etp_size)  # the folded sizes cover the ranks
        check_tensor_parallel(config, tp_size)
        if sequence_parallel and seq_len is not None and seq_len % tp_size:
            raise ValueError(
                f"sequence_parallel splits each sequence over tp_size ({tp_size}) ranks: the data's seq_len "
                f"({seq_len}) must be divisible by it"
            )


def _check_context_parallel(config: MulaConfig, strategy: Any, processes: int, cp: int, seq_len: int | None) -> None:
    from mula_lightning.parallel.context_parallel import check_sequence_length
    from mula_lightning.parallel.mesh import ParallelDims

    tp_size, sequence_parallel, etp_size = strategy_tensor_parallel(strategy)
    pp = strategy_pipeline(strategy)["pp_size"]
    ParallelDims(processes, pp=pp, tp=tp_size, cp=cp, ep=strategy_ep_size(strategy), etp=etp_size)  # they divide
    if seq_len is not None:
        check_sequence_length(seq_len, cp)
        if sequence_parallel and seq_len // cp % tp_size:
            raise ValueError(
                f"sequence_parallel splits each rank's {seq_len // cp} tokens (seq_len {seq_len} / cp_size {cp}) "
                f"over tp_size ({tp_size}) ranks: use a seq_len that is a multiple of 2 x cp x tp = "
                f"{2 * cp * tp_size}"
            )
    if config.is_moe and config.balance_scope != "micro_batch":
        raise ValueError(
            f"cp_size ({cp}) > 1 cuts every sequence over ranks: balance_scope {config.balance_scope!r} would "
            "count each rank's chunks only; use balance_scope 'micro_batch'"
        )


class MulaLM(LightningModule):
    """Pretrain a Mula decoder with AdamW, warm-up + cosine schedule and MoE auxiliary losses.

    Args:
        model: preset name (``mula models`` lists them), e.g. ``"mula-7b-a1b"`` or ``"mula-tiny-moe"``, or a
            :class:`~mula_lightning.models.MulaConfig` (in YAML: a mapping of its fields), e.g. from
            ``MulaConfig.from_hf_config``.
        model_overrides: :class:`~mula_lightning.models.MulaConfig` fields to change, e.g.
            ``{"capacity_factor": 1.25, "num_layers": 2}``; unknown names are refused.
        vocab_size: embedding rows; ``None`` takes the vocabulary of the DataModule's prepared data (or the
            preset's without a DataModule). A given size must cover the data's vocabulary (it is never changed).
        moe_impl: MoE block implementation (``"fast"``: FastSparseMoE; ``"reference"``: the plain loop).
        lr: peak learning rate (after warm-up).
        min_lr: final learning rate of the cosine decay.
        warmup_steps: optimizer steps of linear warm-up.
        decay_steps: optimizer step at which the schedule reaches ``min_lr``; ``None`` uses the Trainer's
            ``max_steps`` (or its estimated total steps). The resolved schedule is saved with the run: a resume
            keeps it (:mod:`mula_lightning.lr_schedule`).
        lr_schedule: ``"cosine"`` (warm-up, cosine to ``min_lr`` at ``decay_steps``), ``"wsd"`` (warm-up, the peak,
            then a decay over the last ``decay_fraction`` of ``decay_steps``) or ``"constant"`` (warm-up, the peak).
        decay_fraction: the share of ``decay_steps`` that ``wsd`` decays over (0.2: the last fifth).
        decay_shape: ``wsd``'s decay, ``"1-sqrt"`` or ``"linear"``.
        replan_schedule: on a resume, switch to this run's schedule (another ``lr``, ``min_lr``, ``warmup_steps``
            or horizon) instead of keeping the checkpoint's; without it such a change is refused, except a horizon
            that follows a changed ``max_steps``, which keeps the checkpoint's.
        optimizer: ``"adamw"`` (every parameter) or ``"muon"`` (:class:`~mula_lightning.optim.muon.MuonAdamW`: Muon
            for the matrices of the decoder layers, experts included, AdamW for embeddings, LM head, norms and
            routers; one ``lr`` and ``weight_decay`` for both, Muon's scaled to match AdamW's update size).
            ``epso`` shards either; ``zero_topo`` trains AdamW only.
        muon_momentum: Muon's (Nesterov) momentum.
        weight_decay: decoupled weight decay (applied to all parameters, as in the paper).
        betas: AdamW betas (the AdamW half under ``"muon"``).
        eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this value (0 disables); the Trainer's
            ``gradient_clip_val``, when set, takes precedence.
        clip_during_warmup: also clip during the warm-up (the paper clips only after it).
        log_grad_norm: log the global gradient norm before clipping (one extra scalar all-reduce per step under
            the sharded strategies).
        peak_tflops: peak dense TFLOP/s of one device in the training precision; when given, MFU is logged.
        seed: initialisation seed (weights are a function of (seed, parameter name), so every layout and strategy
            starts from the same model). Under ``epso`` it replaces the strategy's ``seed``.
        init_from: start from these weights instead of ``seed``: a model-only checkpoint directory
            (``ModelOnlyCheckpoint``, ``mula upcycle``), a transformers directory (OLMoE, Mixtral, Llama, Qwen MoE),
            a DualCheckpoint directory or slot, a DCP directory or a ``.ckpt`` written by ``mula fit``. The model
            config comes from it (``model`` is ignored); the optimizer and schedule start fresh (to resume a run,
            use ``ckpt_path`` instead). Read once per shard under the sharded strategies.
    """

    def __init__(
        self,
        model: str | MulaConfig | dict[str, Any] = "mula-tiny-moe",
        model_overrides: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        moe_impl: str = "fast",
        lr: float = 4e-4,
        min_lr: float = 4e-5,
        warmup_steps: int = 2500,
        decay_steps: int | None = None,
        lr_schedule: str = "cosine",
        decay_fraction: float = 0.2,
        decay_shape: str = "1-sqrt",
        replan_schedule: bool = False,
        optimizer: str = "adamw",
        muon_momentum: float = 0.95,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        grad_clip: float = 1.0,
        clip_during_warmup: bool = False,
        log_grad_norm: bool = True,
        peak_tflops: float | None = None,
        seed: int = 0,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not 0 <= min_lr <= lr:
            raise ValueError(f"min_lr ({min_lr}) must be in [0, lr ({lr})]")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be >= 0")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {optimizer!r} must be one of {OPTIMIZERS}")
        LRSchedule(warmup_steps, warmup_steps, lr, min_lr, lr_schedule, decay_fraction, decay_shape)  # names checked
        overrides = dict(model_overrides or {})
        overrides.setdefault("moe_impl", moe_impl)
        #: the vocabulary is the user's (kept, checked against the data) unless a preset was named without one
        self.vocab_fixed = vocab_size is not None or "vocab_size" in overrides or not isinstance(model, str)
        if init_from is not None:
            model = init_source_config(init_from)
            self.vocab_fixed = True
            given = vocab_size if vocab_size is not None else overrides.get("vocab_size")
            if given is not None and given != model.vocab_size:
                raise ValueError(
                    f"vocab_size ({given}) differs from the vocab_size of init_from {init_from} "
                    f"({model.vocab_size}); the embeddings are not resized: drop vocab_size"
                )
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        if isinstance(model, dict):  # a MulaConfig as checkpoints store it (plain data: a dict of its fields)
            model = MulaConfig(**model)
        if isinstance(model, MulaConfig):
            unknown = set(overrides) - set(model.to_dict())
            if unknown:
                raise ValueError(f"unknown MulaConfig fields {sorted(unknown)} in model_overrides")
            self.config = MulaConfig(**{**model.to_dict(), **overrides})
        else:
            self.config = MulaConfig.from_name(model, **overrides)
        self.model: MulaForCausalLM | None = None
        self.peak_tflops = peak_tflops
        self.flops_per_batch: float | None = None  # model FLOPs of this rank's batch, for MFU
        self.last_moe_aux: list[MoEAux] = []  # the last training micro-batch's MoE statistics, for MoEStats
        self.val_loss = MeanMetric()
        self.data_info: dict[str, Any] | None = None  # the training data's tokenizer and EOS id, once known

    # ------------------------------------------------------------------------------------------ building
    def setup(self, stage: str) -> None:
        """Resolve the vocabulary from the data and check the layout fits the model (before any allocation)."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        manifest = getattr(datamodule, "manifest", None) if datamodule is not None else None  # checks tokenizer
        if manifest is not None:
            self.data_info = {  # travels with every checkpoint, so that an export holds the training tokenizer
                "eos_id": manifest.eos_id,
                "vocab_size": manifest.vocab_size,
                "tokenizer_json": manifest.tokenizer_path.read_text(),
            }
            self.resolve_vocab(manifest)
        if stage == "fit" and datamodule is not None and getattr(datamodule, "global_batch_size", None):
            self._check_accumulation(datamodule)
        seq_len = getattr(manifest, "seq_len", None) if manifest is not None else None
        check_layout(self.config, self._strategy(), self.trainer.world_size, seq_len)

    def resolve_vocab(self, manifest: Any) -> int:
        """Fit the vocabulary to the data of ``manifest`` (a :class:`~mula_lightning.data.DataManifest`).

        A preset named without a vocabulary takes the data's; a vocabulary the user fixed is kept and must hold every
        id of the data.

        Raises:
            ValueError: the fixed vocabulary is smaller than the data's, naming both sizes, where each comes from and
                what to change.
        """
        if not self.vocab_fixed:
            vocab = manifest.resolve_vocab_size(None)
            if vocab != self.config.vocab_size:
                rank_zero_info(f"MulaLM: vocab_size {vocab} from the data in {manifest.root}")
                self.config = MulaConfig(**{**self.config.to_dict(), "vocab_size": vocab})
            return vocab
        if self.config.vocab_size < manifest.vocab_size:
            source = f"init_from {self.hparams.init_from}" if self.hparams.init_from else "the model config"
            raise ValueError(
                f"vocab_size {self.config.vocab_size} of {source} is smaller than the vocabulary of the data in "
                f"{manifest.root} ({manifest.vocab_size} ids): prepare the data with a tokenizer of at most "
                f"{self.config.vocab_size} tokens"
                + ("" if self.hparams.init_from else f", or set model.vocab_size to {manifest.vocab_size} or more")
            )
        return self.config.vocab_size

    def _check_accumulation(self, datamodule: Any) -> None:
        """The DataModule's global batch must equal micro-batch x data-parallel ranks x the Trainer's accumulation."""
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None) or {}
        dp = datamodule.dp_size or int(kwargs.get("num_replicas", 1))
        per_step = datamodule.micro_batch_size * dp
        need, accumulate = datamodule.global_batch_size // per_step, self.trainer.accumulate_grad_batches
        if datamodule.global_batch_size % per_step == 0 and need != accumulate:
            raise ValueError(
                f"data.global_batch_size ({datamodule.global_batch_size}) = micro_batch_size "
                f"({datamodule.micro_batch_size}) x data-parallel ranks ({dp}) x {need} accumulated micro-batches, "
                f"but trainer.accumulate_grad_batches is {accumulate}; set it to {need}"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the resolved model config (vocabulary from the data included) and the data's tokenizer and EOS id
        under ``checkpoint["mula"]``: ``mula export`` then needs no ``--config`` and writes the tokenizer."""
        checkpoint[CHECKPOINT_KEY] = {"config": self.config.to_dict(), "data": self.data_info}

    def _strategy(self) -> Any:
        """The Trainer's strategy, or None outside a Trainer."""
        return self.trainer.strategy if self._trainer is not None else None

    def configure_model(self) -> None:
        """Build the model: on the meta device under ``epso`` (the strategy materialises it), else for real."""
        if self.model is not None:
            return
        strategy = self._strategy()
        if isinstance(strategy, ShardingStrategy) and strategy.builds_on_meta:  # it materialises from the meta device
            strategy.init_seed = self.hparams.seed
            strategy.init_from = self.hparams.init_from
            with torch.device("meta"):
                self.model = MulaForCausalLM(self.config)
            return
        with torch.device("meta"):
            model = MulaForCausalLM(self.config)
        device = torch.empty(0).device  # the context's device (the Trainer builds under the root device)
        dtype = torch.get_default_dtype()  # bf16-true sets it to bfloat16 here
        model.to_empty(device=device)
        model = model.to(dtype)
        if self.hparams.init_from:  # every rank reads (DDP broadcasts rank 0's weights when it wraps the model)
            self.model = InitWeights(self.hparams.init_from).load_into(model)
        else:
            self.model = init_weights(model, seed=self.hparams.seed)

    # -------------------------------------------------------------------------------------------- steps
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids, labels=labels)

    def _pipeline(self) -> Any:
        """The strategy's pipeline (``epso`` with ``pp_size > 1``), else None."""
        return getattr(self._strategy(), "pipeline", None)

    def on_train_start(self) -> None:
        """Routers at ``"global_batch"`` balance scope sum their expert counts over the ranks that hold the step's
        other tokens: the strategy's distinct-batch group (``epso``: data x expert parallel ranks of a stage, not the
        tensor-parallel peers that read the same batch), every rank otherwise."""
        strategy = self._strategy()
        topology = getattr(strategy, "topology", None)
        if topology is not None and hasattr(topology, "dense_dp_group"):
            group = topology.dense_dp_group if topology.dense_dp_size > 1 else None
        else:
            group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        enable_global_batch_balance(self.model, group)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A new accumulation window starts a new step's running count of the experts' tokens (global-batch
        balancing; a skipped step's counts go too)."""
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            reset_balance_window(self.model)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids = batch["input_ids"]
        if self._pipeline() is not None:  # the strategy runs forward and backward of every micro-batch
            accumulate = self.trainer.accumulate_grad_batches
            out = self._strategy().pipeline_step(input_ids, batch["labels"], loss_scale=1.0 / accumulate)
            loss, lm_loss, aux_loss = out.loss, out.lm_loss, out.aux_loss
        else:
            out = self.model(input_ids, labels=batch["labels"], return_logits=False)  # head + loss fused, chunked
            loss, lm_loss, aux_loss = out.loss + out.aux_loss, out.loss, out.aux_loss
        # ThroughputMonitor wants this batch's FLOPs (MulaThroughput counts the world in distinct batches)
        self.flops_per_batch = self.config.flops_per_token(input_ids.shape[1]) * input_ids.numel()
        self.last_moe_aux = [a.detach() if a is not None else None for a in out.moe_aux]
        # the progress bar's metrics are read back to the host at every step, shown or not (Lightning's logger
        # connector converts them at each batch end): ask for it only when a bar shows them, so that a run without
        # one reads the device once per step (the NaN detector's flag), not twice
        shown = self._trainer is not None and self.trainer.progress_bar_callback is not None
        self.log("train/loss", loss, prog_bar=shown)
        self.log("train/lm_loss", lm_loss)
        self.log("train/aux_loss", aux_loss)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"] if self._trainer is not None else 0.0)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: dict[str, torch.Tensor], prefix: str) -> None:
        # Every rank runs the forward (expert-parallel layers need all EP ranks), padding rows included.
        if self._pipeline() is not None:  # the last stage's summed loss, on every rank of the pipeline
            loss_sum = self._strategy().pipeline_eval_step(batch["input_ids"], batch["labels"])
        else:
            loss_sum = self.model(
                batch["input_ids"], labels=batch["labels"], loss_reduction="sum", return_logits=False
            ).loss
        tokens = (batch["labels"][:, 1:] != -100).sum()  # MulaDataModule.real_token_count
        self.val_loss.update(loss_sum / tokens.clamp(min=1), weight=tokens)  # token-weighted, synced over ranks
        self.log(f"{prefix}/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def _log_perplexity(self, prefix: str) -> None:
        loss = self.val_loss.compute()  # all-reduced token-weighted mean; the metric is reset by Lightning
        self.log(f"{prefix}/perplexity", torch.exp(loss.float()), on_step=False, on_epoch=True, sync_dist=True)

    # ------------------------------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW on every parameter, or Muon with its AdamW split (a sharded strategy turns either into its sharded
        form), with warm-up and the ``lr_schedule`` (cosine, WSD or constant)."""
        hp = self.hparams
        hyper = dict(lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay)
        if hp.get("optimizer", "adamw") == "muon":
            optimizer = MuonAdamW(muon_param_groups(self), momentum=hp.muon_momentum, **hyper)
        else:
            optimizer = single_device_adamw(self.parameters(), **hyper)
        # auxiliary-loss-free balancing after each step of this optimizer (epso / zero_topo install it on theirs)
        install_expert_bias_update(optimizer, self)
        decay = hp.decay_steps
        if decay is None:
            max_steps = self.trainer.max_steps if self._trainer is not None else -1
            decay = max_steps if max_steps and max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        decay = max(decay, hp.warmup_steps)
        # saved with the run: a resume keeps this schedule, refuses a change or re-plans it (replan_schedule)
        scheduler = ScheduledLR(
            optimizer,
            LRSchedule(hp.warmup_steps, decay, hp.lr, hp.min_lr, hp.lr_schedule, hp.decay_fraction, hp.decay_shape),
            horizon_follows_max_steps=hp.decay_steps is None,
            replan=hp.replan_schedule,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Log the global gradient norm, then clip by norm after the warm-up (through the strategy's plugin)."""
        if self.hparams.log_grad_norm:
            self.log("train/grad_norm", self._grad_norm(optimizer))
        max_norm = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        in_warmup = self.trainer.global_step < self.hparams.warmup_steps
        if max_norm and max_norm > 0 and (self.hparams.clip_during_warmup or not in_warmup):
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def _grad_norm(self, optimizer: Any) -> torch.Tensor:
        """The global L2 norm of the (reduced) gradients, under any strategy."""
        strategy = self._strategy()
        if isinstance(strategy, ShardingStrategy):  # sharded gradients: the strategy reduces, then norms the shards
            return strategy.global_grad_norm(optimizer)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads)
