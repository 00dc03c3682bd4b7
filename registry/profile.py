"""A serving node's measured step times, and the speedup they predict: the TIDE paper's cost model,
generalised to per-depth acceptance.

speedup(gamma) = tau(gamma) / (c * gamma + beta), with tau(gamma) = 1 + sum_k prod_{i<=k} alpha_i
the tokens one target step yields, c = draft step time / target step time and
beta = T(b * (gamma + 1)) / T(b): the cost of verifying gamma+1 tokens per sequence relative to
decoding one. Nodes publish their profile as the registered model's `serving.profile` tag
(`to_json`); the gate scores drafts with it (`from_json`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass


def expected_tokens(alphas: list[float], gamma: int) -> float:
    tau, alive = 1.0, 1.0
    for a in alphas[:gamma]:
        alive *= a
        tau += alive
    return tau


def alphas_from_taus(taus: dict[int, float]) -> list[float]:
    """Per-depth acceptance from tau at gamma = 1, 2, ... (the inverse of
    `expected_tokens`: tau(g) - tau(g-1) = alpha_1 * ... * alpha_g)."""
    out: list[float] = []
    prev_tau, alive = 1.0, 1.0
    for g in range(1, max(taus, default=0) + 1):
        if g not in taus:
            break
        a = min(max(max(taus[g] - prev_tau, 0.0) / alive, 0.01), 0.99)  # a measured 0 or 1 is a small sample
        out.append(a)
        prev_tau, alive = taus[g], alive * a
    return out


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
