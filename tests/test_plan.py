"""`tide plan`: the paper's cluster gives the paper's gains, and the planner keeps every GPU on
inference where speculation does not pay for the GPUs that train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tide.cli import app
from tide.infra.plan.cluster import Cluster
from tide.infra.plan.planner import plan
from tide.infra.plan.simulate import Shift, replay

PAPER = Path(__file__).resolve().parent.parent / "infra" / "clusters" / "paper.yaml"


@pytest.mark.parametrize(("s", "low", "high"), [(1.30, 1.21, 1.22), (1.15, 1.07, 1.08)])
def test_paper_cluster_reproduces_the_paper_gains(s: float, low: float, high: float) -> None:
    p = plan(Cluster.load(PAPER), s)
    assert p.speculate and p.training == {"h100": 0, "mi250": 4} and p.serving == {"h100": 8, "mi250": 0}
    assert low * 0.98 <= p.gain <= high * 1.02
    assert abs(p.break_even - 1.074) < 0.002


def test_below_break_even_every_gpu_serves() -> None:
    p = plan(Cluster.load(PAPER), 1.06)
    assert not p.speculate and p.gain == 1.0 and p.serving == {"h100": 8, "mi250": 4}
    assert "below the break-even" in p.explain()


def test_training_goes_where_inference_is_worth_least() -> None:
    d = yaml.safe_load(PAPER.read_text())
    d["training_demand"] = 6.0  # more than the four MI250 give: one H100 must train as well
    p = plan(Cluster.from_dict(d), 1.3)
    assert p.training == {"h100": 1, "mi250": 4} and p.speculate  # 2.44 + 4 >= 6, the cheapest such split
    d["training_demand"] = 100.0  # no split keeps up: no speculation
    p = plan(Cluster.from_dict(d), 1.3)
    assert not p.speculate and "trains fast enough" in p.explain()


def test_shift_replay_tide_never_below_nospec_and_recovers() -> None:
    cluster = Cluster.load(PAPER)
    p = plan(cluster, 1.3)
    r = replay(cluster, p, Shift(seconds=3600, shift_at=1200, static_after=0.8, adapt_work=2400))
    assert r.adapt_seconds == 600  # 2400 units of work on 4 MI250
    assert min(t / n for t, n in zip(r.tide, r.nospec, strict=True)) >= 0.93  # only the training GPUs' share
    assert r.tide[-1] / r.nospec[-1] == pytest.approx(p.gain)
    assert r.static[-1] / r.nospec[-1] == pytest.approx(0.8)
    assert r.totals()["tide_vs_nospec"] > 1.0 > r.totals()["static_vs_nospec"]


def test_cli_writes_placement_report_and_plot(tmp_path: Path) -> None:
    out, report, png = tmp_path / "placement.yaml", tmp_path / "plan.json", tmp_path / "shift.png"
    res = CliRunner().invoke(app, ["plan", "--cluster", str(PAPER), "--out", str(out), "--report", str(report),
                                   "--plot", str(png)])  # fmt: skip
    assert res.exit_code == 0, res.output
    placements = yaml.safe_load(out.read_text())["placements"]
    assert [p["speculate"] for p in placements] == [True, True, False]
    assert placements[0]["training"] == [
        {"gpu_class": "mi250", "replicas": 4, "nodeSelector": {"tide.dev/gpu-class": "mi250"}}
    ]
    assert json.loads(report.read_text())["placements"][0]["replay"]["tide_vs_nospec"] > 1.0
    assert png.stat().st_size > 10_000
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [{name: a}]\n")
    res = CliRunner().invoke(app, ["plan", "--cluster", str(bad)])
    assert res.exit_code == 2 and "bad cluster description" in res.output


def test_committed_paper_overlay_is_what_the_planner_writes(tmp_path: Path) -> None:
    overlay, fresh = PAPER.parent.parent / "k8s" / "overlays" / "paper", tmp_path / "paper"
    res = CliRunner().invoke(app, ["plan", "--cluster", str(PAPER), "--speedup", "1.3", "--out",
                                   str(tmp_path / "p.yaml"), "--kustomize", str(fresh)])  # fmt: skip
    assert res.exit_code == 0, res.output
    for name in ("patch-0.yaml", "patch-1.yaml", "patch-2.yaml"):
        assert (fresh / name).read_text() == (overlay / name).read_text(), name
    written = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert written["resources"] == ["../../base"]
    assert written["patches"] == yaml.safe_load((fresh / "kustomization.yaml").read_text())["patches"]
    pod = yaml.safe_load((overlay / "patch-1.yaml").read_text())["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"tide.dev/gpu-pool": None, "tide.dev/gpu-class": "mi250"}
    assert pod["containers"][0]["resources"]["limits"] == {"amd.com/gpu": 1, "nvidia.com/gpu": None}
