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
    draft_step: float
    # what an engine step costs beyond the target forward (sampling, bookkeeping), and the measured
    # cost of drafting gamma tokens the way the engine does it (catch-up + chain); 0 / None: unknown
    overhead: float = 0.0
    draft_total: float | None = None

    def to_json(self, node: str) -> str:
        """What a serving node publishes for the gate (the registered model's `serving.profile` tag)."""
        return json.dumps({**asdict(self), "node": node, "time": time.time()})

    @classmethod
    def from_json(cls, raw: str) -> StepProfile:
        d = json.loads(raw)
        total = d.get("draft_total")
        return cls(
            int(d["batch_size"]),
            {int(k): float(v) for k, v in d["target"].items()},
            float(d["draft_step"]),
            float(d.get("overhead", 0.0)),
            None if total is None else float(total),
        )

    def speedup(self, alphas: list[float], gamma: int) -> float:
        return self.speedup_at(expected_tokens(alphas, gamma), gamma)

    def speedup_at(self, tau: float, gamma: int) -> float:
        """Predicted speedup over no speculation for tau tokens per step at gamma draft tokens."""
        if gamma == 0:
            return 1.0
        t1 = self.target[1] + self.overhead
        draft = self.draft_total if self.draft_total is not None else self.draft_step * gamma
        c_gamma = draft / t1
        beta = (self.target[gamma + 1] + self.overhead) / t1
        return tau / (c_gamma + beta)


@torch.inference_mode()
def measure_profile(
    model: LlamaModel,
    draft: Eagle3Draft | None,
    batch_size: int,
    context: int,
    max_tokens: int,
    repeats: int = 9,
) -> StepProfile:
    """Time target forwards of 1..max_tokens tokens per sequence and one draft step, at `context`
    positions: the median of `repeats` rounds, each timing every one of them once. A burst of
    contention (a process starting beside the node) then slows every size alike instead of a few,
    and the ratios between them, which decide whether speculation pays, stay right."""
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
        runs["draft"] = partial(_draft_step, draft, hidden, tokens, batch, dcache)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for k, run in runs.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    target = {n: median[str(n)] for n in range(1, max_tokens + 1)}
    draft_step = median.get("draft", 0.0)
    return StepProfile(batch_size, target, draft_step)


def _target_step(model: LlamaModel, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> None:
    model.logits(model(tokens, batch, cache, True).hidden).argmax(-1)


def _draft_step(
    draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor, batch: Batch, cache: DraftKV
) -> None:
    draft.logits(draft(hidden, tokens, batch, cache)).argmax(-1)
