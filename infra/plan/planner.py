"""Which GPUs serve and which train: the placement that serves the most tokens/s.

Every GPU that trains is a GPU that does not serve. Speculation multiplies what the serving GPUs
serve by s (the speedup the drafts reach), and the drafts only keep that speedup while enough GPUs
train them to keep up with the traffic. So a placement pays when s x (serving share) beats every GPU
serving without speculation; below that break-even the planner puts every GPU on inference.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import yaml

from tide.infra.plan.cluster import Cluster

MAX_SPLITS = 1_000_000  # placements tried; larger clusters need a smarter search than enumeration


@dataclass
class Placement:
    speedup: float  # s the drafts reach on the serving GPUs
    serving: dict[str, int]  # GPU class -> GPUs serving
    training: dict[str, int]  # GPU class -> GPUs training drafts
    speculate: bool
    throughput: float  # what the cluster serves (the classes' inference unit)
    baseline: float  # every GPU serving, no speculation
    break_even: float  # s at which the best training split only matches the baseline (inf: none fits)

    @property
    def gain(self) -> float:
        return self.throughput / self.baseline if self.baseline else 0.0

    def explain(self) -> str:
        forgone = 1 - self.break_even**-1 if math.isfinite(self.break_even) else 1.0
        split = ", ".join(f"{n}x {c}" for c, n in self.training.items() if n) or "no GPU"
        if not self.speculate:
            why = (f"s = {self.speedup:.3f} is below the break-even {self.break_even:.3f}"
                   if math.isfinite(self.break_even) else "no split of the cluster trains fast enough")  # fmt: skip
            return f"every GPU serves without speculation: {why}."
        return (
            f"{split} train; the rest serve with speculation. Speculation multiplies what the serving GPUs "
            f"serve by s = {self.speedup:.3f}; the training GPUs' inference is {forgone:.1%} of the cluster's, "
            f"so the gain is s x (1 - {forgone:.3f}) = {self.gain:.3f} (break-even s = {self.break_even:.3f}). "
            "The planner trains where a GPU's inference is worth least per unit of training."
        )


def plan(cluster: Cluster, speedup: float) -> Placement:
    classes = cluster.classes
    baseline = sum(c.count * c.inference for c in classes)
    if math.prod(c.count + 1 for c in classes) > MAX_SPLITS:
        raise ValueError(
            f"more than {MAX_SPLITS} placements to try: group the GPUs into fewer, larger classes"
        )
    best: tuple[float, float, tuple[int, ...]] | None = None  # (serving rate, training capacity, split)
    for split in itertools.product(*(range(c.count + 1) for c in classes)):
        capacity = sum(n * c.training for n, c in zip(split, classes, strict=True))
        if capacity < cluster.training_demand:
            continue
        rate = sum((c.count - n) * c.inference for n, c in zip(split, classes, strict=True))
        # most left serving; at a tie, the least training capacity taken
        if best is None or (rate, -capacity) > (best[0], -best[1]):
            best = (rate, capacity, split)
    everything = {c.name: c.count for c in classes}
    if best is None or best[0] <= 0:
        return Placement(speedup, everything, {}, False, baseline, baseline, math.inf)
    rate, _, split = best
    break_even = baseline / rate
    if speedup * rate <= baseline:
        return Placement(speedup, everything, {}, False, baseline, baseline, break_even)
    return Placement(
        speedup,
        {c.name: c.count - n for n, c in zip(split, classes, strict=True)},
        {c.name: n for n, c in zip(split, classes, strict=True)},
        True,
        speedup * rate,
        baseline,
        break_even,
    )


def placement_manifest(p: Placement, cluster: Cluster) -> dict[str, object]:
    """The placement as deployments read it: replicas per GPU class and the node labels selecting it."""
    labels = {c.name: c.labels for c in cluster.classes}

    def role(counts: dict[str, int]) -> list[dict[str, object]]:
        return [
            {"gpu_class": c, "replicas": n, "nodeSelector": dict(labels[c])} for c, n in counts.items() if n
        ]

    return {
        "speedup": p.speedup,
        "speculate": p.speculate,
        "gain_over_all_inference": round(p.gain, 4),
        "break_even_speedup": round(p.break_even, 4) if math.isfinite(p.break_even) else None,
        "serving": role(p.serving),
        "training": role(p.training),
        "explanation": p.explain(),
    }


def kustomize_overlay(p: Placement, cluster: Cluster, base: str) -> dict[str, str]:
    """Files of a kustomize overlay over `base` that puts serving and training where `p` says: the
    serving replicas, each role's node labels and GPU resource (one GPU class per role: the largest
    share)."""
    by_name = {c.name: c for c in cluster.classes}

    def patch(name: str, container: str | None, counts: dict[str, int], replicas: bool) -> dict[str, object]:
        cls = by_name[max(counts, key=counts.__getitem__)]
        pod: dict[str, object] = {"nodeSelector": {"tide.dev/gpu-pool": None, **cls.labels}}
        if container is not None:  # a strategic merge: the base's nvidia.com/gpu goes when the class differs
            limits = {cls.resource: 1} | (
                {"nvidia.com/gpu": None} if cls.resource != "nvidia.com/gpu" else {}
            )
            pod["containers"] = [{"name": container, "resources": {"limits": limits}}]
        spec: dict[str, object] = {"template": {"spec": pod}}
        if replicas:
            spec["replicas"] = sum(counts.values())
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}

    patches = [patch("tide-serving", "serving", p.serving, True)]
    if p.speculate and any(p.training.values()):
        patches += [patch("tide-trainer-default", "trainer", p.training, False),
                    patch("tide-gate", None, p.training, False)]  # fmt: skip
    files = {f"patch-{i}.yaml": yaml.safe_dump(x, sort_keys=False) for i, x in enumerate(patches)}
    files["kustomization.yaml"] = yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [base],
         "patches": [{"path": f} for f in sorted(files)]},
        sort_keys=False,
    )  # fmt: skip
    return files
