"""``mula plan``: before a launch, what each rank of a layout holds and sends, how long a step takes, which layout is
fastest, and a dry run of the real set-up at the full world size.

    mula plan mula-220b-a10b --cluster aurora --nodes 1024 --ep 12 --pp 8
    mula plan mula-20b-a2b --cluster aurora --nodes 256 --ep 12 --json
    mula plan --config examples/configs/mula-100b-a7b.yaml --cluster aurora
    mula plan --config examples/configs/mula-100b-a7b.yaml --search
    mula plan mula-220b-a10b --nodes 1024 --ep 12 --pp 8 --trace --ranks 0,6143,-1
    mula plan mula-1b --cluster dgx-h100 --devices-per-node 1          # one GPU of a node
    mula plan mula-20b-a2b --nodes 64 --ep 12 --optimizer muon         # Muon's owners, momentum, Newton-Schulz
    mula plan mula-20b-a2b --cluster dgx-h100 --nodes 8 --ep 8 --cp 4 --seq-len 65536   # a long-context phase

Prints the model's total and active parameters, then per pipeline stage one rank's bytes of weights, gradients, fp32
master, optimizer moments (AdamW's two; Muon's one on the matrices it owns with ``--optimizer muon``:
:mod:`~mula_lightning.plan.states`, :mod:`~mula_lightning.plan.muon`), activations
(:mod:`~mula_lightning.plan.activations`) and communication buffers, whether the worst stage fits the device (less
its reserved memory), and the bytes each collective of one optimizer step sends, per link level
(:mod:`~mula_lightning.plan.comm`). Layout options, batch and recomputation come from the flags or from a ``mula fit``
YAML (``--config``); a flag overrides the file. Then the predicted step time, tokens/s and MFU
(:mod:`~mula_lightning.plan.step_time`). ``--search`` plans every layout at the same global batch instead
(:mod:`~mula_lightning.plan.search`) and prints the ten fastest that fit. ``--trace --ranks 0,-1`` runs the real
set-up of those ranks at the full world size under torch's fake process group (:mod:`~mula_lightning.plan.trace`) and
exits 1 where it disagrees with the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mula_lightning.optim import OPTIMIZERS
from mula_lightning.parallel.activation_checkpointing import parse_activation_checkpointing
from mula_lightning.parallel.pipeline import SCHEDULES
from mula_lightning.plan.clusters import CLUSTERS, GB, Cluster, load_cluster
from mula_lightning.plan.comm import REDUCE_BYTES
from mula_lightning.plan.planner import MEMORY_KINDS, Training, plan_layout
from mula_lightning.plan.search import search
from mula_lightning.plan.states import EPSO_MODES, PRECISIONS, Layout

ZERO_SIZES = ("weight_size", "grad_size", "optimizer_size", "secondary_size")
ZERO_QUANTIZATION = ("quantize_weights", "quantize_grads", "weight_bits", "grad_bits", "block_size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mula plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a preset (mula models lists them)")
    parser.add_argument("--config", help="a mula fit YAML: its model, strategy, precision, batch, devices x nodes")
    parser.add_argument("--cluster", default="aurora", help=f"{', '.join(sorted(CLUSTERS))} or a YAML file")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the config's, else 1)")
    parser.add_argument("--devices-per-node", type=int, default=None,
                        help="use this many devices of each node (a part of one: 1 plans one GPU)")  # fmt: skip
    parser.add_argument("--strategy", choices=("epso", "zero_topo"), default=None)
    parser.add_argument("--dp", type=int, default=None,
                        help="replicas of an expert slice, the paper's DP of DP x EP (checked: world / (pp x ep x "
                        "etp)); the dense layers' DP is world / (pp x tp)")  # fmt: skip
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel degree (each expert cut)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree of the dense layers (folded)")
    parser.add_argument(
        "--sp",
        type=int,
        default=None,
        help="sequence parallelism: 1 (off) or the --tp degree (Megatron's, over the tp ranks)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context-parallel degree: every sequence cut over cp ranks (folded with ep, beside tp)",
    )
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages")
    parser.add_argument("--pp-schedule", choices=tuple(SCHEDULES), default=None)
    parser.add_argument("--pp-microbatches", type=int, default=None, help="micro-batches the schedule cuts")
    parser.add_argument("--pp-virtual-stages", type=int, default=None, help="stages per rank (interleaved_1f1b)")
    parser.add_argument("--mode", choices=EPSO_MODES, default=None, help="epso's sharded_optimizer")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default=None)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="adamw, or muon (Muon on the layers' matrices, each owned whole by one rank)",
    )
    for size in ZERO_SIZES:
        parser.add_argument(
            f"--{size.replace('_', '-')}", type=int, default=None, help=f"zero_topo's {size} (0: default)"
        )
    parser.add_argument("--quantize-weights", action="store_true", default=None, help="zero_topo: INT8 weight gathers")
    parser.add_argument("--quantize-grads", action="store_true", default=None, help="zero_topo: INT4 gradients")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank per step or forward")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048)")
    parser.add_argument("--accumulate", type=int, default=None, help="accumulate_grad_batches (without PP)")
    parser.add_argument("--activation-checkpointing", default=None,
                        help="none, full, or parts: norm,attention,moe,mlp")  # fmt: skip
    parser.add_argument("--dispatcher", choices=("allgather", "alltoall"), default=None)
    parser.add_argument("--reduce-dtype", choices=sorted(REDUCE_BYTES), default=None)
    parser.add_argument("--imbalance", type=float, default=None, help="routing headroom of the busiest rank (1.25)")
    parser.add_argument("--global-batch", type=int, default=None, help="--search: sequences per step (one per rank)")
    parser.add_argument("--search", action="store_true", help="plan every layout, rank those that fit by step time")
    parser.add_argument("--trace", action="store_true", help="run the real set-up for --ranks under a fake group")
    parser.add_argument("--ranks", default="0,-1", help="--trace: ranks to trace, negative from the end (0,-1)")
    parser.add_argument("--plot", default=None, help="write stacked memory bars per stage (or layout) to FILE.png")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _checkpointing(value: Any) -> Any:
    if value in (None, False, "none", "None", "false", "False", [], ""):
        return None
    if value in (True, "full", "true", "True"):
        return "full"
    parts = value.split(",") if isinstance(value, str) else list(value)
    parse_activation_checkpointing(parts)  # names a part that does not exist
    return parts


def _from_fit_config(path: str) -> dict[str, Any]:
    """What a mula fit YAML says: preset and overrides, strategy and its settings, precision, batch, devices x
    nodes (keys absent from the file are absent here, so that the command line's defaults apply)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    values = yaml.safe_load(file.read_text()) or {}
    model = values.get("model", {}) or {}
    trainer = values.get("trainer", {}) or {}
    data = values.get("data", {}) or {}
    strategy = trainer.get("strategy", {}) or {}
    args = (strategy.get("init_args", {}) if isinstance(strategy, dict) else {}) or {}
    class_path = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy)
    out: dict[str, Any] = {
        "model": model.get("model"),
        "init_from": model.get("init_from"),
        "overrides": {k: v for k, v in model.items() if k == "vocab_size" and v is not None}
        | (model.get("model_overrides") or {}),
        "strategy": "zero_topo" if "ZeroTopo" in class_path or class_path == "zero_topo" else "epso",
    }
    if model.get("optimizer") is not None:
        out["optimizer"] = model["optimizer"]
    renames = {
        "ep_size": "ep",
        "pp_size": "pp",
        "tp_size": "tp",
        "cp_size": "cp",
        "etp_size": "etp",
        "sharded_optimizer": "mode",
        "pp_schedule": "pp_schedule",
        "pp_microbatches": "pp_microbatches",
        "pp_virtual_stages": "pp_virtual_stages",
        "dispatcher": "dispatcher",
        "activation_checkpointing": "activation_checkpointing",
        "sequence_parallel": "sequence_parallel",
    }
    # fmt: skip
    out.update({new: args[old] for old, new in renames.items() if args.get(old) is not None})
    if "reduce_dtype" in args:
        out["reduce_dtype"] = str(args["reduce_dtype"]).replace("torch.", "")
    out["zero_sizes"] = tuple(int(args.get(k, 0) or 0) for k in ZERO_SIZES)
    out["extra"] = {k: args[k] for k in ZERO_QUANTIZATION if k in args}
    if "bucket_numel" in args:
        out["bucket_numel"] = args["bucket_numel"]
    for key, source, name in (
        ("precision", trainer, "precision"),
        ("nodes", trainer, "num_nodes"),
        ("devices", trainer, "devices"),
        ("accumulate", trainer, "accumulate_grad_batches"),
        ("micro_batch_size", data, "micro_batch_size"),
        ("global_batch", data, "global_batch_size"),
        ("seq_len", data, "seq_len"),
    ):
        if source.get(name) is not None:
            out[key] = source[name]
    return out


