"""The runtime controller: speculate only where it pays, and choose gamma at every step.

Per workload it tracks the acceptance rate at each draft depth with a short and a long moving
average (expected tokens per step = 1 + sum_k prod_{i<=k} alpha_i). Step times come from
profiles measured at start-up at a few batch sizes (the target's forward for 1..max_gamma+1
tokens per sequence, one draft step), corrected while serving by the engine's measured step
times. Each step it picks the gamma that maximises the running batch's predicted speedup, and 0
when none beats plain decoding. One step in `explore_every` drafts one token more than chosen (while
speculation is off, one token in `explore_off_every` steps, rarer still far from paying), so the
estimates stay current: speculation comes back as soon as a draft pays, and a depth that looked bad
once is tried again (a check while off counts for the steps it stands for, but speculation comes
back only when it pays on rates less half a standard error of the checks they stand on). A new draft starts
from what the gate measured of it on recent traffic; one swapped back in soon after it left takes
up what was measured of it live.

Gamma is chosen from the long average: acceptance swings from request to request, and a short
average mostly chases that noise (on code it drafted one token a third of the time and served 4%
slower than a fixed gamma of 3). The short average falling well below the long one is the paper's
shift detector: the workload's traffic changed under its draft, the short average drops to a very
short one, and gamma follows it at once; so it does while the short one stands well above the long
one (a draft that fits came back, or a lucky stretch: then each rate is at most the very short
one's, so a stretch that ended is followed at once too), and while the very short one stands far
below whichever decides (a collapse: the detector needs about 50 steps to see one). When the
detector, or the workload's draft not paying, has held for `confirm_steps` (hard stretches of
traffic fire the detector too, for up to a few requests), the `capture.TrainingAdvisor` turns
capture (and so training) on; a shift that held that long is for good, and the long average starts
again from the short one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.models.llama import LlamaModel
from tide.registry.profile import StepProfile
from tide.serving.cost_model import measure_profile

PRIOR_ALPHA = 0.5  # before any observation: optimistic enough that a new draft gets tried
# the prior counts as this many observations: one unlucky first step must not shut a depth off for good
PRIOR_WEIGHT = 8
FALL_MIN_SEEN = 16  # first-depth attempts before the very short average may say acceptance collapsed


@dataclass
class ControllerConfig:
    max_gamma: int = 6
    # horizon of the short average, in drafted sequence-steps: about one request (acceptance varies
    # from request to request; a shorter one sees shifts in single hard requests)
    short_steps: float = 128.0
    long_steps: float = 1024.0
    # a third, very short average: when the shift detector fires, the short one drops to it, so
    # gamma follows a collapsed acceptance within a few dozen steps instead of about a request
    recent_steps: float = 16.0
    # while on: one step in this many drafts one token deeper than chosen, so the acceptance of the
    # next depth stays known; while off, one step in `explore_off_every` drafts one token (each such
    # step costs about an eighth of a plain one: the draft catches up on the steps it skipped)
    explore_every: int = 16
    explore_off_every: int = 32
    explore_far_every: int = 128  # while off and predicted below `far_below` even at gamma 1
    far_below: float = 0.9
    min_gain: float = 1.02  # speculate only above this predicted speedup
    # while off, speculation comes back only if it pays on the rates less this many standard errors
    # of what they stand on: a check stands for up to 32 steps, so a few lucky ones lifted French's
    # first-depth rate on the code draft from 0.05 to 0.16-0.21 and turned gamma 1 on at a loss
    # (ABA22: windows at 0.96-0.98x). Replayed on ABA22's requests (scripts/controller_trace_sim.py)
    # half of one changed nothing measurable next to the rise rule (`deciding`), and a whole one cost
    # code coming back on its draft 1.3% (1.708x against 1.731x)
    resume_doubt: float = 0.5
    # > 0: gamma is the longest chain, which stops early once the draft's probability of the chain so
    # far is below this in every row. Off: simulated with verify cost linear in its width it gained 6%
    # on code, but live on this CPU (verifying 2 tokens dearer than 3 to 6) it lost 6% at 0.1, and
    # the rates of the depths it reaches on confident chains only make the controller choose deeper
    # (scripts/gamma_ab.py --stops 0.1,0)
    stop_below: float = 0.0
    shift_drop: float = 0.3  # short tau - 1 this far below long tau - 1: the workload shifted
    # very short tau - 1 below this share of the deciding average's: the acceptance collapsed (a
    # shift, or a hard request after an easy one), and each depth's rate is at most its very short
    # one's until it recovers. The detector needs about 50 steps, drafting 4-6 deep at a first-depth
    # rate of 0.03 meanwhile: ABA24's shift window ran at 0.947x, and a new French draft's at 0.934x
    fall_drop: float = 0.5
    # and its first-depth rate this many standard errors (of the very short average, at the deciding
    # rate) below the deciding one: at a first-depth rate of 0.3, noise alone fell below half often
    # enough to turn a marginal draft off for a hundred steps at a time (one check in 32 brings it back)
    fall_z: float = 3.0
    cost_horizon: float = 32.0  # steps averaged into the measured/predicted step-time ratio
    # a draft swapped out this recently and back in (a rollback, a quick recall) takes up what was
    # measured of it live: more current, and from far more positions, than the gate's measurement
    remember_seconds: float = 120.0
    # sequence-steps the detector (or a draft that stopped paying) must hold before the workload
    # calls for training. On code with the code draft it fired four times in 89 requests, for 90 to
    # 421 steps (hard stretches), and each firing started capture over; a shift holds until the
    # long average has caught up, and a draft that stopped paying until it pays again
    confirm_steps: int = 384


def _ema_weight(horizon: float, n: int) -> float:
    """Weight of n new observations in an average over about `horizon` observations."""
    return 1.0 - (1.0 - 1.0 / horizon) ** n


def _evidence(before: float, weight: float, n: int) -> float:
    """Observations a moving average stands on after n more enter it with `weight`: the mean of
    that many has its variance (n / weight per update once steady; the plain count while it is a mean)."""
    return 1.0 / ((1.0 - weight) ** 2 / before + weight**2 / n)


@dataclass
class Acceptance:
    """A workload's acceptance rate by draft depth, short and long averages."""

    max_gamma: int
    short: list[float] = field(init=False)
    long: list[float] = field(init=False)
    recent: list[float] = field(init=False)
    shifted: bool = field(init=False)  # the detector's verdict after the last update
    # short and long disagree by a shift's margin, either way: gamma follows the short one
    moved: bool = field(init=False)
    seen: list[int] = field(init=False)  # attempts observed at each depth
    # attempts observed at each depth since the draft or the traffic last changed: a deeper depth's
    # rate from before then is the old traffic's (a draft that misses its first token rarely reaches
    # the deeper ones, so they keep it for thousands of steps)
    fresh: list[int] = field(init=False)
    known: int = field(init=False)  # depths with a rate of their own (observed or given)
    # steps (with what checks stand for) since it last shifted or paid: how long training was called for
    needed_for: int = field(init=False)
    # observations each depth's short and long averages stand on, as a mean's variance goes: a
    # check while off weighs like the steps it stands for, but it is one draw
    evidence_short: list[float] = field(init=False)
    evidence_long: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self, prior: list[float] | None = None) -> None:
        """Forget what was observed; `prior`: per-depth rates to start from (else PRIOR_ALPHA)."""
        self.short = [PRIOR_ALPHA] * self.max_gamma
        self.known = 1  # deeper depths take the last known one's rate
        for d, a in enumerate((prior or [])[: self.max_gamma]):
            self.short[d] = a
            self.known = d + 1
        self.long = list(self.short)
        self.recent = list(self.short)
        self.seen = [0] * self.max_gamma
        # a prior measured on current traffic (the gate's) is no old traffic's rate: it counts as
        # PRIOR_WEIGHT attempts (pulled down to the next depth up from scratch, a replay of ABA17's
        # French requests lost 3% on a swapped-in draft whose gate-measured depths stayed unused)
        self.fresh = [PRIOR_WEIGHT if d < len(prior or []) else 0 for d in range(self.max_gamma)]
        self.shifted = self.moved = False
        self.needed_for = 0
        self.evidence_short = [float(PRIOR_WEIGHT)] * self.max_gamma
        self.evidence_long = [float(PRIOR_WEIGHT)] * self.max_gamma

    def update(
        self, accepted: list[int], gamma: int, short_h: float, long_h: float, recent_h: float, span: int = 1
    ) -> None:
        """One step's accepted counts (one per sequence) at `gamma` drafted tokens, standing for
        `span` steps. Plain Python floats: at a handful of depths, tensor element writes cost more
        than the arithmetic."""
        for d in range(gamma):
            n = sum(1 for a in accepted if a >= d)  # sequences whose draft reached depth d
            if n == 0:
                break
            if d >= self.known:  # a depth seen for the first time starts from the one above
                self.known = d + 1
                self.short[d], self.long[d], self.recent[d] = (
                    self.short[d - 1],
                    self.long[d - 1],
                    self.recent[d - 1],
                )
            rate = sum(1 for a in accepted if a > d) / n
            # a mean with the prior until the horizon is reached: the prior must not linger in the long average
            first = n / (self.seen[d] + n + PRIOR_WEIGHT)
            ws, wl = max(first, _ema_weight(short_h, n * span)), max(first, _ema_weight(long_h, n * span))
            self.short[d] += ws * (rate - self.short[d])
            self.long[d] += wl * (rate - self.long[d])
            self.recent[d] += max(first, _ema_weight(recent_h, n * span)) * (rate - self.recent[d])
            self.evidence_short[d] = _evidence(self.evidence_short[d], ws, n)
            self.evidence_long[d] = _evidence(self.evidence_long[d], wl, n)
            self.seen[d] += n
            self.fresh[d] += n

    def adopt_short(self) -> None:
        """The shift held: the traffic changed for good, and the long average starts again from the
        short one. Else it would keep the old traffic's rates for thousands of steps (while off it
        learns only from checks) and choose gamma on them once the detector lets go: ABA22 drafted
        French at gamma 1 on a long first-depth rate of 0.19, left from code, against 0.05 measured."""
        self.long = list(self.short)
        self.evidence_long = list(self.evidence_short)

    def mark_shift(self) -> None:
        """The detector fired: the short average drops to the very short one, and the deeper
        depths' rates count as the old traffic's until observed again."""
        self.short = [min(s, r) for s, r in zip(self.short, self.recent, strict=True)]
        self.fresh = [0] * self.max_gamma

    def alphas(self, which: str = "short", current: bool = False, doubt: float = 0.0) -> list[float]:
        """Per-depth rates; a depth never observed takes the last observed one's (rates decay with depth).
        `current`: what gamma is chosen on; a deeper depth's rate from before the last change is pulled
        down to the depth above's, less so with each attempt observed since (PRIOR_WEIGHT: half way).
        `which`: "short", "long", "recent" (the very short one), or "rose" and "fell" (each
        depth's short rate, at most its very short one).
        `doubt`: each rate less this many standard errors of the observations it stands on."""
        src = self.long if which == "long" else self.recent if which == "recent" else self.short
        if which in ("rose", "fell"):
            src = [min(s, r) for s, r in zip(self.short, self.recent, strict=True)]
        evidence = self.evidence_long if which == "long" else self.evidence_short
        out: list[float] = []
        for d in range(self.max_gamma):
            a = src[d] if d < self.known else out[-1]
            if doubt and d < self.known:
                a = max(0.0, a - doubt * (a * (1.0 - a) / evidence[d]) ** 0.5)
            if current and d > 0:
                w = self.fresh[d] / (self.fresh[d] + PRIOR_WEIGHT)
                a = w * a + (1.0 - w) * min(a, out[-1])
            out.append(a)
        return out

    def deciding(self, cfg: ControllerConfig | None = None) -> str:
        """The average gamma is chosen from: the long one, or the short one while they disagree by
        a shift's margin. While the short one stands above ("rose": a draft that fits came back, or
        a lucky stretch), no more than the very short one either: ABA23 turned French on at gamma 1
        on a short first-depth rate of 0.21 and drafted 89% of a window at 0.95x while it fell.
        So too ("fell", given `cfg`) while the very short one's tau - 1 is below `cfg.fall_drop` of
        the chosen one's, and its first-depth rate below the chosen one's by more than its noise."""
        which = "long" if not self.moved else "short" if self.shifted else "rose"
        if cfg is None or not cfg.fall_drop or which == "rose" or self.seen[0] < FALL_MIN_SEEN:
            return which
        a = self.alphas(which)[0]
        noise = cfg.fall_z * (a * (1.0 - a) / (2.0 * cfg.recent_steps - 1.0)) ** 0.5  # an EMA's variance
        g = self.max_gamma
        if self.recent[0] < a - noise and self.tau(g, "recent") - 1 < cfg.fall_drop * (
            self.tau(g, which) - 1
        ):
            return "fell"
        return which

    def tau(self, gamma: int, which: str = "short") -> float:
        tau, alive = 1.0, 1.0
        for a in self.alphas(which)[:gamma]:
            alive *= a
            tau += alive
        return tau


