"""A cluster as the planner sees it: GPU classes with their measured inference and training rates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class GpuClass:
    name: str
    count: int
    inference: float  # tokens/s one GPU serves without speculation (any unit all classes share)
    training: float  # draft-training samples/s of one GPU (any unit all classes share)
    labels: dict[str, str] = field(default_factory=dict)  # Kubernetes node labels that select this class
    resource: str = "nvidia.com/gpu"  # the extended resource its GPUs are requested by


@dataclass
class Cluster:
    classes: list[GpuClass]
    training_demand: float  # samples/s the drafts need to keep up with the traffic (the `training` unit)
    speedups: list[float]  # speculative speedups s the drafts reach on the serving GPUs

    @classmethod
    def load(cls, path: Path) -> Cluster:
        return cls.from_dict(yaml.safe_load(path.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        try:
            classes = [
                GpuClass(
                    str(c["name"]),
                    int(c["count"]),
                    float(c["inference"]),
                    float(c["training"]),
                    {str(k): str(v) for k, v in (c.get("labels") or {}).items()},
                    str(c.get("resource", "nvidia.com/gpu")),
                )
                for c in d["classes"]
            ]
            cluster = cls(classes, float(d["training_demand"]), [float(s) for s in d.get("speedups", [])])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad cluster description: {e!r}") from None
        if not classes or any(c.count < 0 or c.inference < 0 or c.training < 0 for c in classes):
            raise ValueError("a cluster needs GPU classes with non-negative counts and rates")
        return cluster
