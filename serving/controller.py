"""The runtime controller: speculate only where it pays, and choose gamma at every step. Four rules:

- **Estimate.** Per workload and draft depth, discounted counts of the drafts that reached the depth
  and were accepted there. Each sequence-step of the workload, drafted or not, multiplies them by
  1 - 1/`horizon`: evidence ages with traffic, not attempts, so a workload that is off soon learns
  from its checks alone. A depth's rate is shrunk towards the one above (few chains reach deep).
- **Change point.** A two-sided Bernoulli CUSUM on the first depth's outcomes tests the estimate p
  against a fall to p(1 - `shift`) and a rise to 1 - (1 - p)(1 - `shift`). Outcomes come in bursts
  (a stretch of boilerplate, then a hard one), so each step's log-likelihood ratio is divided by
  their measured overdispersion (a quasi-likelihood): the variance of `BLOCK` outcomes' sum over
  the binomial's, at least 1. Past `threshold` nats the traffic, or the draft's fit to it, changed:
  the counts restart from the attempts since that side last stood at zero (the change's estimated
  start), plus a prior at the rate it tested for.
- **Choice.** gamma = argmax_g tau(g) T(b, 0) / T(b, g) over the batch's rows, tau from the estimates
  and T from step times measured on this machine (`cost_model.StepCosts`); 0 unless the best beats
  `min_gain`: a pure function of estimates and costs (`choose_gamma`).
- **Exploration.** A step drafts one token deeper than chosen (one while off) once `explore_share`
  of each step's predicted time, banked, covers its predicted extra time; its measured extra time
  (a check while off also catches the draft up) is then paid: checks cost that share of serving.

A new draft starts from what the gate measured of it on recent traffic, else from an optimistic
prior so that it gets tried. A workload calls for training once its draft has not paid, or has
stayed below a fall the detector found, for `confirm_steps` sequence-steps: one hard request is not.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.models.llama import LlamaModel
from tide.registry.profile import StepProfile, alphas_from_taus, expected_tokens
from tide.serving.cost_model import StepCosts, measure_profile

PRIOR_ALPHA = 0.5  # a draft nobody measured: optimistic enough to be tried
PRIOR_WEIGHT = 8.0  # pseudo-attempts a prior counts for: one unlucky first step must not shut a depth off
BLOCK = 16  # first-depth outcomes per sum the overdispersion is measured on: a few dozen make a change


@dataclass
class ControllerConfig:
    max_gamma: int = 6
    horizon: float = 1024.0  # sequence-steps for evidence to fade to 1/e: many requests, not one
    shift: float = 0.5  # the change the detector looks for: half the way to 0 or to 1
    threshold: float = 6.0  # nats for a change: at a rate of 0.67 and no bursts, about nine misses in a row
    explore_share: float = 0.01  # of serving time spent drafting deeper than chosen, at most
    min_gain: float = 1.02  # speculate only above this predicted speedup (the estimates are noisy)
    confirm_steps: int = 384  # not paying, or below a fall, this long: the workload needs training
    stop_below: float = 0.0  # > 0: a chain ends once the draft's belief in it falls below, in every row


@dataclass
class Acceptance:
    """One workload's acceptance evidence by depth, its change detector, and its call for training."""

    cfg: ControllerConfig
    reached: list[float] = field(init=False)
    accepted: list[float] = field(init=False)
    # the detector: per side (0: fall, 1: rise), its statistic and the counts since it stood at zero
    cusum: list[float] = field(init=False)
    since: list[list[list[int]]] = field(init=False)
    fell_from: float | None = None  # the first-depth rate before the last fall the detector found
    needed_for: int = 0  # sequence-steps on end the draft has not paid or stayed below a fall
    dispersion: float = 1.0  # variance of a block's first-depth sum over the binomial's (used >= 1)
    blocks: int = 0  # blocks measured
    # the block being filled (attempts, accepted); it runs on across restarts, which come at bursts:
    # dropping the blocks they cut would hide the bursts from the measure
    block: list[int] = field(default_factory=lambda: [0, 0])

    def __post_init__(self) -> None:
        self.start_from([])

    def start_from(self, prior: list[float]) -> None:
        """A new draft: PRIOR_WEIGHT pseudo-attempts at each rate given (none: PRIOR_ALPHA at depth 1)."""
        given = prior[: self.cfg.max_gamma] or [PRIOR_ALPHA]
        rest = [0.0] * (self.cfg.max_gamma - len(given))
        self._restart([PRIOR_WEIGHT] * len(given) + rest, [PRIOR_WEIGHT * a for a in given] + rest)
        self.fell_from, self.needed_for = None, 0

    def _restart(self, reached: list[float], accepted: list[float]) -> None:
        self.reached, self.accepted, self.cusum = reached, accepted, [0.0, 0.0]
        self.since = [[[0] * self.cfg.max_gamma for _ in range(2)] for _ in range(2)]

    def alphas(self) -> list[float]:
        n, k = self.reached[0], self.accepted[0]
        out = [k / n if n > 1e-6 else PRIOR_ALPHA]
        for n, k in zip(self.reached[1:], self.accepted[1:], strict=True):  # shrunk towards the depth above
            out.append((k + PRIOR_WEIGHT * out[-1]) / (n + PRIOR_WEIGHT))
        return out

    def tau(self, gamma: int) -> float:
        return expected_tokens(self.alphas(), gamma)

    def update(self, counts: list[int], gamma: int) -> None:
        """A step's accepted counts for this workload's rows at `gamma` drafted tokens (0: a plain step)."""
        decay = (1.0 - 1.0 / self.cfg.horizon) ** len(counts)
        self.reached = [n * decay for n in self.reached]
        self.accepted = [k * decay for k in self.accepted]
        if gamma == 0:
            return
        reached = [sum(1 for a in counts if a >= d) for d in range(gamma)]
        accepted = [sum(1 for a in counts if a > d) for d in range(gamma)]
        self._detect(reached, accepted)
        for d, (n, k) in enumerate(zip(reached, accepted, strict=True)):
            self.reached[d], self.accepted[d] = self.reached[d] + n, self.accepted[d] + k

    def _measure_dispersion(self, p: float, n: int, k: int) -> None:
        """Fold a step's first-depth outcomes into the block; a full block's squared deviation over
        its binomial variance into the mean: a plain mean (the no-burst 1 counting as four blocks)
        until it ages over `horizon` outcomes. It ages with outcomes only: while off it keeps the
        traffic's burstiness as last measured (fading it then measured worse: `docs/experiments.md`)."""
        self.block = [self.block[0] + n, self.block[1] + k]
        m, j = self.block
        if m < BLOCK:
            return
        self.blocks += 1
        ratio = (j - m * p) ** 2 / (m * p * (1 - p))
        self.dispersion += (ratio - self.dispersion) * max(m / self.cfg.horizon, 1 / (self.blocks + 4))
        self.block = [0, 0]

    def _detect(self, reached: list[int], accepted: list[int]) -> None:
        p = min(max(self.alphas()[0], 0.01), 0.99)
        n, k = reached[0], accepted[0]
        self._measure_dispersion(p, n, k)
        keep, phi = 1.0 - self.cfg.shift, max(1.0, self.dispersion)
        for side, q in enumerate((p * keep, 1.0 - (1.0 - p) * keep)):
            self.cusum[side] += (k * math.log(q / p) + (n - k) * math.log((1 - q) / (1 - p))) / phi
            counts = self.since[side]
            for d, (n_d, k_d) in enumerate(zip(reached, accepted, strict=True)):
                counts[0][d], counts[1][d] = counts[0][d] + n_d, counts[1][d] + k_d
            if self.cusum[side] <= 0.0:
                self.cusum[side], self.since[side] = 0.0, [[0] * self.cfg.max_gamma for _ in range(2)]
            elif self.cusum[side] > self.cfg.threshold:
                r, a = ([float(x) for x in c] for c in counts)
                r[0], a[0] = r[0] + PRIOR_WEIGHT, a[0] + PRIOR_WEIGHT * q
                self._restart(r, a)
                self.fell_from = p if side == 0 else None
                return

    @property
    def shifted(self) -> bool:
        """Below a fall the detector found, nearer the level it fell to than the one it fell from
        (else it recovered: a hard stretch, not a shift)."""
        fell = self.fell_from is not None and self.alphas()[0] < self.fell_from * (1.0 - self.cfg.shift / 2)
        self.fell_from = self.fell_from if fell else None
        return fell


