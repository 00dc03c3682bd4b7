"""The controller replayed on recorded acceptance, with and without its overdispersion measure.

`python scripts/burst_replay.py DRAFT_DIR [--prompts workloads/code.jsonl] [--start 16] [--limit 32]`
serves held-out prompts (`--part test`, from `--start`, batch 1, 128 new tokens, greedy) with a
draft at gamma 6 and records each step's accepted length; it measures this machine's step profile
with the draft as served. Then it replays the record through `serving.controller.Controller`: each
step takes its profiled time and accepts min(recorded, gamma). It prints each fixed gamma's
throughput over no speculation, then the controller's as it is and with the overdispersion held at
1 (outcomes read as independent, as before it was measured), with the share of drafted steps, the
detector's restarts and the dispersion measured. What `docs/experiments.md` ("Acceptance comes in
bursts") reports.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tide.config import native_dtype
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import load_target
from tide.prompts import load_prompts, split
from tide.registry.profile import StepProfile
from tide.serving.controller import Controller, ControllerConfig
from tide.serving.cost_model import measure_profile
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

DEPTH = 6


def record(draft_dir: Path, prompts: Path, start: int, limit: int) -> tuple[list[int], StepProfile]:
    dtype = native_dtype()
    target = load_target(None, dtype, weights="auto", compile=True)
    chosen = split(load_prompts(prompts), "test")[start : start + limit]
    ids = [p.token_ids(target.tok) for p in chosen]
    draft = Eagle3Draft.load(draft_dir, target.model.embed_tokens, target.config, target.fingerprint, dtype)
    cfg = EngineConfig(max_batch=1, max_model_len=max(map(len, ids)) + 136, gamma=DEPTH)
    engine = Engine(target, draft, cfg)  # quantizes the draft and gives it the compiled step
    accepted: list[int] = []
    add = engine.stats.add

    def recording(a: torch.Tensor, gamma: int) -> None:
        accepted.extend(a.tolist())
        add(a, gamma)

    engine.stats.add = recording  # type: ignore[method-assign,assignment]
    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=128))
    return accepted, measure_profile(target.model, draft, 1, 256, DEPTH + 1)


def replay(trace: list[int], profile: StepProfile, dispersion: bool) -> tuple[float, float, int, float]:
    """Throughput over no speculation, share of drafted steps, restarts, dispersion measured."""
    c = Controller(ControllerConfig(max_gamma=DEPTH), [profile])
    restarts, seconds, tokens, drafted = 0, 0.0, 0, 0
    acc = c.tracker("w")
    if not dispersion:
        acc._measure_dispersion = lambda p, n, k: None  # type: ignore[method-assign]
    restart = acc._restart

    def counting(reached: list[float], accepted: list[float]) -> None:
        nonlocal restarts
        restarts += 1
        restart(reached, accepted)

    acc._restart = counting  # type: ignore[method-assign]
    for a in trace:
        g = c.choose(["w"]).gamma
        t = c.costs.step_time(1, g)
        c.observe(["w"], torch.tensor([min(a, g)]), g, t)
        seconds, tokens, drafted = seconds + t, tokens + min(a, g) + 1, drafted + (g > 0)
    return tokens / seconds * profile.target[1], drafted / len(trace), restarts, acc.dispersion


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft", type=Path)
    ap.add_argument("--prompts", type=Path, default=Path("workloads/code.jsonl"))
    ap.add_argument("--start", type=int, default=16)
    ap.add_argument("--limit", type=int, default=32)
    args = ap.parse_args()
    trace, profile = record(args.draft, args.prompts, args.start, args.limit)
    print(f"{len(trace)} steps; profile (ms):", {n: round(t * 1e3, 2) for n, t in profile.target.items()})
    for g in range(1, DEPTH + 1):
        time = sum(profile.target[g + 1] + profile.drafting(g) for _ in trace)
        print(f"fixed gamma {g}: {sum(min(a, g) + 1 for a in trace) / time * profile.target[1]:.3f}x")
    for label, on in (("controller", True), ("outcomes as independent", False)):
        speedup, share, restarts, phi = replay(trace, profile, on)
        print(
            f"{label}: {speedup:.3f}x, drafting {share:.0%} of steps, {restarts} restarts, dispersion {phi:.2f}"
        )


if __name__ == "__main__":
    main()
