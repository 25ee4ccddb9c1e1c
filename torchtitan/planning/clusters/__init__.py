"""Clusters as data: one TOML file per cluster, every constant with its source (see docs/planning.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import tomllib

HERE = Path(__file__).parent


class ClusterError(ValueError):
    """A cluster name or file that cannot be used; the message names the fix."""


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    peak_bf16_flops: float  # dense, per GPU
    hbm_gib: float
    hbm_bandwidth: float  # bytes/s
    matmul_efficiency: float  # achievable fraction of the peak for large matmuls
    attention_efficiency: float  # achievable fraction of the peak for the attention kernel
    hbm_efficiency: float  # achievable fraction of the HBM bandwidth for memory-bound kernels
    kernel_launch_s: float
    gpus_per_node: int
    nvlink_busbw: float  # bytes/s, NCCL bus bandwidth within a node
    nvlink_latency_s: float
    network_busbw: float  # bytes/s per GPU, NCCL bus bandwidth across nodes
    network_latency_s: float
    peak_fp8_flops: float = 0.0  # dense, per GPU; 0: no FP8 tensor cores (FP8 products then run at the bf16 rate)

    @property
    def fp8_flops(self) -> float:
        """The rate FP8 products are priced at: the FP8 peak, or the bf16 peak on a GPU without FP8."""
        return self.peak_fp8_flops or self.peak_bf16_flops


_SECTIONS = {"device": ("peak_bf16_flops", "hbm_gib", "hbm_bandwidth", "matmul_efficiency", "attention_efficiency",
                        "hbm_efficiency", "kernel_launch_s"),
             "node": ("gpus_per_node", "nvlink_busbw", "nvlink_latency_s", "network_busbw", "network_latency_s")}


def known_clusters() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.toml"))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster by name (``h100-sxm-80g``, ...) or from a TOML file of one's own."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.exists()):
        path = HERE / f"{name_or_path}.toml"
        if not path.exists():
            raise ClusterError(f"--cluster {name_or_path}: unknown cluster; choose one of "
                               f"{', '.join(known_clusters())}, or give a .toml file with the same fields")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    values = {"name": path.stem, "description": data.get("description", path.stem)}
    for section, keys in _SECTIONS.items():
        table = data.get(section, {})
        for key in keys:
            if key not in table:
                raise ClusterError(f"--cluster {name_or_path}: [{section}] {key} is missing; every cluster file "
                                   f"states it (see {HERE / 'h100-sxm-80g.toml'})")
            values[key] = table[key]
    if "peak_fp8_flops" in data.get("device", {}):
        values["peak_fp8_flops"] = data["device"]["peak_fp8_flops"]
    cluster = Cluster(**values)
    for f in fields(Cluster):
        if f.name not in ("name", "description", "peak_fp8_flops") and not float(getattr(cluster, f.name)) > 0:
            raise ClusterError(f"--cluster {name_or_path}: {f.name} must be > 0")
    return cluster
