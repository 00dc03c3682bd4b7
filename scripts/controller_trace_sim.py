"""The controller on real acceptance: a shift run's captured requests replayed through it.

`python scripts/controller_trace_sim.py WORK_DIR CODE_DRAFT NEW_DRAFT [--requests workloads/chat_fr.jsonl]
[--configs 'threshold=4;threshold=8'] [--orders 8]`
restarts the Kafka broker of a finished `tide bench shift --work-dir WORK_DIR` (as `replay_gate.py`
does) and reads every captured request. For each completion position it computes how many of a
draft's chained tokens the target would accept there (greedy: drafting gamma accepts the smaller of
that and gamma), with the draft unrolled as in training, six deep, over the captured hidden states.
Then it serves four stretches, one after another, through `serving.controller.Controller`, each
step taking its profiled time (`controller_shift_sim.PROFILE`): the first half of the earlier
traffic's requests on CODE_DRAFT, the new traffic's (`--requests`) on CODE_DRAFT (the shift), the
other half of the earlier traffic's on CODE_DRAFT (it comes back while speculation is off), and those
of the new traffic's requests that NEW_DRAFT never learnt from (held out, or served after its file was
written) on NEW_DRAFT, swapped in with the tau per step the first three of them measure (the gate's
part). It prints per stretch the throughput over plain decoding of each fixed gamma (with its tau per
step: the tau over all positions printed first counts a long accepted run at every position it
covers, while steps land after a rejection, on the harder ones), then for each controller setting
(`--configs`) its throughput, the median and 10th percentile over stretches of 250 target steps
(about a 30 s window of the shift bench's TIDE) and the mean of each stretch's first two. With
`--orders N` each stretch is also served in N - 1 shuffled orders (seeded), and the windows pooled.
Unlike `controller_shift_sim.py` the acceptance is the real one: bursty, request by request, and
correlated across depths.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from controller_shift_sim import PROFILE
from replay_gate import read_records

from tide.infra.kafka.broker import KafkaBroker
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import TargetHead, load_head
from tide.serving.controller import Controller, ControllerConfig
from tide.trainers.ttt import Example, chain_lengths, collate, ttt_forward

DEPTH = 6
WINDOW_STEPS = 250


@torch.no_grad()
def position_lengths(draft: Eagle3Draft, head: TargetHead, ex: Example) -> list[int]:
    """Per completion position: how many chained draft tokens the target accepts from there."""
    _, corrects, valids = ttt_forward(draft, head.lm_head, collate([ex], 10**9), DEPTH, 1.0)
    return chain_lengths(corrects, valids)[0][valids[0][0]].tolist()


def traces(draft: Eagle3Draft, head: TargetHead, requests: list[list[Example]]) -> list[list[int]]:
    return [[m for ex in pieces for m in position_lengths(draft, head, ex)] for pieces in requests]


def serve(c: Controller | None, gamma: int, trace: list[int], log: list[tuple[int, float]]) -> None:
    """One request: `c` chooses gamma (None: the fixed `gamma`); appends (tokens, seconds) per step."""
    p = 0
    while p < len(trace):
        g = c.choose(["w"]).gamma if c is not None else gamma
        k = min(trace[p], g)
        s = PROFILE.target[g + 1] + PROFILE.drafting(g)
        if c is not None:
            c.observe(["w"], torch.tensor([k]), g, s)
        log.append((k + 1, s))
        p += k + 1


def ratio(log: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in log) * PROFILE.target[1] / sum(s for _, s in log)


def windows(log: list[tuple[int, float]]) -> list[float]:
    """Ratios over stretches of WINDOW_STEPS plain-step times."""
    out, start, spent = [], 0, 0.0
    for i, (_, s) in enumerate(log):
        spent += s
        if spent >= WINDOW_STEPS * PROFILE.target[1]:
            out.append(ratio(log[start : i + 1]))
            start, spent = i + 1, 0.0
    return out


def position_taus(trace: list[list[int]]) -> list[float]:
    """tau at gamma 1..4 with every position a chain's start (the trainer's held-out tau)."""
    ms = [m for t in trace for m in t]
    return [1.0 + sum(min(m, g) for m in ms) / len(ms) for g in range(1, 5)]


def step_taus(trace: list[list[int]]) -> dict[int, float]:
    """tau at gamma 1..4 per step, served at each fixed gamma (what the gate measures and tags)."""
    out = {}
    for g in range(1, 5):
        log: list[tuple[int, float]] = []
        for t in trace:
            serve(None, g, t, log)
        out[g] = sum(k for k, _ in log) / len(log)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("code_draft", type=Path)
    ap.add_argument("new_draft", type=Path)
    ap.add_argument("--requests", default="workloads/chat_fr.jsonl")
    ap.add_argument("--workload", default="default")
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument(
        "--configs",
        default="",
        help="controller settings to compare, ';' between alternatives: 'threshold=4;threshold=8'",
    )
    ap.add_argument(
        "--orders", type=int, default=1, help="serve each stretch in this many orders (the first as captured)"
    )
    args = ap.parse_args()
    settings: list[dict[str, Any]] = []  # checked before minutes of reading and tracing
    for option in args.configs.split(";"):
        pairs = [kv.split("=") for kv in filter(None, option.split(","))]
        if any(len(kv) != 2 for kv in pairs):
            ap.error(f"--configs: {option!r} is not key=value[,key=value]")
        try:
            settings.append({k: float(v) for k, v in pairs})
            ControllerConfig(**settings[-1])
        except (ValueError, TypeError) as e:
            ap.error(f"--configs: {option!r}: {e}")
    if not (args.work / "kafka" / "ports.json").is_file():
        sys.exit(f"{args.work} is not the --work-dir of a finished `tide bench shift`")
    head = load_head()
    with KafkaBroker(args.work / "kafka") as kafka:
        records = read_records(kafka.bootstrap, head, args.workload)
    by_request: dict[str, list[Example]] = defaultdict(list)
    for rid, _, ex in records:  # oldest first: a request's pieces in order
        by_request[rid].append(ex)
    old = [p for rid, p in by_request.items() if not rid.startswith(args.requests)]
    new = [p for rid, p in by_request.items() if rid.startswith(args.requests)]
    first = min((p[0].created_at for p in new), default=0.0)
    old = [p for p in old if p[0].created_at < first]
    # the new draft is judged only on requests it never learnt from: held out, or served after it was made
    made = (args.new_draft / "model.safetensors").stat().st_mtime
    held = {rid for rid, h, _ in records if h}
    unseen = [
        p
        for rid, p in by_request.items()
        if rid.startswith(args.requests) and (rid in held or p[0].created_at > made)
    ]
    if not (old and new and unseen):
        sys.exit(
            f"{args.work}: needs requests before {args.requests}*, requests of it, and some of them "
            f"{args.new_draft} never learnt from (found {len(old)}, {len(new)}, {len(unseen)})"
        )
    drafts = {
        name: Eagle3Draft.load(path, head.embed, head.config, head.fingerprint, torch.float32)
        for name, path in (("code", args.code_draft), ("new", args.new_draft))
    }
    half = len(old) // 2
    stretches = {
        "earlier traffic, code draft": traces(drafts["code"], head, old[:half]),
        "new traffic, code draft": traces(drafts["code"], head, new),
        "earlier traffic again, code draft": traces(drafts["code"], head, old[half:]),
        "new traffic, new draft": traces(drafts["new"], head, unseen),
    }
    print(
        f"{len(old)} earlier requests, {len(new)} new ones ({len(unseen)} the new draft never learnt from); profile T(1) {PROFILE.target[1] * 1e3:.1f} ms"
    )
    for name, trace in stretches.items():
        print(
            f"{name}: {sum(map(len, trace))} positions, tau at gamma 1..4 over positions {[round(t, 3) for t in position_taus(trace)]}"
        )
        fixed = {}
        for g in (int(x) for x in args.gammas.split(",")):
            flog: list[tuple[int, float]] = []
            for t in trace:
                serve(None, g, t, flog)
            fixed[g] = (round(ratio(flog), 3), round(sum(t for t, _ in flog) / len(flog), 3))
        print(f"  fixed gamma: (throughput, tau per step) {fixed}")
    for overrides in settings:
        print(f"controller {overrides or 'as configured'}, {args.orders} request order(s):")
        served: dict[str, list[float]] = defaultdict(list)
        stretch_windows: dict[str, list[float]] = defaultdict(list)
        opening: dict[str, list[float]] = defaultdict(list)
        for order in range(args.orders):
            rnd = random.Random(order)
            c = Controller(ControllerConfig(**{"max_gamma": DEPTH, **overrides}), [PROFILE])
            for name, trace in stretches.items():
                trace = trace if order == 0 else rnd.sample(trace, len(trace))
                # the new draft is swapped in with what the gate measured on its first requests
                if name == "new traffic, new draft":
                    c.draft_changed(["w"], step_taus(trace[:3]))
                log: list[tuple[int, float]] = []
                for t in trace:
                    serve(c, 0, t, log)
                w = windows(log)
                served[name].append(ratio(log))
                stretch_windows[name] += w
                opening[name] += w[:2]
        for name in stretches:
            w = sorted(stretch_windows[name])
            print(
                f"  {name:34s} {statistics.mean(served[name]):.3f} (windows: median {statistics.median(w):.3f}, "
                f"p10 {w[len(w) // 10]:.3f}, n {len(w)}; first two {statistics.mean(opening[name]):.3f})"
            )


if __name__ == "__main__":
    main()
