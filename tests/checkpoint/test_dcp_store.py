"""``DcpStore``: any part of a model tensor of a sharded checkpoint, read alone, equals that part of the tensor.

The reference is :func:`~mula_lightning.checkpoint.export.read_checkpoint` (every tensor of the checkpoint read
whole, the model built). Checkpoints are written by 4 real processes in the two layouts that cut tensors
differently: epso DP=2 x EP=2 (expert tensors in dim-0 slices, the rest whole) and zero_topo ZeRO-3 (every tensor
in flat-range pieces cut anywhere), so a read assembles its part from chunks other ranks wrote.
"""

import pytest
import torch

from mula_lightning.checkpoint.dcp_store import DcpStore
from mula_lightning.checkpoint.export import read_checkpoint
from mula_lightning.testing import run_pooled_test
from mula_lightning.testing.fabric_run import fabric_after_one_step, tiny_moe_config

WRITERS = ["epso DP=2 x EP=2", "zero_topo ZeRO-3"]


def _save(rank, world_size, writer, path):
    from mula_lightning.strategies import FabricEPSOStrategy, FabricZeroTopoStrategy

    if writer.startswith("epso"):
        strategy = FabricEPSOStrategy(ep_size=2)
    else:
        strategy = FabricZeroTopoStrategy(weight_size=4, grad_size=4, optimizer_size=4, block_size=16)
    fabric, model, optimizer = fabric_after_one_step(strategy, world_size, rank, tiny_moe_config(vocab_size=96))
    fabric.save(path, {"model": model, "optimizer": optimizer})


@pytest.mark.distributed
@pytest.mark.parametrize("writer", WRITERS)
def test_whole_tensors_rows_and_flat_ranges_equal_the_full_read(tmp_path, writer):
    """Every model tensor read whole equals the full read; expert rows read as a slice equal those rows; random flat
    ranges (inside a row, across rows, whole rows, 1-D tensors, empty) loaded into float32 and float64 buffers equal
    the flattened tensor's elements; the bytes counted are exactly those of the parts asked for."""
    path = tmp_path / "ckpt"
    run_pooled_test(_save, 4, writer=writer, path=str(path))
    model, _ = read_checkpoint(path, tiny_moe_config(vocab_size=96))
    reference = dict(model.named_parameters())
    store = DcpStore(path)
    assert store.prefix == "model."
    stored = store.keys()
    assert set(reference) <= stored and not any(k.startswith("optimizer") for k in stored)
    for name, value in reference.items():
        assert store.shape(name) == tuple(value.shape) and torch.equal(store.read(name), value.detach()), name

    expert = "model.layers.1.mlp.experts.gate_up_proj"
    before = store.bytes_read
    rows = store.read(expert, (slice(1, 3),))
    assert torch.equal(rows, reference[expert][1:3].detach())
    assert store.bytes_read - before == rows.numel() * rows.element_size()

    g = torch.Generator().manual_seed(0)
    for name, value in reference.items():
        flat = value.detach().reshape(-1)
        for dtype in (torch.float32, torch.float64):
            for _ in range(3):
                start = int(torch.randint(0, flat.numel(), (1,), generator=g))
                count = int(torch.randint(0, flat.numel() - start + 1, (1,), generator=g))
                out = torch.full((count,), float("nan"), dtype=dtype)
                before = store.bytes_read
                store.read_range(name, out, start)
                assert torch.equal(out, flat[start : start + count].to(dtype)), (name, start, count)
                assert store.bytes_read - before == count * flat.element_size()


def test_a_slice_with_a_step_and_a_directory_without_model_tensors_are_refused(tmp_path):
    """A strided slice cannot be addressed as a chunk and is refused by name; a DCP directory without Mula model
    tensors raises a ``KeyError`` that names some of its keys."""
    import torch.distributed.checkpoint as dcp

    model_dir, other_dir = tmp_path / "model", tmp_path / "other"
    dcp.save({"model.model.embed_tokens.weight": torch.arange(12.0).view(4, 3)}, checkpoint_id=str(model_dir),
             no_dist=True)  # fmt: skip
    store = DcpStore(model_dir)
    assert torch.equal(store.read("model.embed_tokens.weight", (slice(1, 3),)), torch.arange(3.0, 9.0).view(2, 3))
    with pytest.raises(ValueError, match="model.embed_tokens.weight: only contiguous slices.*step 2"):
        store.read("model.embed_tokens.weight", (slice(0, 4, 2),))
    dcp.save({"weights.w": torch.zeros(2)}, checkpoint_id=str(other_dir), no_dist=True)
    with pytest.raises(KeyError, match=r"no Mula model tensors.*weights\.w"):
        DcpStore(other_dir)
