"""The controller through a simulated workload shift, no model run: its decisions, not the engine's speed.

`python scripts/controller_shift_sim.py [--seeds 5]` feeds `serving.controller.Controller` steps
that take exactly their profiled time (the controller's own start-up profile on the AMX host of
ABA15/16, `measure_profile` at batch 1 on one core: T(1) 38.8 ms, verifying 2-7 tokens 40.2-41.9
ms, a draft step 2.2 ms, 1.4 ms each after), with acceptance drawn per depth: code-like rates,
then a new traffic. It prints the throughput over plain decoding per stretch (mean over seeds) and
how often each gamma was chosen in the first 1,000 steps after the shift. No model runs: it tests the controller's decisions, not the engine.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable

import torch

from tide.registry.profile import StepProfile
from tide.serving.controller import Controller, ControllerConfig

PROFILE = StepProfile(
    1,
    {1: 0.0388, 2: 0.0402, 3: 0.0404, 4: 0.0408, 5: 0.0413, 6: 0.0418, 7: 0.0419},
    0.0022,
    draft_next=0.0014,
)
CODE = [0.6, 0.65, 0.75, 0.7, 0.7, 0.6]
Rates = list[float] | Callable[[int], list[float]]
# tau by gamma of a draft recalled at the shift, as the gate measured it on a few new requests (ABA16:
# a first-token rate of 0.07, and deeper rates of 0.35-0.54 from the few chains that got past it)
RECALLED = {1: 1.07, 2: 1.095, 3: 1.108, 4: 1.115}


def run(
    regimes: list[tuple[Rates, int]], seed: int, prior: dict[int, float] | None = None
) -> tuple[list[float], Counter[int]]:
    """`prior`: at the second stretch's start a draft is swapped in with this measurement."""
    rnd = random.Random(seed)
    c = Controller(ControllerConfig(max_gamma=6), [PROFILE])
    ratios: list[float] = []
    chosen: Counter[int] = Counter()
    for r, (rates, n) in enumerate(regimes):
        tokens, seconds = 0, 0.0
        if r == 1 and prior is not None:
            c.draft_changed(["w"], prior)
        for i in range(n):
            d = c.choose(["w"])
            alphas = rates(i) if callable(rates) else rates
            k = 0
            while k < d.gamma and rnd.random() < alphas[k]:
                k += 1
            s = c.costs.step_time(1, d.gamma)
            c.observe(["w"], torch.tensor([k]), d.gamma, s)
            tokens, seconds = tokens + k + 1, seconds + s
            if r == 1:
                chosen[d.gamma] += 1
        ratios.append(tokens * c.costs.step_time(1, 0) / seconds)
    return ratios, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    hard = lambda i: CODE if (i // 200) % 6 else [0.2, 0.4, 0.5, 0.5, 0.5, 0.5]  # noqa: E731
    low = [0.05, 0.3, 0.4, 0.5, 0.5, 0.5]
    cases: dict[str, tuple[list[tuple[Rates, int]], dict[int, float] | None]] = {
        "code, steady": ([(CODE, 6000)], None),
        "code, a hard stretch every 1,200 steps": ([(hard, 8000)], None),
        "code -> 0.1 at every depth": ([(CODE, 3000), ([0.1] * 6, 1000), ([0.1] * 6, 3000)], None),
        "code -> 0.12, then 0.6 deeper": (
            [(CODE, 3000), ([0.12] + [0.6] * 5, 1000), ([0.12] + [0.6] * 5, 3000)],
            None,
        ),
        "code -> 0.2 at every depth": ([(CODE, 3000), ([0.2] * 6, 1000), ([0.2] * 6, 3000)], None),
        "code -> 0.05 first, recalled draft": ([(CODE, 3000), (low, 1000), (low, 3000)], RECALLED),
    }
    for name, (regimes, prior) in cases.items():
        runs = [run(regimes, s, prior) for s in range(args.seeds)]
        mean = [round(sum(r[0][j] for r in runs) / len(runs), 3) for j in range(len(regimes))]
        gammas = sum((r[1] for r in runs), Counter())
        print(
            f"{name:40s} throughput / plain per stretch {mean}  gamma in the 1,000 steps after: {dict(sorted(gammas.items()))}"
        )


if __name__ == "__main__":
    main()
