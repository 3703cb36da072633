"""``StragglerDetection`` under the Trainer on 2 real processes (DDP, gloo): a clean 200-step run names nobody; a
rank made slow by ``MULA_FAULT``'s ``slow`` fault is named, with its host and section, within 2 reports; the reports
reach the file and the loggers."""

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from mula_lightning.callbacks.fault_injection import FaultInjector
from mula_lightning.callbacks.straggler_detection import StragglerDetection
from mula_lightning.testing import run_pooled_test

#: about 45 ms of matrix products per step on one core: on a 2-core machine a rank's section median lags by a
#: scheduler slice or so (4 ms: the other rank's threads, steal) in some windows, which must stay below the default
#: lag floor of 0.2 of a step (at 10 ms per step, width 256, a clean run was named about one time in two; at 20 ms,
#: width 384, one in six)
WIDTH = 512


class _MatmulLM(LightningModule):
    """``WIDTH`` x ``WIDTH`` matrix products: long against a busy machine's jitter, short enough for 200 steps in a
    few seconds."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch, batch_idx):
        x = batch
        for _ in range(4):
            x = torch.tanh(self.layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _fit(rank, world_size, out, fault, steps):
    torch.manual_seed(rank)
    callbacks = ([FaultInjector(fault)] if fault else []) + [StragglerDetection(every_n_steps=20, window=20, path=out)]
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=steps, logger=CSVLogger(out + ".logs"),
        log_every_n_steps=20, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        callbacks=callbacks, use_distributed_sampler=False,
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        trainer.fit(_MatmulLM(), DataLoader([torch.randn(WIDTH, WIDTH) for _ in range(steps)], batch_size=None))
    return trainer.logger.log_dir, printed.getvalue()


@pytest.mark.distributed
def test_a_clean_run_names_nobody_and_a_slow_rank_is_named_within_two_reports(tmp_path):
    """Clean: 200 steps, 10 reports (every 20 steps, on the 20 steps before each), no rank named, the loggers got
    ``stragglers/*`` at each report. Slow: from step 41 rank 1 sleeps 40 ms per step (a few times a step); the first
    report whose window holds its slow steps (step 60) names rank 1, in ``data``, on its host, far below 0.75, and so
    does every later one; rank 0 is never named."""
    clean = str(tmp_path / "clean.jsonl")
    ((log_dir, _), _) = run_pooled_test(_fit, 2, out=clean, fault="", steps=200, timeout=240)
    reports = [json.loads(line) for line in Path(clean).read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(20, 201, 20))
    assert [r["stragglers"] for r in reports] == [[]] * 10, reports
    with open(f"{log_dir}/metrics.csv") as fh:
        logged = [row for row in csv.DictReader(fh) if row.get("stragglers/count")]
    assert [int(float(row["step"])) for row in logged] == list(range(20, 201, 20))

    slow = str(tmp_path / "slow.jsonl")
    ((_, printed), _) = run_pooled_test(_fit, 2, out=slow, fault="slow@step=41,rank=1,ms=40", steps=80, timeout=240)
    reports = [json.loads(line) for line in Path(slow).read_text().splitlines()]
    assert [r["step"] for r in reports] == [20, 40, 60, 80]
    assert [r["stragglers"] for r in reports[:2]] == [[], []], reports
    for report in reports[2:]:
        (named,) = report["stragglers"]
        assert named["rank"] == 1 and named["section"] == "data" and named["relative"] < 0.5, report
        assert named["host"] and named["lag_ms"] > 30
    assert "straggler at step 60: rank 1 on" in printed  # rank 0 says it
