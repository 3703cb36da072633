"""The machines ``mula plan`` plans for: devices per node, memory per device, devices sharing a physical GPU, peak
bf16 rate and the bandwidth of each link level.

Presets (the papers' machines and a common cloud node; rates and bandwidths are nominal vendor figures, per device
and one direction, to be replaced by a cluster file with measured ones):

* ``aurora``: 12 GPU tiles per node (6 Intel Max 1550 GPUs of 2 tiles), 64 GB per tile (Aurora paper, Section 3);
  419 bf16 TFLOP/s per tile (839 per GPU); tile to tile in a GPU 200 GB/s, Xe Link between GPUs 80 GB/s per tile
  (about 3 links of 26.5 GB/s to each other GPU), 8 Slingshot-11 NICs of 25 GB/s per node shared by 12 tiles
  (16.7 GB/s each);
* ``frontier``: 8 GCDs per node (4 AMD MI250X of 2 GCDs), 64 GB per GCD (ZeRO-topo paper, Sections IV and VI);
  191.5 bf16 TFLOP/s per GCD; GCD to GCD 200 GB/s, Infinity Fabric between GPUs 50 GB/s, 4 Slingshot ports of
  100 GB/s in all per node (12.5 GB/s per GCD), the paper's Figure 3 figures;
* ``dgx-h100``: 8 NVIDIA H100 SXM of 80 GB, one device per GPU; 989 bf16 TFLOP/s (dense); NVLink 450 GB/s per GPU,
  8 InfiniBand NDR ports of 50 GB/s per node (50 GB/s per GPU).

A YAML file gives the same fields: ``devices_per_node``, ``memory_gb`` (per device, 10^9 bytes), ``devices_per_gpu``
(optional, default 1), ``reserved_gb`` (optional, default 4: see :class:`Cluster`), ``peak_tflops`` (bf16, per
device), ``matmul_efficiency`` (default 0.5), ``bandwidth_gbps`` (a mapping ``gcd`` / ``intra_node`` /
``inter_node`` -> GB/s per device; ``gcd`` only where ``devices_per_gpu > 1``), ``inplace_all_gather`` (default true;
false for gloo) and ``name`` (optional).
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
        peak_flops: dense bf16 FLOP/s of one device.
        matmul_efficiency: the fraction of the peak that training's GEMMs are assumed to reach (stated: 0.5).
        bandwidths: bytes/s one device sends over each link level (``gcd``, ``intra_node``, ``inter_node``).
        inplace_all_gather: the collective library gathers into the output from the rank's own chunk of it (NCCL,
            oneCCL / XCCL); False for gloo, whose all-gathers hold a temporary of the whole output while in flight.
    """

    name: str
    devices_per_node: int
    memory_bytes: int
    devices_per_gpu: int = 1
    reserved_bytes: int = 4 * GB
    peak_flops: float = 100e12
    matmul_efficiency: float = 0.5
    bandwidths: tuple[tuple[str, float], ...] = (("gcd", 100 * GB), ("intra_node", 50 * GB), ("inter_node", 10 * GB))
    inplace_all_gather: bool = True

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
        links = dict(self.bandwidths)
        needed = {"intra_node", "inter_node"} | ({"gcd"} if self.devices_per_gpu > 1 else set())
        if missing := sorted(needed - set(links)):
            raise ValueError(f"cluster {self.name!r}: no bandwidth for the link levels {missing}")
        bad = {k: v for k, v in links.items() if not v > 0}
        if bad or not self.peak_flops > 0 or not 0 < self.matmul_efficiency <= 1:
            raise ValueError(
                f"cluster {self.name!r}: bandwidths ({bad or 'positive'}), peak ({self.peak_flops}) and matmul "
                f"efficiency ({self.matmul_efficiency}) must be positive, the efficiency at most 1"
            )

    def bandwidth(self, link: str) -> float:
        """Bytes/s one device sends over ``link`` (a ledger level)."""
        return dict(self.bandwidths)[link]


def _links(gcd: float | None, intra: float, inter: float) -> tuple[tuple[str, float], ...]:
    pairs = (("gcd", gcd), ("intra_node", intra), ("inter_node", inter))
    return tuple((k, v * GB) for k, v in pairs if v is not None)


CLUSTERS = {
    "aurora": Cluster("aurora", 12, 64 * GB, 2, peak_flops=419e12, bandwidths=_links(200, 80, 200 / 12)),
    "frontier": Cluster("frontier", 8, 64 * GB, 2, peak_flops=191.5e12, bandwidths=_links(200, 50, 12.5)),
    "dgx-h100": Cluster("dgx-h100", 8, 80 * GB, 1, peak_flops=989e12, bandwidths=_links(None, 450, 50)),
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
    known = {"name", "devices_per_node", "memory_gb", "devices_per_gpu", "reserved_gb", "peak_tflops",
             "matmul_efficiency", "bandwidth_gbps", "inplace_all_gather"}  # fmt: skip
    unknown, missing = sorted(set(values) - known), sorted({"devices_per_node", "memory_gb"} - set(values))
    if unknown or missing:
        raise ValueError(f"{path}: unknown fields {unknown} / missing fields {missing}; a cluster has {sorted(known)}")
    links = values.get("bandwidth_gbps", {"gcd": 100, "intra_node": 50, "inter_node": 10})
    if not isinstance(links, dict) or set(links) - {"gcd", "intra_node", "inter_node"}:
        raise ValueError(f"{path}: bandwidth_gbps must map gcd / intra_node / inter_node to GB/s, got {links!r}")
    return Cluster(
        str(values.get("name", path.stem)),
        values["devices_per_node"],
        int(float(values["memory_gb"]) * GB),
        values.get("devices_per_gpu", 1),
        int(float(values.get("reserved_gb", 4)) * GB),
        peak_flops=float(values.get("peak_tflops", 100)) * 1e12,
        matmul_efficiency=float(values.get("matmul_efficiency", 0.5)),
        bandwidths=tuple((k, float(v) * GB) for k, v in links.items()),
        inplace_all_gather=bool(values.get("inplace_all_gather", True)),
    )
