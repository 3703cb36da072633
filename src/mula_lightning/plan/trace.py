"""``mula plan --trace``: the real set-up code of a layout run for chosen ranks at the full world size, without a
cluster, and compared with the plan.

The traced ranks run one after the other in one fresh process (a process holds one default process group at a
time), each joining torch's fake process group (``init_process_group("fake", rank=r, world_size=N)``: every
collective returns at once without communicating) and running what ``mula fit`` runs on that rank: the strategy's
topology and groups (:func:`~mula_lightning.parallel.topology.build_topology`, or ``zero_topo``'s layout groups), the
model built on the meta device, cut for this rank (pipeline stage, expert slice) and parallelised (context
parallelism's hooks and groups included), its weights
"materialised" on the meta device (shapes and dtypes, no memory), the sharded optimizer's flat buffers (``epso``'s
:class:`~mula_lightning.parallel.sharded_optimizer.ShardedAdamW` or ``zero_topo``'s engine, whose buffers are fake
tensors), and the checkpoint's DCP save plan with the DP-scattered writer choice (``epso``; ``zero_topo``'s save plan
is not traced yet). It reports what the objects hold: bytes per state kind (padding apart), every group's members,
the checkpoint file this rank writes and its bytes, and the process's peak resident memory (sampled from
``/proc/self/statm``).

Meaningless under the fake process group, and so not reported: values (nothing is communicated; weights land on
the meta device), times of a real step, and anything that depends on data (routing, activations: the traced forward
is not run).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Any

#: the state kinds a trace measures and compares with the plan
TRACED_KINDS = ("weights", "gradients", "master", "moments")


class _PeakResident:
    """Samples this process's resident memory (``/proc/self/statm``) every 10 ms until stopped; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            with open("/proc/self/statm") as f:
                resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: ru_maxrss is the only figure left
            import resource

            resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(self.peak, resident)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def __enter__(self) -> _PeakResident:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _ranks(group: Any, rank: int) -> list[int]:
    import torch.distributed as dist

    return [rank] if group is None else list(dist.get_process_group_ranks(group))


