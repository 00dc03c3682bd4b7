"""Fixed gammas against the controller, in one process: what the README's in-process figures come from.

`python scripts/gamma_ab.py WORKLOAD SECONDS DRAFT_DIR [--part test|all] [--gammas 3,4] [--stops 0.1,0]`
serves the workload's prompts (batch 1, 192 new tokens, greedy) with no speculation, one engine per
fixed gamma, and one engine per `stop_below` whose controller chooses gamma, in turns of 4 s on one
core. It prints the step-time
profile the controller measured, then per system its throughput over no speculation, its tokens per
speculating step and acceptance by depth, and how often the controller chose each gamma. Run it on
a quiet machine: the engines share one core, and a neighbour slows all of them alike.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import load_target
from tide.prompts import load_prompts, split
from tide.serving.controller import Controller, ControllerConfig, build_controller
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", help="a name under workloads/, e.g. code")
    ap.add_argument("seconds", type=float)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--part", choices=["train", "test", "all"], default="test")
    ap.add_argument("--gammas", default="3", help="fixed gammas to compare, comma-separated")
    ap.add_argument(
        "--stops", default="0", help="the controller's stop_below values to compare, comma-separated"
    )
    args = ap.parse_args()
    stops = [float(x) for x in args.stops.split(",") if x]
    gammas = [int(g) for g in args.gammas.split(",") if g]
    if any(not 1 <= g <= 8 for g in gammas):
        ap.error("--gammas: each in 1..8")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    target = load_target(None)
    m = target.model

    def draft() -> Eagle3Draft:
        return Eagle3Draft.load(args.draft, m.embed_tokens, target.config, target.fingerprint, m.dtype)

    prompts = [
        p.token_ids(target.tok)[-256:]
        for p in split(load_prompts(Path(f"workloads/{args.workload}.jsonl")), args.part)
    ]
    if not prompts:
        ap.error(f"no {args.part} prompts in workloads/{args.workload}.jsonl")

    def cfg(gamma: int, max_gamma: int = 8) -> EngineConfig:
        return EngineConfig(max_batch=1, max_model_len=600, gamma=gamma, max_gamma=max_gamma)

    controller = build_controller(m, draft(), ControllerConfig(max_gamma=6), 1, (1,))
    p = controller.costs.profiles[0]
    controllers = {
        f"controller stop {x:g}": Controller(ControllerConfig(max_gamma=6, stop_below=x), [p]) for x in stops
    }
    print(f"profile: T(1..7) {[round(t * 1e3, 2) for t in p.target.values()]} ms, "
          f"draft {p.drafting(1) * 1e3:.2f} ms then {(p.drafting(2) - p.drafting(1)) * 1e3:.2f} ms")  # fmt: skip
    systems = {"nospec": Engine(target, None, cfg(0))}
    systems |= {f"gamma {g}": Engine(target, draft(), cfg(g)) for g in gammas}
    systems |= {name: Engine(target, draft(), cfg(0, 6), controller=c) for name, c in controllers.items()}
    cursor, tokens = Counter[str](), Counter[str]()
    chosen: dict[str, Counter[int]] = {name: Counter() for name in controllers}
    seconds: dict[str, float] = dict.fromkeys(systems, 0.0)
    params = SamplingParams(max_tokens=192)
    start = time.time()
    while time.time() - start < args.seconds:
        for name, e in systems.items():
            t = time.perf_counter()
            while time.perf_counter() - t < 4:
                if not e.has_work:
                    e.add(prompts[cursor[name] % len(prompts)], params)
                    cursor[name] += 1
                tokens[name] += sum(len(o.new_tokens) for o in e.step())
                if name in controllers:
                    chosen[name][controllers[name].last.gamma] += 1
            seconds[name] += time.perf_counter() - t
    base = tokens["nospec"] / seconds["nospec"]
    for name, e in systems.items():
        rates = [round(r, 3) for r in e.stats.rates() if r]
        print(f"{name}: {tokens[name] / seconds[name] / base:.3f}x no speculation, "
              f"tau {e.stats.mean_accept_length:.3f}, acceptance by depth {rates}")  # fmt: skip
    for name, counts in chosen.items():
        print(f"{name}: gammas chosen {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
