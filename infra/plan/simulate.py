"""Replay a workload shift on a cluster: no speculation, a static draft, and TIDE's placement.

Before the shift the drafts reach s. At the shift the static draft falls to `static_after` (the
paper measured 0.70-0.86 on misaligned workloads) and stays there. TIDE's controller turns
speculation off while its draft does not pay (so it never serves below 1x), and its training GPUs
relearn the draft: after `adapt_work` units of training work (the classes' training unit x seconds)
its speedup is back at s, rising linearly on the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tide.infra.plan.cluster import Cluster
from tide.infra.plan.planner import Placement


@dataclass
class Shift:
    seconds: float = 3600.0
    shift_at: float = 1200.0
    static_after: float = 0.8
    adapt_work: float = 2400.0  # training-unit seconds a draft needs to reach s on the new workload
    step: float = 10.0


@dataclass
class Replay:
    t: list[float]
    nospec: list[float]  # cluster throughput over time, every GPU serving
    static: list[float]  # every GPU serving with a draft trained before the shift
    tide: list[float]  # the placement: speculation on its serving GPUs, drafts trained on its training GPUs
    adapt_seconds: float

    def totals(self) -> dict[str, float]:
        base = sum(self.nospec)
        return {"static_vs_nospec": sum(self.static) / base, "tide_vs_nospec": sum(self.tide) / base,
                "adapt_seconds": self.adapt_seconds}  # fmt: skip


def replay(cluster: Cluster, p: Placement, shift: Shift) -> Replay:
    by_name = {c.name: c for c in cluster.classes}
    capacity = sum(n * by_name[c].training for c, n in p.training.items())
    serving = sum(n * by_name[c].inference for c, n in p.serving.items())
    adapt = shift.adapt_work / capacity if capacity else float("inf")
    out = Replay([], [], [], [], adapt)
    t = 0.0
    while t < shift.seconds:
        since = t - shift.shift_at
        if not p.speculate:
            s_tide = 1.0
        elif since < 0 or since >= adapt:
            s_tide = p.speedup
        else:  # relearning: the controller keeps it at >= 1x while the draft does not pay
            s_tide = max(1.0, shift.static_after + (p.speedup - shift.static_after) * since / adapt)
        out.t.append(t)
        out.nospec.append(p.baseline)
        out.static.append(p.baseline * (p.speedup if since < 0 else shift.static_after))
        out.tide.append(serving * s_tide)
        t += shift.step
    return out


def plot_replay(r: Replay, shift: Shift, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    minutes = [x / 60 for x in r.t]
    ax.plot(
        minutes,
        [y / b for y, b in zip(r.nospec, r.nospec, strict=True)],
        color="#888",
        label="no speculation",
    )
    ax.plot(
        minutes, [y / b for y, b in zip(r.static, r.nospec, strict=True)], color="#a72", label="static draft"
    )
    ax.plot(
        minutes, [y / b for y, b in zip(r.tide, r.nospec, strict=True)], color="#2a7", label="TIDE placement"
    )
    ax.axvline(shift.shift_at / 60, color="#bbb", ls="--", lw=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("cluster throughput / no speculation")
    ax.set_title(
        "a workload shift on the cluster (dashed): the static draft falls, TIDE's training GPUs relearn"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
