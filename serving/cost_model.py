"""The cost model's step times: measured as a `StepProfile` on the machine that serves, never assumed
(target forwards of 1..n tokens per sequence and the draft's steps, timed in rounds), then followed
while serving (`StepCosts`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tide.models.eagle3 import DraftKV, Eagle3Draft
from tide.models.llama import Batch, KVCache, LlamaModel
from tide.registry.profile import StepProfile


class StepCosts:
    """Step times by batch size: measured profiles (the shape: how cost grows with gamma), scaled by
    one factor per profile that follows the engine's measured step times (the machine got busier)."""

    horizon = 32.0  # steps averaged into the measured/profiled ratio

    def __init__(self, profiles: list[StepProfile]):
        self.profiles = sorted(profiles, key=lambda p: p.batch_size)
        self.ratio = [1.0] * len(self.profiles)  # measured / profiled, per profile

    def _index(self, b: int) -> int:
        """The profile measured at the smallest batch size >= b (the largest if none)."""
        return next((i for i, p in enumerate(self.profiles) if p.batch_size >= b), len(self.profiles) - 1)

    def _profiled(self, b: int, gamma: int) -> float:
        p = self.profiles[self._index(b)]
        # past the largest measured batch, time grows in proportion to the batch
        return (p.target[gamma + 1] + p.drafting(gamma)) * max(1.0, b / p.batch_size)

    def step_time(self, b: int, gamma: int) -> float:
        """Predicted seconds of one engine step for b sequences drafting gamma tokens."""
        return self._profiled(b, gamma) * self.ratio[self._index(b)]

    def verify_costs(self, b: int) -> list[float]:
        """A target pass over k + 1 tokens per sequence (nothing drafted), relative to one token's,
        for each k the profile measured: what a proposal from the suffix index costs."""
        p = self.profiles[self._index(b)]
        return [p.target[n] / p.target[1] for n in sorted(p.target)]

    def observe(self, b: int, gamma: int, seconds: float) -> None:
        i = self._index(b)
        self.ratio[i] += (seconds / self._profiled(b, gamma) - self.ratio[i]) / self.horizon


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
    draft.step(hidden, tokens, batch, cache, torch.zeros(hidden.shape[0], dtype=torch.long))[1].argmax(-1)
