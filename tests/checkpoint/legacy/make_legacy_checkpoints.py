"""Writes the checked-in checkpoints of the format before optimizer state left ``ShardedTensor`` (run at 2acb738).

Each directory under ``tests/checkpoint/legacy/`` is what ``fabric.save`` wrote with that code on 2 gloo processes
after two AdamW steps of a tiny MoE: ``zero_topo`` (its default 2-rank layout) and ``epso`` (DP=1 x EP=2,
``ep_aware``), plus ``expected.safetensors``: the same checkpoint loaded into one process by that code
(``model.<key>`` and ``optimizer.<logical key>`` as full tensors, by the test's ``_one_process``). Running this
script today writes today's format, so the fixtures are kept as files, not regenerated; ``test_legacy_checkpoints.py``
proves they still load.

Usage: ``python tests/checkpoint/legacy/make_legacy_checkpoints.py`` (from the repository root).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from mula_lightning.models import MulaForCausalLM
from mula_lightning.testing import run_distributed_test

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from test_legacy_checkpoints import HP, _config, _one_process  # noqa: E402 - the test's loader, one definition


def strategy(kind: str):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if kind == "zero_topo":
        return FabricZeroTopoStrategy(block_size=16, ranks_per_node=2, ranks_per_gpu=2)
    return FabricEPSOStrategy(ep_size=2, sharded_optimizer="ep_aware")


def _save(rank, world_size, kind, path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy(kind), precision="32-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), **HP))
    for step in range(2):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        out = model(x, labels=x)
        fabric.backward(out.loss + out.aux_loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})


def main() -> None:
    from safetensors.torch import save_file

    for kind in ("zero_topo", "epso"):
        path = HERE / kind
        shutil.rmtree(path, ignore_errors=True)
        run_distributed_test(_save, 2, kind=kind, path=str(path), timeout=300)
        expected = {k: v.contiguous() for k, v in _one_process(kind, path).items()}
        save_file(expected, str(path / "expected.safetensors"))
        print(f"{path}: {sorted(p.name for p in path.iterdir())}")


if __name__ == "__main__":
    main()
