"""How far a step-time profile of a few rounds lands from one of many: what the rounds in
`build_controller` and `DraftSync` and their comments rest on.

`python scripts/profile_noise.py DRAFT_DIR [--batch-size 4] [--max-tokens 7] [--rounds 40] [--ks 3,5,9]`
times `--rounds` rounds on the default model (`time_rounds`), then draws 400 subsets of k rounds
and prints, for per-size medians and for `profile_from_rounds` (median ratios to each round's
one-token step), the median and the 90th percentile over subsets of the worst error in
T(n) / T(1) against the same estimate from all rounds. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from tide.config import native_dtype
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import load_target
from tide.serving.cost_model import profile_from_rounds, time_rounds

Times = dict[str, list[float]]


def per_size_medians(times: Times, batch_size: int, max_tokens: int) -> list[float]:
    med = {k: statistics.median(v) for k, v in times.items()}
    return [med[str(n)] / med["1"] for n in range(2, max_tokens + 1)]


def ratio_medians(times: Times, batch_size: int, max_tokens: int) -> list[float]:
    p = profile_from_rounds(times, batch_size, max_tokens)
    return [p.target[n] / p.target[1] for n in range(2, max_tokens + 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft", type=Path)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--ks", default="3,5,9")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.rounds < 2 * max(ks):
        ap.error(f"--rounds must be at least twice the largest k ({2 * max(ks)})")
    target = load_target(dtype=native_dtype())
    m = target.model
    draft = Eagle3Draft.load(args.draft, m.embed_tokens, target.config, target.fingerprint, m.dtype)
    b, n = args.batch_size, args.max_tokens
    times = time_rounds(m, draft, b, 256, n, args.rounds)
    rng = random.Random(0)
    estimators: dict[str, Callable[[Times, int, int], list[float]]] = {
        "per-size medians": per_size_medians,
        "ratio medians": ratio_medians,
    }
    for name, estimate in estimators.items():
        truth = estimate(times, b, n)
        print(f"{name}, all {args.rounds} rounds: T(n)/T(1) for n = 2..{n}:", [round(x, 3) for x in truth])
        for k in ks:
            errors = []
            for _ in range(400):
                idx = rng.sample(range(args.rounds), k)
                sub = {key: [v[i] for i in idx] for key, v in times.items()}
                errors.append(max(abs(a - t) for a, t in zip(estimate(sub, b, n), truth, strict=True)))
            errors.sort()
            print(f"  {k} rounds: worst error median {errors[200]:.3f}, one in ten {errors[360]:.3f}")


if __name__ == "__main__":
    main()