def _accumulation(args: Any, fit: dict[str, Any], micro: int, batches: int) -> int:
    """Micro-batches accumulated per step without pipelining: ``--accumulate``, else the config's
    ``trainer.accumulate_grad_batches``, else what the global batch (``--global-batch``, or the config's
    ``data.global_batch_size``) needs on ``batches``
    data-parallel batches of ``micro`` sequences (as ``mula fit`` checks it: one line when it does not divide), else 1.
    Why: a recipe gives the global batch and lets the rank count set the accumulation; planning one micro-batch per
    step planned another run than ``mula fit`` runs (the 7B recipe on 4 nodes: MFU 3 % planned, 38 % run)."""
    if args.accumulate is not None:
        return int(args.accumulate)
    accumulate = fit.get("accumulate")
    global_batch = args.global_batch if args.global_batch is not None else fit.get("global_batch")
    if global_batch is None:
        return int(accumulate or 1)
    per_step = micro * batches
    if global_batch % per_step or (accumulate is not None and global_batch != per_step * int(accumulate)):
        given = f" x trainer.accumulate_grad_batches ({accumulate})" if accumulate is not None else ""
        raise ValueError(
            f"the global batch ({global_batch} sequences: --global-batch, or data.global_batch_size of --config) is "
            f"not micro_batch_size ({micro}) x data-parallel batches ({batches}){given} at these nodes and devices "
            "(mula fit refuses it too)"
        )
    return global_batch // per_step


