"""``mula plan``: what one rank holds of a model's training state at a layout, before anything is launched.

    mula plan mula-220b-a10b --cluster aurora --nodes 1024 --ep 12 --pp 8
    mula plan mula-20b-a2b --cluster aurora --nodes 256 --ep 12 --json
    mula plan --config examples/configs/mula-100b-a7b.yaml --cluster aurora

Prints the model's total and active parameters, then per pipeline stage one rank's bytes of weights, gradients, fp32
master and AdamW moments (:mod:`~mula_lightning.plan.states`), their total and whether they fit the device. This is the
first part of the planner: activations, communication volumes, step times and the layout search are not modelled yet,
so "fits" means the model states fit (what remains of the device is for activations and buffers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mula_lightning.plan.clusters import CLUSTERS, GB, load_cluster
from mula_lightning.plan.states import EPSO_MODES, PRECISIONS, Layout, state_bytes

KINDS = ("weights", "gradients", "master", "moments", "total")
ZERO_SIZES = ("weight_size", "grad_size", "optimizer_size", "secondary_size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mula plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a preset (mula models lists them)")
    parser.add_argument("--config", help="a mula fit YAML: its model, strategy, precision, devices x nodes")
    parser.add_argument("--cluster", default="aurora", help=f"{', '.join(sorted(CLUSTERS))} or a YAML file")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the config's, else 1)")
    parser.add_argument("--strategy", choices=("epso", "zero_topo"), default=None)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree")
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages")
    parser.add_argument("--mode", choices=EPSO_MODES, default=None, help="epso's sharded_optimizer")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default=None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _from_fit_config(path: str) -> dict[str, Any]:
    """What a mula fit YAML says: preset and overrides, strategy and its sizes, precision, devices x nodes."""
    import yaml

    values = yaml.safe_load(Path(path).read_text())
    model = values.get("model", {}) or {}
    trainer = values.get("trainer", {}) or {}
    strategy = trainer.get("strategy", {}) or {}
    args = (strategy.get("init_args", {}) if isinstance(strategy, dict) else {}) or {}
    class_path = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy)
    return {
        "model": model.get("model"),
        "overrides": model.get("model_overrides") or {},
        "strategy": "zero_topo" if "ZeroTopo" in class_path or class_path == "zero_topo" else "epso",
        "ep": int(args.get("ep_size", 1)),
        "pp": int(args.get("pp_size", 1)),
        "tp": int(args.get("tp_size", 1)),
        "etp": int(args.get("etp_size", 1)),
        "mode": args.get("sharded_optimizer", "ep_aware"),
        "zero_sizes": tuple(
            int(args.get(k, 0)) for k in ("weight_size", "grad_size", "optimizer_size", "secondary_size")
        ),
        "precision": trainer.get("precision", "bf16-true"),
        "devices": int(trainer.get("devices", 1)),
        "nodes": int(trainer.get("num_nodes", 1)),
    }


def plan(argv: Sequence[str]) -> dict[str, Any]:
    """The plan as a dictionary (the JSON ``mula plan --json`` prints)."""
    from mula_lightning.models import MulaConfig

    args = build_parser().parse_args(list(argv))
    fit = _from_fit_config(args.config) if args.config else {}
    name = args.model or fit.get("model")
    if not name:
        raise ValueError("mula plan needs a preset (mula plan mula-7b-a1b ...) or --config FIT.yaml")
    config = MulaConfig.from_name(name, **fit.get("overrides", {})) if isinstance(name, str) else MulaConfig(**name)
    cluster = load_cluster(args.cluster)

    def given(value: Any, key: str, default: Any) -> Any:  # the flag, else the config's, else the default
        return value if value is not None else fit.get(key, default)

    nodes = given(args.nodes, "nodes", 1)
    for flag, value in (("--nodes", nodes), ("--ep", args.ep), ("--pp", args.pp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be at least 1")
    layout = Layout(
        world_size=nodes * cluster.devices_per_node,
        strategy=given(args.strategy, "strategy", "epso"),
        ep=given(args.ep, "ep", 1),
        pp=given(args.pp, "pp", 1),
        mode=given(args.mode, "mode", "ep_aware"),
        precision=given(args.precision, "precision", "bf16-true"),
        zero_sizes=fit.get("zero_sizes", (0, 0, 0, 0)),
        ranks_per_node=cluster.devices_per_node,
        ranks_per_gpu=cluster.devices_per_gpu,
        tp=fit.get("tp", 1),
        etp=fit.get("etp", 1),
    )
    stages = state_bytes(config, layout)
    worst = max(stages, key=lambda row: row["total"])
    fits = worst["total"] <= cluster.memory_bytes
    reason = None
    if not fits:
        need, have = worst["total"] / GB, cluster.memory_bytes / GB
        reason = f"model states {need:.1f} GB per rank exceed the device's {have:.0f} GB"
    return {
        "model": {"name": config.name, "total_params": config.num_params(), "active_params": config.num_params(True)},
        "cluster": {"name": cluster.name, "nodes": nodes, "devices_per_node": cluster.devices_per_node,
                    "memory_bytes": cluster.memory_bytes},  # fmt: skip
        "layouts": [
            {
                "dp": layout.dp, "ep": layout.ep, "etp": layout.etp, "tp": layout.tp, "pp": layout.pp,
                "strategy": layout.strategy, "mode": layout.mode if layout.strategy == "epso" else None,
                "precision": layout.precision, "fits": fits,
                "reason": reason,
                "memory_bytes": worst, "stages": stages,
            }
        ],
    }  # fmt: skip


def _table(result: dict[str, Any]) -> str:
    model, cluster = result["model"], result["cluster"]
    lines = [
        f"{model['name']}: {model['total_params'] / 1e9:.2f} B parameters, {model['active_params'] / 1e9:.2f} B active",
        f"{cluster['name']}: {cluster['nodes']} nodes x {cluster['devices_per_node']} devices of "
        f"{cluster['memory_bytes'] / GB:.0f} GB",
    ]
    for layout in result["layouts"]:
        mode = f" {layout['mode']}" if layout["mode"] else ""
        lines.append(
            f"\n{layout['strategy']}{mode}, {layout['precision']}: DP {layout['dp']} x EP {layout['ep']} x PP "
            f"{layout['pp']}; model states per rank (GB; activations not modelled yet):"
        )
        lines.append(f"{'stage':>5} " + " ".join(f"{k:>10}" for k in KINDS))
        for index, row in enumerate(layout["stages"]):
            lines.append(f"{index:>5} " + " ".join(f"{row[k] / GB:>10.2f}" for k in KINDS))
        lines.append("fits" if layout["fits"] else f"does not fit: {layout['reason']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    result = plan(list(argv or []))
    print(json.dumps(result, indent=1) if "--json" in (argv or []) else _table(result))
    return 0
