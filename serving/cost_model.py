"""When speculation pays: the TIDE paper's cost model, generalised to per-depth acceptance.

speedup(gamma) = tau(gamma) / (c * gamma + beta), with tau(gamma) = 1 + sum_k prod_{i<=k} alpha_i
the tokens one target step yields, c = draft step time / target step time and
beta = T(b * (gamma + 1)) / T(b): the cost of verifying gamma+1 tokens per sequence relative to
decoding one. T and the draft time are measured on the machine that serves, never assumed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from tide.models.eagle3 import DraftKV, Eagle3Draft
from tide.models.llama import Batch, KVCache, LlamaModel


def expected_tokens(alphas: list[float], gamma: int) -> float:
    tau, alive = 1.0, 1.0
    for a in alphas[:gamma]:
        alive *= a
        tau += alive
    return tau


@dataclass
class StepProfile:
    """Measured step times at one batch size: target[n] for n tokens per sequence, one draft step."""

    batch_size: int
    target: dict[int, float]
    draft_step: float  # the first draft step, right after a target forward (its weights out of cache)
    # what an engine step costs beyond the target forward (sampling, bookkeeping), and the measured
    # cost of drafting gamma tokens the way the engine does it (catch-up + chain); 0 / None: unknown
    overhead: float = 0.0
    draft_total: float | None = None
    # each further step of the chain, its weights still in cache (None: as the first). On this CPU it
    # is 0.6 of the first: timing every step as the first made each depth look 0.4 ms dearer than it is
    draft_next: float | None = None

    def drafting(self, gamma: int) -> float:
        """Seconds to draft gamma tokens in a chain."""
        if gamma == 0:
            return 0.0
        nxt = self.draft_step if self.draft_next is None else self.draft_next
        return self.draft_step + (gamma - 1) * nxt

    def to_json(self, node: str) -> str:
        """What a serving node publishes for the gate (the registered model's `serving.profile` tag)."""
        return json.dumps({**asdict(self), "node": node, "time": time.time()})

    @classmethod
    def from_json(cls, raw: str) -> StepProfile:
        d = json.loads(raw)
        total, nxt = d.get("draft_total"), d.get("draft_next")
        return cls(
            int(d["batch_size"]),
            {int(k): float(v) for k, v in d["target"].items()},
            float(d["draft_step"]),
            float(d.get("overhead", 0.0)),
            None if total is None else float(total),
            None if nxt is None else float(nxt),
        )

    def speedup(self, alphas: list[float], gamma: int) -> float:
        return self.speedup_at(expected_tokens(alphas, gamma), gamma)

    def speedup_at(self, tau: float, gamma: int) -> float:
        """Predicted speedup over no speculation for tau tokens per step at gamma draft tokens."""
        if gamma == 0:
            return 1.0
        t1 = self.target[1] + self.overhead
        draft = self.draft_total if self.draft_total is not None else self.drafting(gamma)
        c_gamma = draft / t1
        beta = (self.target[gamma + 1] + self.overhead) / t1
        return tau / (c_gamma + beta)


def measure_profile(
    model: LlamaModel,
    draft: Eagle3Draft | None,
    batch_size: int,
    context: int,
    max_tokens: int,
    repeats: int = 9,
) -> StepProfile:
    """Time target forwards of 1..max_tokens tokens per sequence and one draft step, at `context`
    positions, in `repeats` rounds (`time_rounds`), and estimate the profile from them
    (`profile_from_rounds`)."""
    times = time_rounds(model, draft, batch_size, context, max_tokens, repeats)
    return profile_from_rounds(times, batch_size, max_tokens)


def profile_from_rounds(times: dict[str, list[float]], batch_size: int, max_tokens: int) -> StepProfile:
    """What decides whether speculation pays is each time's ratio to a one-token step, so each is the
    median over rounds of its ratio to its own round's one-token step, times the median one-token
    step: contention that slows a whole round then cancels, and a burst within one counts as one bad
    draw. Per-size medians of three rounds had turned a code draft off in a test
    (`scripts/profile_noise.py` compares the two)."""
    one = statistics.median(times["1"])
    median = {
        k: one * statistics.median(t / u for t, u in zip(v, times["1"], strict=True))
        for k, v in times.items()
    }
    target = {n: median[str(n)] for n in range(1, max_tokens + 1)}
    if "draft" not in median:
        return StepProfile(batch_size, target, 0.0)
    first = median["draft"]
    chain = max(2, max_tokens - 1)
    return StepProfile(
        batch_size, target, first, draft_next=max(0.0, (median["chain"] - first) / (chain - 1))
    )


@torch.inference_mode()
def time_rounds(
    model: LlamaModel,
    draft: Eagle3Draft | None,
    batch_size: int,
    context: int,
    max_tokens: int,
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds per round of a target forward of n = 1..max_tokens tokens per sequence (keys "1",
    "2", ...) and, with a draft, one draft step ("draft") and a chain of max_tokens - 1 steps
    ("chain"), each timed once a round, so a burst of contention slows a round's sizes alike. The
    draft is timed as the engine runs it, right after a target forward (the steps of a chain after
    the first find its weights in cache)."""
    cap = context + max_tokens + 2
    cache = model.new_cache(batch_size, cap)
    runs: dict[str, Callable[[], object]] = {}
    for n in range(1, max_tokens + 1):
        tokens = torch.randint(0, model.cfg.vocab_size, (batch_size, n))
        pos = context + torch.arange(n).repeat(batch_size, 1)
        batch = Batch.make(0, pos, None, cap)
        runs[str(n)] = partial(_target_step, model, tokens, batch, cache)
    if draft is not None:
        dcache = draft.new_cache(batch_size, cap, model.dtype)
        hidden = torch.randn(batch_size, 1, model.cfg.hidden_size, dtype=model.dtype)
        tokens = torch.randint(0, model.cfg.vocab_size, (batch_size, 1))
        batch = Batch.make(0, torch.full((batch_size, 1), context), None, cap)
        step = partial(_draft_step, draft, hidden, tokens, batch, dcache)
        runs["draft"] = step
        runs["1-again"] = runs["1"]  # so the chain, too, starts after a target forward
        runs["chain"] = partial(_repeat, step, max(2, max_tokens - 1))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for k, run in runs.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    return times


def _repeat(run: Callable[[], object], n: int) -> None:
    for _ in range(n):
        run()


def _target_step(model: LlamaModel, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> None:
    model.logits(model(tokens, batch, cache, True).hidden).argmax(-1)


def _draft_step(
    draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor, batch: Batch, cache: DraftKV
) -> None:
    draft.logits(draft(hidden, tokens, batch, cache)).argmax(-1)
