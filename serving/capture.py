"""Which requests have their hidden states captured: a rule per workload, changeable at run time.

A rule is on, off, a sampled fraction, or `auto`: then a `TrainingAdvisor` decides, capturing
from when the workload needs training (its acceptance shifted, or its draft stopped paying) until
its trainer's held-out tau stops improving. Held-out requests are captured under `auto` all the
time: they cost a tenth of full capture, and the gate needs today's traffic to judge drafts by (a
workload that comes back is noticed there even when nothing here shifted).

Which requests are held out (their records only ever evaluate drafts) is decided here and written
into the records: one in ten by request id (`records.is_held_out`), and every other captured request
while fewer than `held_out_min` of the last `held_out_window` seconds are: the gate judges on that
window. After a shift, or at low traffic, one in ten leaves the gate's window to chance (one workload
here waited 37 requests for its first, and a loop test's trainer 40 requests for anything to
evaluate on); at high traffic one in ten fills the window and nothing more is held out.
A prompt that comes again keeps its status: greedy decoding repeats its text, so a prompt the
trainers learnt from must never evaluate a draft, nor the other way round (this node remembers the
last `remember_prompts` it captured; traffic that repeats a few prompts keeps the share they drew).

A node serves a bounded set of workload names (`WorkloadSet`): a client's made-up name would
otherwise make a topic, a registry poll and metric series of its own.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

from tide.producers.records import HeldOutWindow, is_held_out

# workload names become Kafka topic suffixes and metric labels: keep them short and plain
WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,47}$")


def check_workload(name: str) -> str:
    if not WORKLOAD_NAME.match(name):
        raise ValueError(
            f"workload name {name!r} is not valid: 1-48 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return name


DEFAULT_WORKLOAD = "default"


class WorkloadSet:
    """The workload names a node serves. Each name makes state across the loop (a Kafka topic, a
    registry poll, metric series, controller and capture entries), so the set is bounded: an
    allow-list (`tide serve --workloads`), or else the first `cap` names seen. A valid name outside
    the set is served as `default` and counted (`overflow`); an invalid one is refused (ValueError).
    `default` is always in the set."""

    def __init__(self, allowed: Iterable[str] | None = None, cap: int = 16):
        if cap < 0:
            raise ValueError(f"the workload cap must be >= 0, got {cap}")
        self.fixed = allowed is not None  # an allow-list: nothing else is ever admitted
        self.cap = cap
        self._names: set[str] = {check_workload(w) for w in allowed or ()} - {DEFAULT_WORKLOAD}
        self.overflow = 0  # requests served as `default` because their name was outside the set
        self._lock = threading.Lock()

    def resolve(self, name: str) -> str:
        """The name a request is served under: its own if in the set (or admitted now), else `default`."""
        check_workload(name)
        with self._lock:
            if name == DEFAULT_WORKLOAD or name in self._names:
                return name
            if not self.fixed and len(self._names) < self.cap:
                self._names.add(name)
                return name
            self.overflow += 1
            return DEFAULT_WORKLOAD

    def __contains__(self, name: object) -> bool:
        return name == DEFAULT_WORKLOAD or name in self._names

    def names(self) -> list[str]:
        with self._lock:
            return sorted({DEFAULT_WORKLOAD, *self._names})


@dataclass
class CaptureRule:
    enabled: bool = True
    fraction: float = 1.0  # share of the workload's requests captured
    auto: bool = False  # the advisor decides (enabled and fraction apply while it says yes)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"capture fraction must be in [0, 1], got {self.fraction}")


def parse_rules(spec: str) -> dict[str, CaptureRule]:
    """'code=on,chat_fr=0.25,math=auto,*=off' -> rules; '*' is the rule for workloads without one."""
    rules: dict[str, CaptureRule] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"capture rule {item!r}: expected WORKLOAD=on|off|auto|FRACTION")
        if name != "*":
            check_workload(name)
        if value == "auto":
            rules[name] = CaptureRule(auto=True)
        elif value in ("on", "off"):
            rules[name] = CaptureRule(enabled=value == "on")
        else:
            try:
                rules[name] = CaptureRule(enabled=True, fraction=float(value))
            except ValueError:
                raise ValueError(
                    f"capture rule {item!r}: expected on, off, auto or a fraction in [0, 1]"
                ) from None
    return rules


@dataclass(frozen=True)
class CaptureDecision:
    capture: bool
    held_out: bool = False  # its records only ever evaluate drafts


class Advisor(Protocol):
    def __call__(self, workload: str) -> bool: ...  # does the workload need training now?


class TrainingSignals(Protocol):
    """What serving measured (the controller): has the workload shifted, or its draft stopped paying,
    for long enough to call for training?"""

    def needs_training(self, workload: str) -> bool: ...


class CandidateHistory(Protocol):
    """What the registry says of a workload's candidates (`candidate_history.RegistryCandidates`),
    unix seconds by workload: since when its trainer stopped improving (`saturated`), and since when
    the gate has refused what it makes while the draft pays (`outdone`)."""

    saturated: dict[str, float]
    outdone: dict[str, float]


class CapturePolicy:
    def __init__(
        self,
        rules: dict[str, CaptureRule] | None = None,
        seed: int = 0,
        remember_prompts: int = 100_000,
        held_out_min: int = 3,
        held_out_window: float = HeldOutWindow().seconds,  # the gate's
        clock: Callable[[], float] = time.time,
        workloads: WorkloadSet | None = None,
    ):
        # every request's workload name is resolved here first (api.submit): what gets state
        self.workloads = workloads or WorkloadSet()
        rules = dict(rules or {})
        self.fallback = rules.pop("*", CaptureRule())  # for workloads without a rule of their own
        self.rules: dict[str, CaptureRule] = rules
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.advisor: Advisor | None = None  # decides `auto` rules (None: capture)
        self.remember_prompts = remember_prompts
        self._held: OrderedDict[int, bool] = OrderedDict()  # captured prompts: held out?
        self.held_out_min = held_out_min
        self.held_out_window = held_out_window
        self.clock = clock
        self._held_at: dict[str, deque[float]] = {}  # when requests were held out, per workload
        self._last_held: dict[str, bool] = {}  # was the last captured request held out?

    def rule(self, workload: str) -> CaptureRule:
        return self.rules.get(workload, self.fallback)

    def set(self, workload: str, rule: CaptureRule) -> None:
        with self._lock:
            self.rules[check_workload(workload)] = rule

    def decide(
        self, workload: str, opted_out: bool, request_id: str | None = None, prompt: list[int] | None = None
    ) -> CaptureDecision:
        """Capture this request, and hold it out? The client's opt-out always wins."""
        if opted_out:
            return CaptureDecision(False)
        r = self.rule(workload)
        key = hash(tuple(prompt)) if prompt is not None else None
        with self._lock:
            known = self._held.get(key) if key is not None else None
        by_id = request_id is not None and is_held_out(request_id)
        held = by_id if known is None else known
        # not training: still the held-out share, so the gate judges today's traffic
        if r.auto and self.advisor is not None and not held and not self.advisor(workload):
            return CaptureDecision(False)
        with self._lock:
            if not (r.enabled and self._rng.random() < r.fraction):
                return CaptureDecision(False)
        with self._lock:
            if known is None:
                held = self._hold_out(workload, by_id)
            if key is not None:
                self._held[key] = held
                self._held.move_to_end(key)
                if len(self._held) > self.remember_prompts:
                    self._held.popitem(last=False)
        return CaptureDecision(True, held)

    def _hold_out(self, workload: str, by_id: bool) -> bool:
        """A captured request: held out by its id, or, while the gate's window holds fewer than
        `held_out_min` held-out requests, every other one (the first too: the gate needs the traffic
        before the trainer has anything to show)."""
        now = self.clock()
        held = self._held_at.setdefault(workload, deque())
        while held and held[0] < now - self.held_out_window:
            held.popleft()
        out = by_id or (len(held) < self.held_out_min and not self._last_held.get(workload, False))
        if out:
            held.append(now)
        self._last_held[workload] = out
        return out

    def active(self, workload: str) -> bool:
        """Is the workload being captured now (ignoring per-request opt-outs and sampling)?"""
        r = self.rule(workload)
        return (
            r.enabled
            and r.fraction > 0
            and not (r.auto and self.advisor is not None and not self.advisor(workload))
        )

    def snapshot(self) -> dict[str, object]:
        return {
            "fallback": asdict(self.fallback),
            "workloads": {w: asdict(r) for w, r in self.rules.items()},
            "served": self.workloads.names(),
            "served_as_default": self.workloads.overflow,
        }


