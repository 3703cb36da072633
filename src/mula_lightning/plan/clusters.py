"""The machines ``mula plan`` plans for: devices per node, memory per device, devices sharing a physical GPU.

Presets (the papers' machines and a common cloud node):

* ``aurora``: 12 GPU tiles per node (6 Intel Max GPUs of 2 tiles), 64 GB per tile (Aurora paper, Section 3);
* ``frontier``: 8 GCDs per node (4 AMD MI250X of 2 GCDs), 64 GB per GCD (ZeRO-topo paper, Sections V and VI);
* ``dgx-h100``: 8 NVIDIA H100 SXM of 80 GB, one device per GPU.

A YAML file gives the same fields: ``devices_per_node``, ``memory_gb`` (per device, 10^9 bytes), ``devices_per_gpu``
(optional, default 1), ``reserved_gb`` (optional, default 4: see :class:`Cluster`) and ``name`` (optional). Compute
rates and link bandwidths (for step times) are not part of a cluster yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 10**9


@dataclass(frozen=True)
class Cluster:
    """One machine type.

    Attributes:
        name: what it is called in the output.
        devices_per_node: ranks per node (a rank per GPU tile / GCD / GPU).
        memory_bytes: memory of one device.
        devices_per_gpu: devices sharing one physical GPU (tiles, GCDs): the ZeRO-topo paper's weight group.
        reserved_bytes: memory of a device no training state can use: the runtime's context, the collective
            library's own buffers (NCCL / oneCCL / RCCL channels) and the caching allocator's fragmentation; a stated
            allowance (4 GB), not a measurement.
    """

    name: str
    devices_per_node: int
    memory_bytes: int
    devices_per_gpu: int = 1
    reserved_bytes: int = 4 * GB

    def __post_init__(self) -> None:
        sizes = {"devices_per_node": self.devices_per_node, "devices_per_gpu": self.devices_per_gpu}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad or self.devices_per_node % self.devices_per_gpu:
            raise ValueError(
                f"cluster {self.name!r}: devices_per_node ({self.devices_per_node}) and devices_per_gpu "
                f"({self.devices_per_gpu}) must be positive integers, the second dividing the first"
            )
        if not self.memory_bytes > self.reserved_bytes >= 0:
            raise ValueError(
                f"cluster {self.name!r}: memory per device ({self.memory_bytes}) must exceed the reserved memory "
                f"({self.reserved_bytes}), which must not be negative"
            )


CLUSTERS = {
    "aurora": Cluster("aurora", devices_per_node=12, memory_bytes=64 * GB, devices_per_gpu=2),
    "frontier": Cluster("frontier", devices_per_node=8, memory_bytes=64 * GB, devices_per_gpu=2),
    "dgx-h100": Cluster("dgx-h100", devices_per_node=8, memory_bytes=80 * GB, devices_per_gpu=1),
}


def load_cluster(spec: str) -> Cluster:
    """A preset by name, or a YAML file of the fields in the module docstring.

    Raises:
        ValueError: naming an unknown preset (and the known ones) or a file's missing or unknown fields.
    """
    if spec in CLUSTERS:
        return CLUSTERS[spec]
    path = Path(spec)
    if path.suffix.lower() not in (".yaml", ".yml") or not path.is_file():
        raise ValueError(f"unknown cluster {spec!r}: a preset ({', '.join(sorted(CLUSTERS))}) or a YAML file")
    import yaml

    values: Any = yaml.safe_load(path.read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a cluster file holds a mapping of fields, got {type(values).__name__}")
    known = {"name", "devices_per_node", "memory_gb", "devices_per_gpu", "reserved_gb"}
    unknown, missing = sorted(set(values) - known), sorted({"devices_per_node", "memory_gb"} - set(values))
    if unknown or missing:
        raise ValueError(f"{path}: unknown fields {unknown} / missing fields {missing}; a cluster has {sorted(known)}")
    return Cluster(
        str(values.get("name", path.stem)),
        values["devices_per_node"],
        int(float(values["memory_gb"]) * GB),
        values.get("devices_per_gpu", 1),
        int(float(values.get("reserved_gb", 4)) * GB),
    )
