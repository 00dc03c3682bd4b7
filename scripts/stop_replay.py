"""Would stopping the draft chain where the draft doubts it pay? A replay, in one process.

`python scripts/stop_replay.py WORKLOAD SECONDS DRAFT_DIR [--part test|all] [--stops 0.05,0.1,0.2]`
serves the workload's prompts (batch 1, 192 new tokens, greedy) drafting 7 tokens every step, and
records per step the draft's probability of each of its tokens and how many the target accepted.
Greedy acceptance under a shorter chain is min(accepted, length), so every stop rule can be replayed
on the same steps: it prints tokens per step and predicted speedup for each fixed gamma and for each
`stop_below`, costing a step with the measured profile (`--linear`: a verify cost that grows
linearly from T(1), for a machine whose profile is noisy). The README's comparison comes from here;
`scripts/gamma_ab.py --stops` measures the rule live.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import load_target
from tide.prompts import load_prompts, split
from tide.registry.profile import StepProfile
from tide.serving.controller import ControllerConfig, build_controller
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

DEPTH = 7


def replay(
    steps: list[tuple[list[float], int]], p: StepProfile, cap: int, stop: float
) -> tuple[float, float]:
    """(speedup over plain decoding, tokens per step) of chains of at most `cap` tokens that stop
    once the draft's probability of the chain so far is below `stop`."""
    tokens = seconds = 0.0
    for probs, accepted in steps:
        length, sure = 1, probs[0]
        while length < cap and sure * probs[length] >= stop:
            sure *= probs[length]
            length += 1
        extra = 1 if length < cap else 0  # the draft step whose probability said stop
        tokens += min(accepted, length) + 1
        seconds += p.target[length + 1] + p.overhead + p.drafting(length + extra)
    return tokens / seconds * (p.target[1] + p.overhead), tokens / len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", help="a name under workloads/, e.g. code")
    ap.add_argument("seconds", type=float)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--part", choices=["train", "test", "all"], default="test")
    ap.add_argument("--stops", default="0.05,0.1,0.2,0.3")
    ap.add_argument("--linear", action="store_true", help="verify cost 1 + 4.7%% of T(1) per extra token")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    target = load_target(None)
    m = target.model

    def load() -> Eagle3Draft:
        return Eagle3Draft.load(args.draft, m.embed_tokens, target.config, target.fingerprint, m.dtype)

    p = build_controller(m, load(), ControllerConfig(max_gamma=DEPTH), 1, (1,)).costs.profiles[0]
    if args.linear:
        t1 = min(p.target.values())
        p.target = {n: t1 * (1 + 0.047 * (n - 1)) for n in range(1, DEPTH + 2)}
    print(f"profile: T(1..{DEPTH + 1}) {[round(t * 1e3, 2) for t in p.target.values()]} ms")
    draft = load()
    probs: list[float] = []
    step_of = draft.step

    def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = step_of(*args)
        probs.append(float(logits.softmax(-1).amax()))  # greedy: the drafted token's probability
        return out, logits

    draft.step = recording  # type: ignore[method-assign, assignment]
    engine = Engine(target, draft, EngineConfig(max_batch=1, max_model_len=600, gamma=DEPTH, max_gamma=DEPTH))
    prompts = [
        q.token_ids(target.tok)[-256:]
        for q in split(load_prompts(Path(f"workloads/{args.workload}.jsonl")), args.part)
    ]
    steps: list[tuple[list[float], int]] = []
    params = SamplingParams(max_tokens=192)
    start, i = time.time(), 0
    while time.time() - start < args.seconds:
        if not engine.has_work:
            engine.add(prompts[i % len(prompts)], params)
            i += 1
        probs.clear()
        for out in engine.step():
            if out.accepted is not None and len(probs) == DEPTH:
                steps.append((list(probs), out.accepted))
    print(f"{i} requests, {len(steps)} drafting steps")
    for g in range(1, DEPTH + 1):
        s, tau = replay(steps, p, g, 0.0)
        print(f"gamma {g}: {s:.3f}x, tau {tau:.2f}")
    for stop in (float(x) for x in args.stops.split(",") if x):
        s, tau = replay(steps, p, 6, stop)
        print(f"at most 6, stop below {stop:g}: {s:.3f}x, tau {tau:.2f}")


if __name__ == "__main__":
    main()