def alphas_from_taus(taus: dict[int, float]) -> list[float]:
    """Per-depth acceptance from tau at gamma = 1, 2, ... (tau(g) - tau(g-1) = alpha_1 * ... * alpha_g)."""
    out: list[float] = []
    prev_tau, alive = 1.0, 1.0
    for g in range(1, max(taus, default=0) + 1):
        if g not in taus:
            break
        gain = max(taus[g] - prev_tau, 0.0)
        a = min(max(gain / alive, 0.01), 0.99)  # a measured 0 or 1 is a small sample, not a certainty
        out.append(a)
        prev_tau, alive = taus[g], alive * a
    return out


class StepCosts:
    """Step times by batch size: measured profiles (the shape: how cost grows with gamma), scaled by
    one factor per profile that follows the engine's measured step times (the machine got busier)."""

    def __init__(self, profiles: list[StepProfile], horizon: float):
        self.profiles = sorted(profiles, key=lambda p: p.batch_size)
        self.horizon = horizon
        self.ratio = [1.0] * len(self.profiles)  # measured / profiled, per profile

    def _index(self, b: int) -> int:
        """The profile measured at the smallest batch size >= b (the largest if none)."""
        for i, p in enumerate(self.profiles):
            if p.batch_size >= b:
                return i
        return len(self.profiles) - 1

    def _profiled(self, b: int, gamma: int) -> float:
        p = self.profiles[self._index(b)]
        t = p.target[gamma + 1] + p.drafting(gamma)
        # past the largest measured batch, time grows in proportion to the batch
        return t * max(1.0, b / p.batch_size)

    def step_time(self, b: int, gamma: int) -> float:
        """Predicted seconds of one engine step for b sequences drafting gamma tokens."""
        return self._profiled(b, gamma) * self.ratio[self._index(b)]

    def observe(self, b: int, gamma: int, seconds: float) -> None:
        i = self._index(b)
        self.ratio[i] += _ema_weight(self.horizon, 1) * (seconds / self._profiled(b, gamma) - self.ratio[i])