def choose_gamma(taus: list[float], b: int, costs: StepCosts, min_gain: float) -> tuple[int, float]:
    """The gamma, and its predicted speedup, that maximise tokens per second for b sequences that
    yield taus[g] tokens per step on average at gamma g. 0 (at 1.0) unless one beats `min_gain`."""
    plain = costs.step_time(b, 0)
    speedups = [1.0] + [taus[g] * plain / costs.step_time(b, g) for g in range(1, len(taus))]
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return (best, speedups[best]) if b and speedups[best] >= min_gain else (0, 1.0)


@dataclass
class GammaChoice:
    gamma: int
    predicted_speedup: float
    explore: bool = False


class Controller:
    def __init__(self, cfg: ControllerConfig, profiles: list[StepProfile], context: int = 256):
        self.cfg = cfg
        self.costs = StepCosts(profiles)
        self.context = context  # positions of context its step times were measured at
        self.acceptance: dict[str, Acceptance] = {}
        self.banked = 0.0  # seconds of exploration earned and not yet spent
        self.last = GammaChoice(0, 1.0)
        self.measured_speedup = 1.0  # moving average of measured tokens/s over plain decoding's
        self.batch_size = 1  # of the last decode step: per-workload decisions are judged at it
        self._lock = threading.Lock()  # readers (metrics, admin) take snapshots

    def tracker(self, workload: str) -> Acceptance:
        if workload not in self.acceptance:
            self.acceptance[workload] = Acceptance(self.cfg)
        return self.acceptance[workload]

    def best(self, workloads: list[str]) -> GammaChoice:
        b, taus = len(workloads), [0.0] * (self.cfg.max_gamma + 1)
        for w, n in Counter(workloads).items():
            rates = self.tracker(w).alphas()
            taus = [t + n / b * expected_tokens(rates, g) for g, t in enumerate(taus)]
        return GammaChoice(*choose_gamma(taus, b, self.costs, self.cfg.min_gain))

    def choose(self, workloads: list[str]) -> GammaChoice:
        """The gamma of the next step for a batch of these workloads (one entry per sequence)."""
        d, b = self.best(workloads), len(workloads)
        if b and d.gamma < self.cfg.max_gamma:
            now, deeper = self.costs.step_time(b, d.gamma), self.costs.step_time(b, d.gamma + 1)
            # banked up to one check's worth: checks never come in bursts
            self.banked = min(self.banked + self.cfg.explore_share * now, deeper - now)
            if self.banked >= deeper - now:
                d = GammaChoice(d.gamma + 1, d.predicted_speedup, explore=True)
        self.last = d
        return d

    def observe(self, workloads: list[str], accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        """After a step: acceptance of each workload's rows, and the step's measured time."""
        b = self.batch_size = len(workloads)
        if self.last.explore and gamma == self.last.gamma:  # a check: pay what it cost
            self.banked -= seconds - self.costs.step_time(b, gamma - 1)
        self.costs.observe(b, gamma, seconds)
        counts: list[int] = accepted.tolist() if gamma > 0 else [0] * b
        measured = (sum(counts) + b) * self.costs.step_time(b, 0) / b / seconds
        self.measured_speedup += (measured - self.measured_speedup) / self.costs.horizon
        rows: dict[str, list[int]] = {}
        for w, n in zip(workloads, counts, strict=True):
            rows.setdefault(w, []).append(n)
        with self._lock:
            for w, sub in rows.items():
                acc = self.tracker(w)
                acc.update(sub, gamma)
                needed = acc.shifted or self.best([w] * b).gamma == 0
                acc.needed_for = acc.needed_for + len(sub) if needed else 0

    def measure_costs(self, model: LlamaModel, draft: Eagle3Draft | None) -> None:
        """Step times measured again, at the same batch sizes and context, as the target and draft
        run now; the running correction starts over with them."""
        sizes = tuple(p.batch_size for p in self.costs.profiles)
        self.costs = StepCosts(measure_profiles(model, draft, sizes, self.context, self.cfg.max_gamma + 1))

    def draft_changed(self, workloads: list[str], expected: dict[int, float] | None = None) -> None:
        """A new draft serves these workloads: it starts from `expected` (tau by gamma, as the gate
        measured it on recent traffic), not from what was learnt of the old one."""
        prior = alphas_from_taus(expected) if expected else []
        with self._lock:
            for w in workloads:
                self.tracker(w).start_from(prior)

    # -- what the rest of the node reads ------------------------------------------------------
    def pays(self, workload: str, batch_size: int | None = None) -> bool:
        """Does this workload's draft pay on its own at this batch size (default: the current one)?"""
        return self.best([workload] * (batch_size or self.batch_size)).gamma > 0

    def shifted(self, workload: str) -> bool:
        """The detector found a fall in this workload's acceptance, and it has not recovered."""
        return self.tracker(workload).shifted

    def needs_training(self, workload: str) -> bool:
        """Not paying, or below a fall, for `confirm_steps` sequence-steps on end."""
        return self.tracker(workload).needed_for >= self.cfg.confirm_steps

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            gammas = {w: self.best([w] * self.batch_size).gamma for w in list(self.acceptance)}
            return {
                w: {
                    "alpha": [round(a, 4) for a in acc.alphas()],
                    "evidence": round(acc.reached[0], 1),  # first-depth attempts the estimate stands on
                    "tau": round(acc.tau(gammas[w] or 1), 4),
                    "gamma": gammas[w],
                    "speculation": gammas[w] > 0,
                    "shifted": acc.shifted,
                    "needs_training": self.needs_training(w),
                }
                for w, acc in list(self.acceptance.items())
            }


def build_controller(
    model: LlamaModel, draft: Eagle3Draft | None, cfg: ControllerConfig, max_batch: int,
    batch_sizes: tuple[int, ...] = (1, 4, 16), context: int = 256,
) -> Controller:  # fmt: skip
    """Measure step times at a few batch sizes on this machine, now, and start a controller on them."""
    sizes = tuple(sorted({min(b, max_batch) for b in batch_sizes}))
    return Controller(cfg, measure_profiles(model, draft, sizes, context, cfg.max_gamma + 1), context)


def measure_profiles(
    model: LlamaModel, draft: Eagle3Draft | None, batch_sizes: tuple[int, ...], context: int, max_tokens: int
) -> list[StepProfile]:
    """Step times at each batch size, as the target and the draft run now (five rounds:
    `scripts/profile_noise.py` found three too few for the ratios that decide)."""
    return [measure_profile(model, draft, b, context, max_tokens, repeats=5) for b in batch_sizes]
