"""Pretrain a Mula model with Lightning Fabric and the ``epso`` strategy: the same recipe as ``mula fit``, as a loop.

Why a Fabric script beside the LightningCLI path: the whole step is visible in one place (gradient accumulation to
the global batch, clipping after the warm-up, the sharded optimizer step), which is where people start when they
want to change it. The recipe and defaults are :class:`~mula_lightning.lightning_module.MulaLM`'s (the Aurora
paper's Section 2.1); the data loader is :class:`~mula_lightning.data.MulaDataModule`'s (exactly resumable).

Launch::

    # CPU, 4 processes started by Fabric itself (DP=2 x EP=2), on data from `mula data prepare`
    python examples/fabric_pretrain.py --data_dir data/stdlib --devices 4 --ep_size 2 --max_steps 300 \\
        --lr 3e-3 --min_lr 3e-4 --warmup_steps 30

    # one node of 8 GPUs with torchrun (Fabric attaches to the torchrun processes)
    torchrun --nproc-per-node 8 examples/fabric_pretrain.py --model mula-20b-a2b --data_dir data/pretrain \\
        --accelerator cuda --devices 8 --ep_size 8 --precision bf16-true --micro_batch_size 1 --global_batch_size 3072

    # SLURM: 256 nodes x 12 tiles, EP=12 within each node (the paper's Mula-20B-A2B layout)
    srun --nodes 256 --ntasks-per-node 12 python examples/fabric_pretrain.py --model mula-20b-a2b \\
        --data_dir data/pretrain --devices 12 --num_nodes 256 --ep_size 12 --precision bf16-true \\
        --micro_batch_size 1 --global_batch_size 3072

    # mula launch: nodes that fail are replaced; with --in-job only the failed rank's process is started again, the
    # others stay and rejoin (every rank resumes from the newest complete slot of out_dir/dual)
    mula launch --in-job --nnodes 2 --nproc-per-node 2 --buffer-nodes 1 --report-dir runs/launch -- \\
        python examples/fabric_pretrain.py --data_dir data/stdlib --devices 2 --num_nodes 2 --save_every 20

Outputs go to ``--out_dir`` (default ``runs/fabric``): ``version_N/metrics.csv`` (one per start of the script;
``mula report`` joins and plots them),
``stragglers.jsonl`` (every ``straggler_every`` steps, the ranks that made the others wait; ``MULA_STRAGGLERS_FILE``
under ``mula launch``), ``dual/`` (every ``save_every`` steps, two alternating crash-safe checkpoint slots: model,
optimizer, data position, RNG states) and ``checkpoint/`` (the last step: a sharded ``torch.distributed.checkpoint``
directory with model, optimizer and data position) and, after a non-finite loss or gradient on any rank, ``nan/``
(the report naming the rank, host and first tensors: every rank exits with code 86 before the update, as ``mula fit``
does; ``mula launch`` then relaunches from the newest slot).

Started again with the same ``--out_dir`` (by hand, by ``mula launch`` after a failure, or in the same process by an
in-job restart: :func:`~mula_lightning.utils.in_job_restart.run_loop_in_job`), the script resumes from the newest
complete slot of ``dual/``, and the steps after it are the same, bit for bit, as in a run that never stopped.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint
from mula_lightning.data.datamodule import MulaDataModule
from mula_lightning.lr_schedule import warmup_cosine
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.utils.launch_env import STRAGGLERS_ENV
from mula_lightning.utils.launched_loop import LaunchedLoop
from mula_lightning.utils.non_finite import NonFiniteCheck
from mula_lightning.utils.progress import ProgressMeter
from mula_lightning.utils.stragglers import StragglerMonitor


def evaluate(fabric: Fabric, model: torch.nn.Module, loader) -> float:
    """Mean next-token loss over the real tokens of the validation split, summed over all ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=fabric.device)
    with torch.no_grad():
        for batch in loader:
            batch = fabric.to_device(batch)
            out = model(batch["input_ids"], labels=batch["labels"], loss_reduction="sum")
            total += torch.stack([out.loss.double(), MulaDataModule.real_token_count(batch).double()])
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1].clamp(min=1)).item()