@dataclass
class GammaChoice:
    gamma: int
    predicted_speedup: float
    explore: bool = False
    span: int = 1  # steps its acceptance stands for (a token drafted to check, one step in many)
    pays: bool = True  # before exploring: did the batch's drafts pay?


class Controller:
    def __init__(self, cfg: ControllerConfig, profiles: list[StepProfile]):
        self.cfg = cfg
        self.costs = StepCosts(profiles, cfg.cost_horizon)
        self.acceptance: dict[str, Acceptance] = {}
        self.steps = 0  # decisions made: every explore_every-th explores
        self.last = GammaChoice(0, 1.0)
        self.measured_speedup = 1.0  # moving average of measured tokens/s over plain decoding's
        self.batch_size = 1  # of the last decode step: per-workload decisions are judged at it
        # (workload, draft version) -> what was measured of a draft that was swapped out, and when
        self.swapped_out: dict[tuple[str, str], tuple[Acceptance, float]] = {}
        self._lock = threading.Lock()  # readers (metrics, admin) take snapshots

    def tracker(self, workload: str) -> Acceptance:
        acc = self.acceptance.get(workload)
        if acc is None:
            acc = self.acceptance[workload] = Acceptance(self.cfg.max_gamma)
        return acc

    def _taus(self, workloads: list[str], doubt: float = 0.0) -> list[float]:
        """The batch's mean tokens per step for gamma = 0..max_gamma (each distinct workload once)."""
        taus = [0.0] * (self.cfg.max_gamma + 1)
        for w, n in Counter(workloads).items():
            alive, tau = 1.0, 1.0
            taus[0] += n
            acc = self.tracker(w)
            rates = acc.alphas(acc.deciding(self.cfg), current=True, doubt=doubt)
            for g, a in enumerate(rates, start=1):
                alive *= a
                tau += alive
                taus[g] += n * tau
        return [t / len(workloads) for t in taus]

    def speedup(self, workloads: list[str], gamma: int) -> float:
        """Predicted tokens/s of a batch of these workloads at gamma, over plain decoding's."""
        if gamma == 0 or not workloads:
            return 1.0
        b = len(workloads)
        return self._taus(workloads)[gamma] * self.costs.step_time(b, 0) / self.costs.step_time(b, gamma)

    def best(self, workloads: list[str]) -> GammaChoice:
        if not workloads:
            return GammaChoice(0, 1.0)
        b = len(workloads)
        taus = self._taus(workloads, 0.0 if self.last.pays else self.cfg.resume_doubt)
        plain = self.costs.step_time(b, 0)
        speedups = [1.0] + [
            taus[g] * plain / self.costs.step_time(b, g) for g in range(1, self.cfg.max_gamma + 1)
        ]
        top = max(range(len(speedups)), key=speedups.__getitem__)
        return (
            GammaChoice(top, speedups[top])
            if speedups[top] >= self.cfg.min_gain
            else GammaChoice(0, 1.0, pays=False)
        )

    def choose(self, workloads: list[str]) -> GammaChoice:
        """The gamma of the next step for a batch of these workloads (one entry per sequence)."""
        d = self.best(workloads)
        self.steps += 1
        every = self.cfg.explore_every
        if d.gamma == 0:  # the further from paying, the less often a token is drafted to check
            near = self.speedup(workloads, 1) >= self.cfg.far_below
            every = self.cfg.explore_off_every if near else self.cfg.explore_far_every
        if self.steps % every == 0 and d.gamma < self.cfg.max_gamma:
            # while off, one check stands for the steps in between (a quarter of the short average
            # at most): a draft that pays again is noticed after a few checks, not a hundred
            span = min(every, int(self.cfg.short_steps / 4)) if d.gamma == 0 else 1
            d = GammaChoice(d.gamma + 1, self.speedup(workloads, d.gamma + 1), True, span, d.gamma > 0)
        self.last = d
        return d

    def observe(self, workloads: list[str], accepted: torch.Tensor, gamma: int, seconds: float) -> None:
        """After a step: acceptance of each workload's rows, and the step's measured time."""
        b = len(workloads)
        self.batch_size = b
        self.costs.observe(b, gamma, seconds)
        plain = self.costs.step_time(b, 0) / b  # seconds per token without speculation
        counts: list[int] = accepted.tolist() if gamma > 0 else []
        tokens = sum(counts) + b
        measured = tokens * plain / seconds
        self.measured_speedup += _ema_weight(self.cfg.cost_horizon, 1) * (measured - self.measured_speedup)
        if gamma == 0:  # a plain step goes on a call for training that the last drafted one made
            with self._lock:
                for w in workloads:
                    acc = self.tracker(w)
                    if acc.needed_for:
                        self._needed(acc, 1, acc.shifted)
            return
        rows: dict[str, list[int]] = {}
        for w, n in zip(workloads, counts, strict=True):
            rows.setdefault(w, []).append(n)
        cfg = self.cfg
        span = self.last.span if gamma == self.last.gamma else 1
        with self._lock:
            for w, sub in rows.items():
                acc = self.tracker(w)
                acc.update(sub, gamma, cfg.short_steps, cfg.long_steps, cfg.recent_steps, span)
                shifted = self._shifted(acc)
                if shifted and not acc.shifted:  # the traffic changed under the draft: act on it now
                    acc.mark_shift()
                acc.shifted = shifted
                acc.moved = shifted or self._rose(acc)
                # one workload in the batch: the step's own decision says whether its draft pays
                pays = self.last.pays if len(rows) == 1 else self.best([w] * b).gamma > 0
                needed = shifted or not pays
                if needed:
                    self._needed(acc, len(sub) * span, shifted)
                else:
                    acc.needed_for = 0

    def _needed(self, acc: Acceptance, steps: int, shifted: bool) -> None:
        """Training is called for `steps` more sequence-steps; a shift that held that long is for good."""
        was = acc.needed_for
        acc.needed_for += steps
        if shifted and was < self.cfg.confirm_steps <= acc.needed_for:
            acc.adopt_short()

    def draft_changed(
        self,
        workloads: list[str],
        expected: dict[int, float] | None = None,
        version: str | None = None,
        replaced: str | None = None,
    ) -> None:
        """Draft `version` replaces draft `replaced` for these workloads: what was learnt about the
        old one no longer holds. The new one starts from what was measured of it live, if it was
        swapped out less than `remember_seconds` ago; else from `expected` (tau by gamma, as the
        gate measured it on recent traffic): a draft the gate found poor for this traffic is not
        tried at full speed first."""
        prior = alphas_from_taus(expected) if expected else None
        now = time.monotonic()
        with self._lock:
            # a new draft is judged afresh: what the gate measured of it is not a few checks' worth
            self.last = replace(self.last, pays=True)
            for w in workloads:
                if replaced is not None and w in self.acceptance:
                    self.swapped_out[(w, replaced)] = (self.acceptance[w], now)
                kept = self.swapped_out.pop((w, version), None) if version is not None else None
                if kept is not None and now - kept[1] < self.cfg.remember_seconds:
                    self.acceptance[w] = kept[0]
                else:
                    self.acceptance[w] = Acceptance(self.cfg.max_gamma)
                    self.acceptance[w].reset(prior)
            for key in [k for k, (_, t) in self.swapped_out.items() if now - t >= self.cfg.remember_seconds]:
                del self.swapped_out[key]

    # -- what the rest of the node reads ------------------------------------------------------
    def pays(self, workload: str, batch_size: int | None = None) -> bool:
        """Does this workload's draft pay on its own at this batch size (default: the current one)?"""
        return self.best([workload] * (batch_size or self.batch_size)).gamma > 0

    def shifted(self, workload: str) -> bool:
        """The paper's shift detector: short-term tau well below the long-term one."""
        return self._shifted(self.tracker(workload))

    def needs_training(self, workload: str) -> bool:
        """Shifted, or its draft not paying, for `confirm_steps` steps on end (not one hard request)."""
        return self.tracker(workload).needed_for >= self.cfg.confirm_steps

    def _shifted(self, acc: Acceptance) -> bool:
        if acc.seen[0] < self.cfg.short_steps:
            return False
        g = self.cfg.max_gamma
        return acc.tau(g, "short") - 1 < (acc.tau(g, "long") - 1) * (1 - self.cfg.shift_drop)

    def _rose(self, acc: Acceptance) -> bool:
        """The mirror of the detector: short-term tau well above the long-term one."""
        if acc.seen[0] < self.cfg.short_steps:
            return False
        g = self.cfg.max_gamma
        return (acc.tau(g, "short") - 1) * (1 - self.cfg.shift_drop) > acc.tau(g, "long") - 1

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {
                w: {
                    "alpha_short": [round(a, 4) for a in acc.alphas("short")],
                    "alpha_long": [round(a, 4) for a in acc.alphas("long")],
                    "tau_short": round(acc.tau(self.best([w] * self.batch_size).gamma or 1, "short"), 4),
                    "deciding": acc.deciding(self.cfg),
                    "gamma": self.best([w] * self.batch_size).gamma,
                    "speculation": self.pays(w),
                    "shifted": self.shifted(w),
                    "needs_training": self.needs_training(w),
                }
                for w, acc in list(self.acceptance.items())
            }


def build_controller(
    model: LlamaModel,
    draft: Eagle3Draft | None,
    cfg: ControllerConfig,
    max_batch: int,
    batch_sizes: tuple[int, ...] = (1, 4, 16),
    context: int = 256,
) -> Controller:
    """Measure step times at a few batch sizes on this machine, now, and start a controller on them."""
    sizes = sorted({min(b, max_batch) for b in batch_sizes})
    # five rounds: at batch 4 on an idle machine here, the worst of the ratios that decide (verifying
    # n tokens against one) was off by 0.28 at the median and 0.51 one time in ten with three rounds
    # as per-size medians, by 0.14 and 0.29 with five as `profile_from_rounds` takes them (against
    # 40 rounds: `python scripts/profile_noise.py DRAFT --batch-size 4 --rounds 40`)
    profiles = [measure_profile(model, draft, b, context, cfg.max_gamma + 1, repeats=5) for b in sizes]
    return Controller(cfg, profiles)
