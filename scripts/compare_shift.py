"""Two or more `tide bench shift` reports side by side: a table of each phase's figures and one plot
of TIDE's throughput ratio over time, one line per report (e.g. two controllers on one schedule).

`python scripts/compare_shift.py A.json B.json --labels A,B [--plot both.png]`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIGURES = ("tide_vs_nospec", "tide_window_median", "tide_window_p10", "tide_end_vs_nospec",
           "static_vs_nospec", "adapt_seconds", "promotions")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--labels", help="comma-separated, one per report (default: file names)")
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.reports]
    reports = [json.loads(p.read_text()) for p in args.reports]
    print("| phase | report | " + " | ".join(FIGURES) + " |")
    print("|---" * (len(FIGURES) + 2) + "|")
    for i, phase in enumerate(reports[0]["phases"]):
        for label, r in zip(labels, reports, strict=True):
            p = r["phases"][i]
            cells = [f"{p[k]:.3f}" if isinstance(p[k], float) else str(p[k]) for k in FIGURES]
            print(f"| {i}: {phase['workload']} | {label} | " + " | ".join(cells) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        for label, r in zip(labels, reports, strict=True):
            w = r["windows"]
            ax.plot(
                [x["t"] / 60 for x in w], [x["tide_vs_nospec"] for x in w], "-o", ms=3, label=f"TIDE, {label}"
            )
        w = reports[0]["windows"]
        ax.plot([x["t"] / 60 for x in w], [x["static_vs_nospec"] for x in w], ":", color="#888",
                label=f"static draft ({labels[0]})")  # fmt: skip
        ax.axhline(1.0, color="#888", lw=1)
        phase_s = reports[0]["config"]["phase_seconds"]
        for i, phase in enumerate(reports[0]["phases"]):
            ax.axvline(i * phase_s / 60, color="#bbb", ls="--", lw=1)
            ax.text(i * phase_s / 60, ax.get_ylim()[1], f" {phase['workload']}", va="top", fontsize=8)
        ax.set_xlabel("minutes")
        ax.set_ylabel("throughput / no speculation (30 s windows)")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
