"""The XPU accelerator end to end through the process group, with ``torch.xpu`` mocked on CPU and a fake ``xccl``
backend that creates gloo process groups: real processes, Lightning's own set-up path (``setup_environment``:
device selection, then ``init_process_group`` with the backend the strategy names). Proves that under ``epso``,
``zero_topo`` and ``ddp`` (Trainer) and ``epso`` (Fabric) each rank selects ``xpu:LOCAL_RANK``, the default group and
the strategies' subgroups are ``xccl`` groups, and collectives through them reduce every rank's distinct value."""

import pytest
import torch
import torch.distributed as dist

from mula_lightning.testing import run_distributed_test


def _fake_xpu_machine(devices: int) -> list[int]:
    """In this (spawned) process: an XPU build of torch with ``devices`` XPUs and no CUDA, ``set_device`` recorded;
    ``xccl`` makes gloo groups.

    Returns the list that receives every ``torch.xpu.set_device`` index."""
    selected: list[int] = []
    torch.xpu.is_available = lambda: True
    torch.xpu.device_count = lambda: devices
    torch.xpu.set_device = lambda device: selected.append(
        torch.device("xpu", device).index if isinstance(device, int) else torch.device(device).index
    )
    torch.xpu.current_device = lambda: selected[-1] if selected else 0
    torch.cuda.is_available = lambda: False
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("xpu")  # an XPU build of torch
    torch.accelerator.device_count = lambda: devices

    class FakeXCCL(dist.ProcessGroupGloo):
        """gloo under the xccl name; subgroups are made afresh, not split from the parent (as XCCL may)."""

        @property
        def supports_splitting(self) -> bool:
            return False

    def gloo_group(store, rank, size, timeout):
        return FakeXCCL(store, rank, size, timeout)

    dist.Backend.register_backend("xccl", gloo_group, devices=["cpu", "xpu"])
    # run_distributed_test made a gloo group; Lightning must make its own (it skips set-up when one exists).
    dist.destroy_process_group()
    return selected


def _check_groups(strategy, rank: int) -> dict:
    """What the strategy set up: device, backends of the default and sub groups, a SUM of distinct values through
    each group."""
    root = strategy.root_device
    value = torch.tensor([10.0**rank])
    total = value.clone()
    dist.all_reduce(total)  # on CPU tensors: the fake xccl is gloo (Lightning's reduce adds a barrier on the XPU)
    subgroups = {}
    settings = getattr(strategy, "settings", None)
    if hasattr(settings, "ep_size"):  # epso: the DP x EP groups its setup builds are xccl groups too
        from mula_lightning.parallel.topology import build_topology

        topology = build_topology(settings.ep_size)
        for name in ("ep_group", "dp_group"):
            group = getattr(topology, name, None)
            if group is not None:
                subgroups[name] = dist.get_backend(group)
                probe = value.clone()
                dist.all_reduce(probe, group=group)
                subgroups[name + "_sum"] = probe.item()
    return {
        "accelerator": type(strategy.accelerator).__name__,
        "root": str(root),
        "backend": dist.get_backend(),
        "pg_backend": strategy._get_process_group_backend(),
        "sum": float(total.item()),
        **subgroups,
    }


def _trainer_rank(rank, world_size, strategy):
    selected = _fake_xpu_machine(world_size)
    from lightning.pytorch import Trainer

    import mula_lightning.strategies  # noqa: F401  (registers epso / zero_topo and the XPU accelerator)

    trainer = Trainer(
        accelerator="xpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.strategy.setup_environment()
    return {**_check_groups(trainer.strategy, rank), "selected": selected}


def _fabric_rank(rank, world_size):
    selected = _fake_xpu_machine(world_size)
    from lightning.fabric import Fabric

    from mula_lightning.strategies import FabricEPSOStrategy

    fabric = Fabric(accelerator="xpu", devices=world_size, strategy=FabricEPSOStrategy(ep_size=world_size))
    fabric.launch()
    return {**_check_groups(fabric.strategy, rank), "selected": selected, "device": str(fabric.device)}


def _expect(results, world_size):
    expected_sum = float(sum(10.0**r for r in range(world_size)))
    for rank, got in enumerate(results):
        assert got["accelerator"] == "XPUAccelerator"
        assert got["root"] == f"xpu:{rank}" and got["selected"] and got["selected"][-1] == rank
        assert got["backend"] == "xccl" and got["pg_backend"] == "xccl"
        assert got["sum"] == expected_sum
        for name in ("ep_group", "dp_group"):
            if name in got:
                assert got[name] == "xccl"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["epso", "zero_topo", "ddp"])
def test_trainer_sets_up_xccl_groups_on_xpu_devices(strategy):
    """`Trainer(accelerator="xpu", devices=2, strategy=...)` on 2 processes: rank r selects xpu:r before the group
    exists, the default group is xccl, and a SUM through the strategy sees both ranks' distinct values."""
    _expect(run_distributed_test(_trainer_rank, 2, strategy=strategy, timeout=180), 2)


@pytest.mark.distributed
def test_fabric_epso_sets_up_xccl_groups_on_xpu_devices():
    """`Fabric(accelerator="xpu", devices=2, strategy=FabricEPSOStrategy(ep_size=2))`: xpu:r per rank, fabric.device
    on it, the default and the expert-parallel group xccl, both summing the ranks' distinct values."""
    results = run_distributed_test(_fabric_rank, 2, timeout=180)
    _expect(results, 2)
    for rank, got in enumerate(results):
        assert got["device"] == f"xpu:{rank}"
        assert got.get("ep_group") == "xccl" and got["ep_group_sum"] == 11.0