def _init_from_config(path: str, config_file: str) -> Any:
    """The MulaConfig of a fit config's ``model.init_from`` (read, not a tensor loaded), or one line naming it."""
    from mula_lightning.checkpoint.init_source import init_source_config

    try:
        return init_source_config(path)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"--config {config_file}: model.init_from {path} gives no model config ({error})") from None


def plan(argv: Sequence[str]) -> dict[str, Any]:
    """The plan as a dictionary (the JSON ``mula plan --json`` prints)."""
    from mula_lightning.models import MulaConfig

    args = build_parser().parse_args(list(argv))
    fit = _from_fit_config(args.config) if args.config else {}
    name = args.model or fit.get("model")
    if not name and fit.get("init_from"):  # the model of the weights the run starts from (mula upcycle, HF, DCP)
        config = _init_from_config(fit["init_from"], args.config)
    elif not name:
        raise ValueError("mula plan needs a preset (mula plan mula-7b-a1b ...) or --config FIT.yaml")
    else:
        config = MulaConfig.from_name(name, **fit.get("overrides", {})) if isinstance(name, str) else MulaConfig(**name)
    cluster = part_of_node(load_cluster(args.cluster), args.devices_per_node)

    def given(key: str, default: Any) -> Any:  # the flag, else the config's, else the default
        value = getattr(args, key, None)
        return value if value is not None else fit.get(key, default)

    nodes = int(given("nodes", 1))
    sizes = {"--nodes": nodes, "--ep": args.ep, "--pp": args.pp, "--dp": args.dp, "--tp": args.tp, "--etp": args.etp,
             "--sp": args.sp, "--cp": args.cp, "--micro-batch-size": args.micro_batch_size, "--seq-len": args.seq_len,
             "--pp-microbatches": args.pp_microbatches, "--pp-virtual-stages": args.pp_virtual_stages,
             "--accumulate": args.accumulate, "--global-batch": args.global_batch}  # fmt: skip
    for flag, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be at least 1")
    tp = int(given("tp", 1))
    if args.sp is not None and args.sp not in (1, tp):
        raise ValueError(f"--sp ({args.sp}) must be 1 (off) or the tensor-parallel degree --tp ({tp}): sequence "
                         "parallelism splits each sequence over the tp ranks")  # fmt: skip
    sequence_parallel = tp > 1 and (args.sp == tp if args.sp is not None else bool(fit.get("sequence_parallel")))
    pp, cp = int(given("pp", 1)), int(given("cp", 1))
    micro = int(given("micro_batch_size", pp))  # with pipelining: one sequence per micro-batch, pp of them
    if pp > 1:
        chunks = int(given("pp_microbatches", micro))
    elif args.search:  # each candidate splits the global batch itself
        chunks = int(given("accumulate", 1))
    else:  # the config's accumulation, or what its global batch needs on these ranks (what mula fit runs)
        batches = nodes * cluster.devices_per_node // (tp * cp)
        chunks = _accumulation(args, fit, micro, batches)
    training = Training(
        micro_batch_size=micro,
        seq_len=int(given("seq_len", 2048)),
        micro_batches=chunks,
        checkpointing=_checkpointing(given("activation_checkpointing", None)),
        dispatcher=given("dispatcher", "allgather"),
        reduce_dtype=given("reduce_dtype", "float32"),
        schedule=given("pp_schedule", "1f1b"),
        virtual=int(given("pp_virtual_stages", 1)),
        imbalance=float(given("imbalance", 1.25)),
        bucket_numel=fit.get("bucket_numel", 40_000_000),
    )
    head = {
        "model": {"name": config.name, "total_params": config.num_params(), "active_params": config.num_params(True)},
        "cluster": {
            "name": cluster.name,
            "nodes": nodes,
            "devices_per_node": cluster.devices_per_node,
            "memory_bytes": cluster.memory_bytes,
            "reserved_bytes": cluster.reserved_bytes,
        },  # fmt: skip
    }
    if args.search:
        found = search(config, cluster, nodes, given("global_batch", None), training.seq_len,
                       given("precision", "bf16-true"), training, given("optimizer", "adamw"))  # fmt: skip
        return {"notes": [], **head, "search": True, **found}
    layout = Layout(
        world_size=nodes * cluster.devices_per_node,
        strategy=given("strategy", "epso"),
        ep=int(given("ep", 1)),
        pp=pp,
        mode=given("mode", "ep_aware"),
        precision=given("precision", "bf16-true"),
        zero_sizes=tuple(
            value if (value := getattr(args, size)) is not None else default
            for size, default in zip(ZERO_SIZES, fit.get("zero_sizes", (0, 0, 0, 0)))
        ),
        ranks_per_node=cluster.devices_per_node,
        ranks_per_gpu=cluster.devices_per_gpu,
        tp=tp,
        etp=int(given("etp", 1)),
        sp=sequence_parallel,
        cp=cp,
        optimizer=given("optimizer", "adamw"),
        extra={**fit.get("extra", {}), **{k: True for k in ("quantize_weights", "quantize_grads") if getattr(args, k)}},
    )
    layout.check(config)
    if args.dp is not None and args.dp != layout.dp:
        raise ValueError(
            f"--dp ({args.dp}) must be the world size / (pp x ep x etp) = {layout.world_size} / ({layout.pp} x "
            f"{layout.ep} x {layout.etp}) = {layout.dp} at {nodes} nodes of {cluster.devices_per_node}"
        )
    notes = []
    if fit.get("devices") not in (None, cluster.devices_per_node):
        notes.append(f"the config's trainer.devices ({fit['devices']}) is not {cluster.name}'s "
                     f"{cluster.devices_per_node} devices per node: planned with {cluster.name}'s "
                     f"(--devices-per-node {fit['devices']} plans the config's)")  # fmt: skip
    planned = plan_layout(config, layout, cluster, training)
    if args.trace:
        planned["traced"] = _traced(config, layout, training, planned, _parse_ranks(args.ranks), fit)
    return {"notes": notes, **head, "layouts": [planned]}


