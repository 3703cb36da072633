"""NaNDetector in a 4-process epso run (DP=2 x EP=2, two simulated nodes), together with DualCheckpoint and
ModelOnlyCheckpoint; the checkpoints it leaves are then used for the model-only restart and size-ratio checks."""

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader

from mula_lightning.callbacks import NAN_EXIT_CODE, DualCheckpoint, ModelOnlyCheckpoint, NaNDetector
from mula_lightning.callbacks.model_only_checkpoint import directory_bytes, restore_weights
from mula_lightning.checkpoint.slots import SLOT_NAMES, read_marker
from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.strategies import EPSOStrategy
from mula_lightning.testing import DistributedTestError, run_pooled_test
from mula_lightning.utils.launch_env import NanRecord, parse_nan_line

BAD_RANK, BAD_STEP = 2, 3


def _config():
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=256, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
        intermediate_size=32, num_experts=4, top_k=2, moe_impl="fast",
    )  # fmt: skip


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a soft failure that leaves the loss finite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _Poisoned(LightningModule):
    def __init__(self, meta=True):
        super().__init__()
        self.model = None
        self.meta = meta

    def configure_model(self):
        if self.model is None:
            with torch.device("meta" if self.meta else "cpu"):
                self.model = MulaForCausalLM(_config())

    def training_step(self, batch, batch_idx):
        out = self.model(batch, labels=batch)
        loss = out.loss + out.aux_loss
        if self.global_rank == BAD_RANK and self.global_step == BAD_STEP:
            loss = loss + 0.0 * _NaNGrad.apply(self.model.lm_head.weight).sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batches(rank, n=32):
    data = [torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i * 10 + rank)) for i in range(n)]
    return DataLoader(torch.stack(data), batch_size=None)


def _run(rank, world_size, root):
    callbacks = [
        NaNDetector(f"{root}/nan"),
        DualCheckpoint(f"{root}/dual", every_n_train_steps=1),
        ModelOnlyCheckpoint(f"{root}/weights", every_n_train_steps=1, dtype=None),
        ModelOnlyCheckpoint(f"{root}/bf16", every_n_train_steps=2, hf_export=True),
    ]
    trainer = Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=EPSOStrategy(ep_size=2), max_steps=8, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(_Poisoned(), _batches(rank))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.distributed
@pytest.mark.slow
def test_nan_in_one_rank_gradient_stops_all_ranks_with_report_and_clean_checkpoints(tmp_path):
    """A NaN injected into rank 2's lm_head gradient at step 3 (finite loss): detected at step 3, all 4 ranks exit
    with NAN_EXIT_CODE within the harness's 2 s grace (none is left hanging and killed), the report names rank 2,
    its host node1, its device and lm_head.weight first, node1 is added to failed_hosts.txt (a host list) and its
    step, rank, expert-parallel group and the event's size to nan_events.jsonl (what mula launch attributes from), no
    checkpoint is newer than step 3 and every tensor of every checkpoint on disk is finite.
    Then, from the same run: a model-only checkpoint holds exactly the full checkpoint's weights, a fresh
    single-process Trainer restarts from it with fresh optimizer states, and the size ratio is printed."""
    with pytest.raises(DistributedTestError) as info:
        run_pooled_test(_run, 4, ranks_per_node=2, root=str(tmp_path), timeout=240)
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2, 3], str(info.value)[:3000]
    assert all(f"exited with code {NAN_EXIT_CODE}" in d for d in failures.values()), failures
    report = json.loads((tmp_path / "nan" / "nan_report.json").read_text())
    assert report["step"] == BAD_STEP and report["bad_ranks"] == [BAD_RANK]
    (bad,) = report["ranks"]
    assert (bad["rank"], bad["host"], bad["device"], bad["loss_finite"]) == (BAD_RANK, "node1", "cpu", True)
    assert bad["first_offending_tensors"][0] == "model.lm_head.weight"
    assert (tmp_path / "nan" / "failed_hosts.txt").read_text() == "node1\n"  # a host list: srun --exclude reads it
    (event,) = (tmp_path / "nan" / "nan_events.jsonl").read_text().splitlines()
    assert parse_nan_line(event) == NanRecord("node1", BAD_STEP, [BAD_RANK], [BAD_RANK // 2], 1, 4)  # EP=2

    steps = sorted(read_marker(tmp_path / "dual" / n)["step"] for n in SLOT_NAMES)
    assert steps == [BAD_STEP - 1, BAD_STEP]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"step-{s:08d}" for s in (1, 2, 3)]
    full = {}
    for name in SLOT_NAMES:
        dcp_to_torch_save(tmp_path / "dual" / name / "state.ckpt", tmp_path / f"{name}.pt")
        full[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert all(torch.isfinite(t).all() for t in _tensors(full[name])), name
    for file in tmp_path.rglob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(file)).values()), file

    # model-only == full checkpoint's weights at the same step
    newest = max(SLOT_NAMES, key=lambda n: read_marker(tmp_path / "dual" / n)["step"])
    weights = load_file(str(tmp_path / "weights" / f"step-{BAD_STEP:08d}" / "model.safetensors"))
    model_state = full[newest]["state_dict"]
    assert set(weights) == {k.removeprefix("model.") for k in model_state}
    assert all(torch.equal(weights[k], model_state[f"model.{k}"]) for k in weights)

    # restart from it: identical weights, fresh optimizer states, training goes on
    module = _Poisoned(meta=False)
    module.configure_model()
    assert restore_weights(module, tmp_path / "weights" / f"step-{BAD_STEP:08d}") == BAD_STEP
    assert all(torch.equal(module.model.state_dict()[k], v) for k, v in weights.items())
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, _batches(0, 4))
    assert [s["step"].item() for s in trainer.optimizers[0].state.values()][0] == 2  # fresh: 2 steps, not 5

    slot2 = next(n for n in SLOT_NAMES if read_marker(tmp_path / "dual" / n)["step"] == 2)
    bf16 = tmp_path / "bf16" / "step-00000002"
    ratio = directory_bytes(tmp_path / "dual" / slot2) / (bf16 / "model.safetensors").stat().st_size
    print(f"\nfull checkpoint (fp32 weights + AdamW, DP=2 x EP=2) / bf16 model-only: {ratio:.2f}x")
    assert 5.5 < ratio < 8.0
    assert (bf16 / "hf" / "config.json").is_file() and (bf16 / "config.json").is_file()