class TrainingAdvisor:
    """Decides `auto` capture. A workload needs training from the moment its acceptance shifts or its
    draft stops paying (the controller's `needs_training`: for longer than one hard request) until
    its trainer's candidates stop improving held-out tau after that moment (the draft sync), or,
    while its draft pays, until the gate has refused several of them in a row after that moment
    (they improve on each other, not on what serves). With a draft sync, a workload's first request
    is such a moment too: nothing says yet that its trainer has nothing left to learn from this
    traffic. Only a new such moment starts capture again, so a draft that cannot be made to pay is
    not trained forever."""

    def __init__(
        self,
        controller: TrainingSignals,
        history: CandidateHistory | None,
        clock: Callable[[], float] = time.time,
    ):
        self.controller = controller
        self.history = history
        self.clock = clock  # unix seconds, as the registry dates the candidates that end training
        self.since: dict[str, float] = {}  # workloads that need training, since when
        self._needed: dict[str, bool] = {}  # the last call's verdict on the controller's signals

    def __call__(self, workload: str) -> bool:
        needed = self.controller.needs_training(workload)
        done = self.history.saturated.get(workload) if self.history is not None else None
        if not needed and self.history is not None and workload in self.history.outdone:
            # the draft pays and the gate keeps refusing what its trainer makes: nothing to gain
            done = max(done or 0.0, self.history.outdone[workload])
        # first sight: unless its trainer is known to be saturated already (or no drafts can come)
        first = self.history is not None and done is None and workload not in self._needed
        if (needed and not self._needed.get(workload, False)) or first:
            self.since[workload] = self.clock()
        self._needed[workload] = needed
        since = self.since.get(workload)
        if since is None:
            return False
        if done is not None and done > since:
            del self.since[workload]
            return False
        return True