def _trace_epso(model: Any, spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mula_lightning.checkpoint.sharded import sharded_checkpoint_parts
    from mula_lightning.optim.muon import MuonAdamW, muon_param_groups
    from mula_lightning.parallel.params import is_tensor_parallel, local_tensor
    from mula_lightning.parallel.sharded_muon import shard_optimizer
    from mula_lightning.parallel.topology import build_topology
    from mula_lightning.strategies.epso import EPSOSettings, setup_epso_module

    tp, etp, sp, cp = spec.get("tp", 1), spec.get("etp", 1), spec.get("sp", False), spec.get("cp", 1)
    settings = EPSOSettings(
        ep_size=spec["ep"], pp_size=spec["pp"], sharded_optimizer=spec["mode"], dispatcher=spec["dispatcher"],
        tp_size=tp, etp_size=etp, sequence_parallel=sp, cp_size=cp,
        activation_checkpointing=spec["checkpointing"] or False, pp_schedule=spec["schedule"],
        pp_microbatches=spec["micro_batches"] if spec["pp"] > 1 else None, pp_virtual_stages=spec["virtual"],
        reduce_dtype=getattr(torch, spec["reduce_dtype"]), bucket_numel=spec["bucket_numel"],
    )  # fmt: skip
    names = {id(p): n for n, p in model.named_parameters()}
    # the mesh is built from real tensors (DeviceMesh reads its rank grid); everything after it is on meta
    topology = build_topology(settings.ep_size, tp, sp, etp, settings.pp_size, cp)
    setup_epso_module(model, settings, torch.device("meta"), topology)
    if spec.get("optimizer", "adamw") == "muon":  # the stage's own parameters, as MulaLM builds it after set-up
        optimizer = MuonAdamW(muon_param_groups(model), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sharded = shard_optimizer(model, optimizer, topology, names, **settings.optimizer_kwargs())
    padding = sum(b.numel - sum(s.numel for s in b.slots) for buf in sharded.buffers.values() for b in buf.buckets)
    grad_bytes = sum(buf.grads.numel() * buf.grads.element_size() for buf in sharded.buffers.values())
    grad_elem = max((buf.grads.element_size() for buf in sharded.buffers.values()), default=4)
    master = moments = 0
    for state in sharded.shards.values():
        for key in state:
            nbytes = state[key].numel() * state[key].element_size()
            master, moments = (master + nbytes, moments) if key == "master" else (master, moments + nbytes)
    measured = {
        "weights": sum(
            local_tensor(p).numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
        ),
        "gradients": grad_bytes - padding * grad_elem,
        "master": master,
        "moments": moments,
    }
    stage = list(range(topology.stage_root, topology.stage_root + topology.stage_size))
    groups = {
        "ep": _ranks(topology.ep_group, rank),
        "edp": _ranks(topology.dp_group, rank),
        "stage": stage if spec["pp"] > 1 else list(range(dist.get_world_size())),
        "pp": _ranks(topology.pp_group, rank),
    }
    if tp > 1:
        groups["tp"] = _ranks(topology.tp_group, rank)
    if tp > 1 or cp > 1:  # the dp x cp replicas of a dense parameter's tp slice
        groups["dense_dp"] = _ranks(topology.dense_dp_group, rank)
    if cp > 1:
        groups["cp"] = _ranks(topology.cp_group, rank)
    if etp > 1:
        groups["expert"] = _ranks(topology.expert_group, rank)
    tensors, _, planner = sharded_checkpoint_parts({"model": model, "optimizer": sharded}, topology)
    shards = {f"model.{name}" for name, p in model.named_parameters() if is_tensor_parallel(p)}
    dense_dp = groups.get("dense_dp", stage)
    files = _checkpoint_writes(tensors, planner, rank, dist.get_world_size(), groups["edp"], stage, shards, dense_dp)
    return {"measured": measured, "padding_elements": padding, "groups": groups, "stage_rank": topology.stage_rank,
            **files}  # fmt: skip


def _checkpoint_writes(tensors: dict[str, Any], planner: Any, rank: int, world: int, replicas: list[int],
                       stage: list[int], shards: set[str] = frozenset(),
                       dense_dp: list[int] = ()) -> dict[str, Any]:  # fmt: skip
    """The DCP items this rank writes after the DP-scattered choice of a writer for every replicated item, as the
    coordinator's de-duplication would make it (an expert slice is held by its EP slice's replicas, a tensor-parallel
    shard (``shards``) by its ``dense_dp`` replicas, any other model tensor by every rank of the stage, an optimizer
    shard by its owner, a value every rank saves by the rank the planner picks among them all)."""
    import math

    planner.set_up_planner(tensors, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    written = count = 0
    for item in plan.items:
        fqn = item.index.fqn
        chunk = getattr(item.tensor_data, "chunk", None)
        offsets, sizes = (list(chunk.offsets), list(chunk.sizes)) if chunk is not None else (None, None)
        if item.tensor_data is None:  # a value every rank saves (the optimizer's step and hyper-parameters)
            holders = list(range(world))
        elif fqn.startswith("optimizer"):
            holders = [rank]
        else:
            holders = replicas if ".experts." in f".{fqn}" else list(dense_dp) if fqn in shards else stage
        if planner.writer_of(fqn, sorted(holders), offsets, sizes) != rank:
            continue
        count += 1
        if item.tensor_data is not None:
            element = item.tensor_data.properties.dtype.itemsize
            written += math.prod(sizes if sizes is not None else item.tensor_data.size) * element
    return {"checkpoint_files": [f"__{rank}_0.distcp"] if count else [], "checkpoint_items": count,
            "checkpoint_bytes": written}  # fmt: skip


def _trace_zero_topo(model: Any, spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """What :class:`~mula_lightning.strategies.ZeroTopoStrategy` runs for ``fabric.setup(model, optimizer)`` on a
    meta model: experts cut to this rank's slice, the sharded initializer, the engine built unit by unit."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mula_lightning.parallel.expert_parallel import apply_expert_parallel
    from mula_lightning.parallel.parallelize import parameter_initializer
    from mula_lightning.parallel.topology import build_topology
    from mula_lightning.strategies.zero_topo import ZeroTopoSettings, build_engine

    world, ep = spec["world_size"], spec["ep"]
    w, g, o, s = spec["zero_sizes"]
    settings = ZeroTopoSettings(
        weight_size=w, grad_size=g, optimizer_size=o, secondary_size=s, ranks_per_node=spec["ranks_per_node"],
        ranks_per_gpu=spec["ranks_per_gpu"], ep_size=ep, dispatcher=spec["dispatcher"],
    )  # fmt: skip
    if ep > 1:
        apply_expert_parallel(model, build_topology(ep).expert_group, dispatcher=spec["dispatcher"])
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    initializer = parameter_initializer(model, 0)
    initializer.slice_experts(model, rank % ep, ep)
    # the engine's buffers are fake tensors on the CPU: shapes and dtypes, no memory (it refuses to leave a
    # parameter on the meta device, so the meta device cannot stand in for the device here)
    with FakeTensorMode(allow_non_fake_inputs=True):
        engine = build_engine(model, optimizer, settings, world, names, initializer, torch.device("cpu"))
        held = engine.memory_bytes()
        files = _zero_topo_writes(engine, model, rank, world)
    master = sum(u.master.numel() * u.master.element_size() for u in engine.units if not u.master_is_primary)
    measured = {"weights": held["weights"] + held["secondary"], "gradients": held["grads"], "master": master,
                "moments": held["optimizer"] - master}  # fmt: skip
    families = [engine.dense] + ([engine.experts] if engine.experts is not engine.dense else [])
    groups = {f"{fam.name}.{kind}": _ranks(group, rank) for fam in families for kind, (group, *_) in fam.groups.items()}
    padding = sum(u.buf.numel - sum(slot.numel for slot in u.buf.slots) for u in engine.units)
    return {"measured": measured, "padding_elements": padding, "groups": groups, **files}


def _zero_topo_writes(engine: Any, model: Any, rank: int, world: int) -> dict[str, Any]:
    """The DCP items this rank writes of what :class:`~mula_lightning.strategies.ZeroTopoStrategy` saves (its
    logical-key state dicts, :class:`~mula_lightning.checkpoint.scattered.SpreadReplicasSavePlanner`): a piece of a
    primary weight chunk is held by the family's ranks at the same position of their weight groups and written by
    the one of them its key hashes to; an optimizer range by its owner in the family's first optimizer group; an
    item every rank holds (buffers, the step) by rank 0."""
    import math

    from mula_lightning.checkpoint.scattered import SpreadReplicasSavePlanner
    from mula_lightning.parallel.zero import state_dict as zc

    tensors = {"model": zc.model_state_dict(engine, model), "optimizer": zc.optimizer_state_dict(engine)}
    planner = SpreadReplicasSavePlanner()
    planner.set_up_planner(tensors, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    families = {f"model.{slot.name}": u.family for u in engine.units for slot in u.buf.slots}
    written = count = 0
    for item in plan.items:
        fqn, family = item.index.fqn, families.get(item.index.fqn)
        if fqn.startswith("optimizer.state."):
            holders = [rank]
        elif family is None:  # replicated on every rank
            holders = list(range(world))
        else:
            lay, w = family.layout, family.layout.weight_size
            holders = [family.offset + family.stride * k for k in range(family.index % w, lay.world_size, w)]
        if planner.writer_of(item.index, holders, world) != rank:
            continue
        count += 1
        if item.tensor_data is not None:
            sizes = list(item.tensor_data.chunk.sizes)
            written += math.prod(sizes) * item.tensor_data.properties.dtype.itemsize
    return {"checkpoint_files": [f"__{rank}_0.distcp"] if count else [], "checkpoint_items": count,
            "checkpoint_bytes": written}  # fmt: skip


def trace_in_process(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one rank's set-up under the fake process group in this process (which must not hold a process group).

    Args:
        spec: the model (``config``: MulaConfig fields), the layout and training settings (see :func:`trace`).
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mula_lightning.models import MulaConfig, MulaForCausalLM

    rank, world = spec["rank"], spec["world_size"]
    os.environ.update({"MULA_RANKS_PER_NODE": str(spec["ranks_per_node"]),
                       "MULA_RANKS_PER_GPU": str(spec["ranks_per_gpu"])})  # fmt: skip
    start = time.perf_counter()
    with _PeakResident() as memory:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            config = MulaConfig(**spec["config"])
            dtype = torch.bfloat16 if spec["precision"] == "bf16-true" else torch.float32
            with torch.device("meta"):
                model = MulaForCausalLM(config).to(dtype)
            traced = (_trace_epso if spec["strategy"] == "epso" else _trace_zero_topo)(model, spec, rank)
            if rank == 0:  # the save's metadata item (the state's entries that are not tensors): rank 0 writes it
                traced.update(checkpoint_items=traced["checkpoint_items"] + 1, checkpoint_files=["__0_0.distcp"])
        finally:
            dist.destroy_process_group()
    traced.update(rank=rank, seconds=time.perf_counter() - start, peak_resident_bytes=memory.peak)
    return traced


def _child(spec: dict[str, Any], ranks: list[int], queue: Any) -> None:
    for rank in ranks:
        try:
            queue.put(("ok", trace_in_process({**spec, "rank": rank})))
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it with the rank
            queue.put(("error", f"{type(error).__name__}: {error}"))
            return


def trace(spec: dict[str, Any], ranks: list[int], timeout: float = 600.0) -> list[dict[str, Any]]:
    """Trace ``ranks`` one after the other in one spawned process (each rank joins and leaves its own fake
    process group; the process's peak resident memory so far is reported with each).

    Raises:
        ValueError: naming a rank outside the world.
        RuntimeError: naming the rank whose trace failed, and why.
    """
    world = spec["world_size"]
    resolved = []
    for r in ranks:
        actual = r + world if r < 0 else r
        if not 0 <= actual < world:
            raise ValueError(f"rank {r} is outside the world of {world} ranks (0 to {world - 1}, or -1 to -{world})")
        resolved.append(actual)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(spec, resolved, queue), daemon=True)
    process.start()
    out = []
    try:
        for rank in resolved:
            try:
                status, value = queue.get(timeout=timeout)
            except Exception as error:  # the child died without reporting (killed, out of memory) or hung
                raise RuntimeError(
                    f"the trace of rank {rank} reported nothing within {timeout:.0f} s ({type(error).__name__})"
                ) from None
            if status != "ok":
                raise RuntimeError(f"the trace of rank {rank} failed: {value}")
            out.append(value)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return out


def _element_bytes(kind: str, param_bytes: int) -> int:
    return {"weights": param_bytes, "gradients": 4, "master": 4, "moments": 8}[kind]


def check_trace(traced: dict[str, Any], planned: dict[str, Any], layout: Any, config: Any = None) -> None:
    """Compare one traced rank with the plan, in place adding ``stage`` and ``memory_bytes`` (the measured bytes) to
    ``traced``; raise where they disagree.

    ``memory_bytes`` has the plan's keys; activations and buffers are not measured under the fake process group
    (None), nor their total. Bytes per kind must equal the plan's up to the flat buffers' padding
    (``padding_elements`` x the kind's element bytes: the plan counts each family or unit unpadded); every group
    must contain the rank, hold only ranks of the world, and have the size the layout implies. Under Muon a stage's
    ranks hold different states (whole matrices per owner): the traced rank is compared with the plan of its own
    stage rank (:func:`~mula_lightning.plan.states.state_bytes` with ``rank``; ``config`` is the model's).

    Raises:
        ValueError: naming the rank, the kind or group, and both values.
    """
    from mula_lightning.plan.states import PRECISIONS, state_bytes

    rank, world = traced["rank"], layout.world_size
    stage = rank // (world // layout.pp)
    traced["stage"] = stage
    traced["memory_bytes"] = {**traced.pop("measured"), "activations": None, "buffers": None, "total": None}
    expected = planned["stages"][stage]
    if getattr(layout, "optimizer", "adamw") == "muon":
        if config is None:
            raise ValueError("check_trace of a Muon layout needs the model's config (its owners differ per rank)")
        expected = state_bytes(config, layout, rank=traced["stage_rank"])[stage]
    for kind in TRACED_KINDS:
        got, want = traced["memory_bytes"][kind], expected[kind]
        slack = traced["padding_elements"] * _element_bytes(kind, PRECISIONS[layout.precision])
        if abs(got - want) > slack:
            raise ValueError(
                f"traced rank {rank}: {kind} {got} bytes, the plan says {want} (padding allows {slack}): the plan and "
                "the code disagree"
            )
    if layout.strategy == "epso":
        sizes = {"ep": layout.ep, "edp": layout.dp, "stage": world // layout.pp, "pp": layout.pp, "tp": layout.tp,
                 "dense_dp": layout.dense_dp, "expert": layout.ep * layout.etp,
                 "cp": getattr(layout, "cp", 1)}  # fmt: skip
    else:  # the engine's own groups (one rank: no group, the rank alone), dense family and expert slices
        from mula_lightning.parallel.zero.layout import expert_layout

        sizes = {}
        for name, lay in (("dense", layout.zero_layout()), ("expert", expert_layout(layout.zero_layout(), layout.ep))):
            sizes.update({f"{name}.weight": lay.weight_size, f"{name}.secondary": lay.secondary_size,
                          f"{name}.grad": lay.grad_size, f"{name}.grad_cross": lay.world_size // lay.grad_size,
                          f"{name}.post_step": lay.optimizer_size // lay.weight_size})  # fmt: skip
    for name, members in traced["groups"].items():
        if rank not in members or len(members) != sizes[name] or not all(0 <= m < world for m in members):
            raise ValueError(
                f"traced rank {rank}: its {name} group {members[:8]}{'...' if len(members) > 8 else ''} "
                f"({len(members)} ranks) should hold {sizes[name]} ranks of 0..{world - 1}, this rank among them"
            )