def part_of_node(cluster: Cluster, devices: int | None) -> Cluster:
    """``cluster`` with ``devices`` of each node's devices (None: all of them): one GPU of a DGX, 4 of 8. The
    devices kept share their physical GPUs as far as they can (``devices_per_gpu`` their greatest common divisor:
    one tile of an Aurora GPU is a GPU of one device)."""
    if devices is None or devices == cluster.devices_per_node:
        return cluster
    if isinstance(devices, bool) or not 1 <= devices <= cluster.devices_per_node:
        raise ValueError(f"--devices-per-node ({devices}) must be between 1 and {cluster.name}'s "
                         f"{cluster.devices_per_node} devices per node")  # fmt: skip
    name = f"{cluster.name} ({devices} of {cluster.devices_per_node} devices)"
    per_gpu = math.gcd(devices, cluster.devices_per_gpu)
    return dataclasses.replace(cluster, name=name, devices_per_node=devices, devices_per_gpu=per_gpu)


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--ranks ({text!r}) must be comma-separated integers, e.g. 0,6143,-1") from None
    if not ranks:
        raise ValueError(f"--ranks ({text!r}) names no rank")
    return ranks


def _traced(config: Any, layout: Layout, training: Training, planned: dict[str, Any], ranks: list[int],
            fit: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Trace ``ranks`` (:mod:`~mula_lightning.plan.trace`) and check what their objects hold against the plan.

    Raises:
        ValueError: naming the rank, the state kind or group and both values where they disagree.
    """
    import dataclasses

    from mula_lightning.plan.trace import check_trace, trace

    spec = {
        "config": dataclasses.asdict(config), "world_size": layout.world_size, "strategy": layout.strategy,
        "ep": layout.ep, "pp": layout.pp, "tp": layout.tp, "etp": layout.etp, "sp": layout.sp, "cp": layout.cp,
        "mode": layout.mode,
        "precision": layout.precision, "optimizer": layout.optimizer,
        "zero_sizes": layout.zero_sizes, "ranks_per_node": layout.ranks_per_node, "ranks_per_gpu": layout.ranks_per_gpu,
        "dispatcher": training.dispatcher, "checkpointing": training.checkpointing, "schedule": training.schedule,
        "micro_batches": training.micro_batches, "virtual": training.virtual, "reduce_dtype": training.reduce_dtype,
        "bucket_numel": fit.get("bucket_numel", 40_000_000),
    }  # fmt: skip
    out = []
    for traced in trace(spec, ranks):
        check_trace(traced, planned, layout, config)
        out.append(traced)
    return out


def _recompute(value: Any) -> str:
    return "+".join(value) if isinstance(value, list) else (value or "none")


def _search_table(result: dict[str, Any], top: int = 10) -> list[str]:
    layouts, rejected = result["layouts"], result["rejected"]
    lines = [
        f"\n--search: {len(layouts)} layouts fit, {len(rejected)} do not or cannot run; the global batch "
        f"{result['global_batch']} sequences of {result['seq_len']} tokens"
        + (", optimizer muon" if result.get("optimizer") == "muon" else "")
        + f"; the {min(top, len(layouts))} fastest:",
        f"{'#':>3} {'strategy':<18}{'DP x CP x TP x PP':<21}{'EP':<9}{'recompute':<24}{'GB/rank':>8}{'step s':>8}"
        f"{'M tok/s':>9}{'MFU %':>7}",
    ]
    for index, p in enumerate(layouts[:top]):
        name = p["strategy"] + (f" {p['mode']}" if p["mode"] else "")
        # the ranks: data-parallel batches x context x tensor x pipeline parallel (the world size); the experts are
        # split over EP (x ETP) of a stage's ranks, folded over the same ranks as DP x CP x TP (MoE parallel folding)
        sizes = f"{p['dense_dp'] // p['cp']} x {p['cp']} x {p['tp']} x {p['pp']}" + (" SP" if p["sp"] else "")
        experts = f"{p['ep']}" + (f" x {p['etp']}" if p["etp"] > 1 else "")
        lines.append(
            f"{index + 1:>3} {name:<18}{sizes:<21}{experts:<9}"
            f"{_recompute(p['activation_checkpointing']):<24}{p['memory_bytes']['total'] / GB:>8.1f}"
            f"{p['step_time_s']:>8.2f}{p['tokens_per_s'] / 1e6:>9.2f}{100 * p['mfu']:>7.1f}"
        )
    too_big = sum(r["reason"].startswith("stage ") for r in rejected)
    other = [r["reason"] for r in rejected if not r["reason"].startswith("stage ")]
    lines.append(f"rejected: {too_big} do not fit the device, {len(other)} cannot run"
                 + (f" (e.g. {other[0]})" if other else ""))  # fmt: skip
    return lines


def _table(result: dict[str, Any]) -> str:
    model, cluster = result["model"], result["cluster"]
    lines = [
        f"{model['name']}: {model['total_params'] / 1e9:.2f} B parameters, {model['active_params'] / 1e9:.2f} B active",
        f"{cluster['name']}: {cluster['nodes']} nodes x {cluster['devices_per_node']} devices of "
        f"{cluster['memory_bytes'] / GB:.0f} GB ({cluster['reserved_bytes'] / GB:.0f} GB reserved)",
        *(f"note: {note}" for note in result.get("notes", [])),
    ]
    if result.get("search"):
        return "\n".join(lines + _search_table(result))
    for layout in result["layouts"]:
        mode = f" {layout['mode']}" if layout["mode"] else ""
        ckpt = layout["activation_checkpointing"] or "no"
        ckpt = "+".join(ckpt) if isinstance(ckpt, list) else ckpt
        etp = f" x ETP {layout['etp']}" if layout["etp"] > 1 else ""
        muon = ", muon" if layout["muon"] else ""
        dense = ""
        if layout["tp"] > 1 or layout["cp"] > 1:
            cp = f" x CP {layout['cp']}" if layout["cp"] > 1 else ""
            dense = (f" (dense layers: DP {layout['dense_dp'] // layout['cp']}{cp} x TP {layout['tp']}"
                     f"{' with SP' if layout['sp'] else ''})")  # fmt: skip
        lines.append(
            f"\n{layout['strategy']}{mode}, {layout['precision']}{muon}: DP {layout['dp']} x EP {layout['ep']}{etp} "
            f"x PP {layout['pp']}{dense}; {layout['micro_batches']} micro-batches of "
            f"{layout['sequences_per_micro_batch']} x "
            f"{layout['seq_len']} tokens, {ckpt} recomputation, {layout['dispatcher']} dispatch at "
            f"{layout['imbalance']:g}x routing headroom"
        )
        lines.append(f"memory per rank (GB){'':3}" + " ".join(f"{k:>11}" for k in MEMORY_KINDS) + "  in flight")
        for index, (row, act) in enumerate(zip(layout["stages"], layout["activations"])):
            cells = " ".join(f"{row[k] / GB:>11.2f}" for k in MEMORY_KINDS)
            lines.append(f"{'stage ' + str(index):<23}{cells}  {act['in_flight']:>9}")
        lines.append("fits" if layout["fits"] else f"does not fit: {layout['reason']}")
        lines.append(f"\none step, stage {layout['worst_stage']}'s first rank: bytes sent per collective (GB)")
        lines.append(f"{'tag':<27}{'op':<16}{'level':<12}{'link':<12}{'ranks':>6}{'calls':>7}{'GB':>10}")
        for c in layout["collectives"]:
            mark = "" if c["ledger"] else "  (point-to-point: not in the ledger)"
            lines.append(f"{c['tag']:<27}{c['op']:<16}{c['level']:<12}{c['link']:<12}{c['group_size']:>6}"
                         f"{c['calls']:>7}{c['bytes_sent'] / GB:>10.3f}{mark}")  # fmt: skip
        per_link = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in layout["comm_bytes"].items())
        lines.append(f"per link: {per_link or 'nothing sent'}")
        for traced in layout.get("traced", []):
            lines.append(_traced_lines(traced, layout))
        t = layout["time"]
        if layout["muon"]:
            worst = max(range(len(layout["stages"])), key=lambda i: layout["muon"]["newton_schulz_flops"][i])
            lines.append(
                f"\nmuon: the busiest owner (stage {worst}) orthogonalises "
                f"{layout['muon']['elements'][worst] / 1e6:.1f} M matrix elements at most, "
                f"{layout['muon']['newton_schulz_flops'][worst] / 1e12:.2f} TFLOP of Newton-Schulz per step: "
                f"{t['optimizer_s']:.3f} s of the step"
            )
        lines.append(
            f"\npredicted step: {t['step_time_s']:.2f} s = compute {t['compute_s']:.2f} + bubble {t['bubble_s']:.2f} + "
            f"exposed communication {t['exposed_comm_s']:.2f}"
            + (f" + Newton-Schulz {t['optimizer_s']:.2f}" if layout["muon"] else "")
            + f"; {t['tokens_per_step'] / 1e6:.2f} M tokens per step, "
            f"{t['tokens_per_s'] / 1e6:.2f} M tokens/s, MFU {100 * t['mfu']:.1f}% (assumptions: mula_lightning.plan."
            "step_time)"
        )
    return "\n".join(lines)


def _traced_lines(traced: dict[str, Any], layout: dict[str, Any]) -> str:
    stage = layout["stages"][traced["stage"]]
    held = traced["memory_bytes"]
    kinds = " ".join(f"{k} {held[k] / GB:.3f}/{stage[k] / GB:.3f}" for k in held if held[k] is not None)
    groups = ", ".join(f"{k} {len(v)}" for k, v in traced["groups"].items())
    if traced["checkpoint_files"] is None:
        checkpoint = "not traced for this strategy"
    else:
        checkpoint = (f"{', '.join(traced['checkpoint_files']) or 'no file'}, {traced['checkpoint_items']} items, "
                      f"{traced['checkpoint_bytes'] / GB:.3f} GB")  # fmt: skip
    return (
        f"\ntraced rank {traced['rank']} (stage {traced['stage']}, {traced['seconds']:.1f} s, peak resident "
        f"{traced['peak_resident_bytes'] / GB:.2f} GB): GB held / planned: {kinds} (padding "
        f"{traced['padding_elements']} elements); groups: {groups}; checkpoint: {checkpoint}; agrees with the plan"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv or [])
    result = plan(argv)
    figure = build_parser().parse_args(argv).plot
    if figure:
        from mula_lightning.plan.plot import plot_memory

        result["plot"] = str(plot_memory(result, figure))
    print(json.dumps(result, indent=1) if "--json" in argv else _table(result))
    if figure and "--json" not in argv:
        print(f"\nmemory per rank drawn in {result['plot']}")
    return 0