def main(
    data_dir: str,
    model: str = "mula-tiny-moe",
    vocab_size: int | None = None,
    out_dir: str = "runs/fabric",
    accelerator: str = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    ep_size: int = 1,
    precision: str = "32-true",
    micro_batch_size: int = 8,
    global_batch_size: int | None = None,
    max_steps: int = 300,
    lr: float = 4e-4,
    min_lr: float = 4e-5,
    warmup_steps: int = 2500,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    val_every: int = 100,
    log_every: int = 10,
    straggler_every: int = 50,
    save_every: int = 100,
    async_save: bool = False,
    seed: int = 0,
) -> None:
    """Train ``model`` on the prepared data in ``data_dir`` (arguments as in ``MulaLM`` / ``MulaDataModule``),
    resuming from the newest complete slot of ``out_dir/dual`` when there is one (``save_every`` 0: no slots)."""
    strategy = FabricEPSOStrategy(ep_size=ep_size, seed=seed)
    run_dir = Path(out_dir)
    fabric = Fabric(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        # a version folder per start (a resume keeps the rows before it; mula report joins them); rows survive a kill
        loggers=CSVLogger(str(run_dir), name="", flush_logs_every_n_steps=1),
    )
    fabric.launch()  # under mula launch --in-job the group is already formed: Fabric keeps it
    launched = LaunchedLoop(fabric.global_rank, fabric.local_rank)  # mula launch: heartbeats and MULA_FAULT drills
    launched.setup()
    fabric.seed_everything(seed)

    data = MulaDataModule(
        data_dir, micro_batch_size, global_batch_size, dp_rank=fabric.global_rank, dp_size=fabric.world_size
    )
    data.setup("fit")  # every rank reads its own slice of each global batch (EP ranks too: they route their tokens)
    vocab = data.manifest.resolve_vocab_size(vocab_size)  # the data's vocabulary unless a (larger) one is given
    config = MulaConfig.from_name(model, vocab_size=vocab, moe_impl="fast")
    with fabric.init_module(empty_init=True):  # meta device: the strategy materialises and shards it
        net = MulaForCausalLM(config)
    net = fabric.setup_module(net)
    # NaN / Inf in any rank's loss or gradients: every rank stops before the update, the report names the rank
    nan_check = NonFiniteCheck(run_dir / "nan", ep_size=ep_size, local_rank=fabric.local_rank).watch(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    optimizer = fabric.setup_optimizers(optimizer)
    # two alternating crash-safe slots; the newest complete one restores model, optimizer, data position and RNG
    checkpoint = DualCheckpoint(run_dir / "dual", every_n_train_steps=save_every or max_steps + 1,
                                async_save=async_save, phase_hook=launched.checkpoint_hook())  # fmt: skip
    state = {"model": net, "optimizer": optimizer, "data": data, "step": 0}
    if save_every:
        checkpoint.load_fabric(fabric, state)
    step = int(state["step"])
    train_loader, val_loader = data.train_dataloader(), data.val_dataloader()  # from the restored data position
    accumulate = data.train_sampler.global_batch_size // data.train_sampler.step  # micro-batches per optimizer step
    flops_per_token = config.flops_per_token(data.manifest.seq_len)

    # the progress line of `mula fit` (step, loss, lr, tokens/s, memory, time left), printed by rank 0 only
    meter = ProgressMeter(max_steps, log_every, fabric.world_size, enabled=fabric.is_global_zero,
                          flops_per_token=flops_per_token, device=fabric.device)  # fmt: skip
    meter.restart(step)
    # every rank times its sections; every `straggler_every` steps rank 0 names the ranks that made the others wait
    stragglers = StragglerMonitor(every_n_steps=straggler_every, window=min(10, straggler_every), device=fabric.device,
                                  path=os.environ.get(STRAGGLERS_ENV) or run_dir / "stragglers.jsonl")  # fmt: skip
    stragglers.restart(step)
    micro, tokens, start = 0, 0, time.perf_counter()
    iterator = iter(train_loader)
    launched.start(step)
    loss = out = None
    while step < max_steps:
        if micro % accumulate == 0:
            launched.before_step(step + 1)  # a drill's fault of this step fires before its first forward
        with stragglers.section("data"):
            batch = fabric.to_device(next(iterator))
        micro += 1
        is_accumulating = micro % accumulate != 0
        with fabric.no_backward_sync(net, enabled=is_accumulating):
            with stragglers.section("forward"):
                out = net(batch["input_ids"], labels=batch["labels"])
                loss = out.loss + out.aux_loss
            launched.poison(loss)
            nan_check.loss(loss)
            with stragglers.section("backward"):
                fabric.backward(loss / accumulate)
        data.mark_consumed(1)
        tokens += batch["input_ids"].numel() * fabric.world_size
        meter.add_tokens(batch["input_ids"].numel() * fabric.world_size)
        if is_accumulating:
            continue
        nan_check.step(step)  # one all-reduce of a flag: every rank exits here if any saw a non-finite value
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(step, warmup_steps, max_steps, lr, min_lr)
        grad_norm = None
        if grad_clip > 0 and step >= warmup_steps:  # the paper clips only after the warm-up
            grad_norm = fabric.clip_gradients(net, optimizer, max_norm=grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        stragglers.mark("optimizer")
        stragglers.step_done(step)  # on every rank: a small all-gather every `straggler_every` steps
        if checkpoint.should_save(step):
            state["step"] = step
            with stragglers.section("checkpoint"):
                checkpoint.save_fabric(fabric, state, step)
        launched.step_done(step, saved=checkpoint.saves_this_process > 0)
        if step % log_every == 0 or step == max_steps:
            elapsed = time.perf_counter() - start
            metrics = {
                "train/loss": loss.item(),
                "train/lm_loss": out.loss.item(),
                "train/aux_loss": out.aux_loss.item(),
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/items_per_sec": tokens / elapsed,
                "train/flops_per_sec": tokens * flops_per_token / elapsed,
            }
            if grad_norm is not None:
                metrics["train/grad_norm"] = float(grad_norm)
            fabric.log_dict(metrics, step=step)
            tokens, start = 0, time.perf_counter()
        meter.step(step, loss=loss.item, aux=out.aux_loss.item, lr=optimizer.param_groups[0]["lr"])  # read if due
        if step % val_every == 0 or step == max_steps:
            launched.validation(step)
            with stragglers.paused():  # the evaluation is not a step's time
                val_loss = evaluate(fabric, net, val_loader)
            fabric.log_dict({"val/loss": val_loss, "val/perplexity": math.exp(min(val_loss, 50.0))}, step=step)
            fabric.print(f"validation at step {step}: val/loss {val_loss:.4f} | val/perplexity "
                         f"{math.exp(min(val_loss, 50.0)):.4f}")  # fmt: skip
            meter.restart(step)  # the evaluation is not training time
    if loss is not None:  # steps were trained in this call (not a run resumed at its end)
        meter.finish(step, loss=loss.item, aux=out.aux_loss.item, lr=optimizer.param_groups[0]["lr"])
    checkpoint.wait()  # an asynchronous save in flight completes (or raises) before the process ends
    fabric.save(run_dir / "checkpoint", {"model": net, "optimizer": optimizer, "step": step, "data": data.state_dict()})
    fabric.logger.finalize("success")
    launched.end(step)
    log = Path(fabric.logger.log_dir) / "metrics.csv"
    fabric.print(f"checkpoint: {run_dir / 'checkpoint'}; log: {log} (plots: mula report {run_dir})")


if __name__ == "__main__":
    from jsonargparse import CLI

    from mula_lightning.utils.in_job_restart import run_loop_in_job

    run_loop_in_job(CLI, main, as_positional=False)  # CLI(main, as_positional=False), again in each attempt
