"""What a draft version's registry tags say, typed: the one place their keys are spelled.

Each kind of evidence is a dataclass with `to_tags()` and `from_tags()`; the keys stay flat strings
because the MLflow UI shows them as they are:

| record          | written by            | keys                                             |
|-----------------|-----------------------|--------------------------------------------------|
| `CandidateTags` | a trainer (register)  | `workload`, `draft_version`, `held_out_*`, ...   |
| `Figures`       | the gate              | `<prefix>.tau_gamma<g>`, `.speedup_gamma<g>`, ...|
| `GateVerdict`   | the gate (decide)     | `gate.decision`, `gate.reason`, `gate.baseline`..|
| `Recall`        | the gate (recall)     | `gate.recall.*`                                  |
| `LiveReport`    | a serving node        | `live.<node>.tau_gamma<g>`, `live.<node>.steps`  |
| `Rollback`      | a serving node        | `rollback.*`                                     |

`VersionTags.from_tags` reads all of them from one version's tags; a part that is absent is None.
The sha256 tags of a version's files are `registry.store`'s (`SHA_TAG`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, get_args

Decision = Literal["promoted", "refused", "skipped"]
DECISIONS: tuple[str, ...] = get_args(Decision)

GATE = "gate"
RECALL = "gate.recall"
BASELINE = "gate.baseline"
CHAMPION_UNTIL = "gate.champion_until"


TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # tag timestamps: local time with its offset, readable in the UI


def now() -> str:
    return time.strftime(TIME_FORMAT)


def parse_time(stamp: str) -> float:
    """A tag timestamp in unix seconds."""
    return datetime.strptime(stamp, TIME_FORMAT).timestamp()


def _floats(tags: Mapping[str, str], prefix: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in tags.items():
        if k.startswith(prefix) and k[len(prefix) :].isdigit():
            try:
                x = float(v)
            except ValueError:
                continue  # a hand-edited tag: read as absent
            if math.isfinite(x):  # "nan" and "inf" parse, and would poison every estimate built on them
                out[int(k[len(prefix) :])] = x
    return out


def _series(by_gamma: dict[int, float]) -> list[float]:
    """1..n without gaps, else empty (a partial series would shift every later gamma)."""
    n = len(by_gamma)
    return [by_gamma[g] for g in range(1, n + 1)] if n and set(by_gamma) == set(range(1, n + 1)) else []


@dataclass(frozen=True)
class CandidateTags:
    """A trainer's candidate: where it came from and how it did on the trainer's held-out examples."""

    workload: str
    target_fingerprint: str
    draft_version: str
    records_consumed: int
    steps: int
    offset_range: str  # "<topic:partition>=<first>..<next>;..."
    held_out_tau: float
    held_out_gain: float  # over the previous candidate, on the same held-out examples

    def to_tags(self) -> dict[str, str]:
        return {
            "workload": self.workload,
            "target_fingerprint": self.target_fingerprint,
            "draft_version": self.draft_version,
            "records_consumed": str(self.records_consumed),
            "steps": str(self.steps),
            "offset_range": self.offset_range,
            "held_out_tau": f"{self.held_out_tau:.4f}",
            "held_out_gain": f"{self.held_out_gain:.4f}",
        }

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> CandidateTags | None:
        """None for a version no trainer made (registered by hand, or by `tide up`): what marks a
        trainer's candidate is its held-out gain."""
        try:
            return cls(
                tags.get("workload", ""),
                tags.get("target_fingerprint", ""),
                tags.get("draft_version", ""),
                int(tags.get("records_consumed", "0")),
                int(tags.get("steps", "0")),
                tags.get("offset_range", ""),
                float(tags.get("held_out_tau", "nan")),
                float(tags["held_out_gain"]),
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Figures:
    """One measurement of a version on held-out traffic: tau (and, with a node's step times, the
    predicted speedup) at each gamma, the best gamma and the score the gate compares."""

    tau: list[float]
    speedup: list[float] | None
    best_gamma: int
    score: float

    def to_tags(self, prefix: str) -> dict[str, str]:
        out = {f"{prefix}.tau_gamma{g}": f"{t:.4f}" for g, t in enumerate(self.tau, start=1)}
        if self.speedup is not None:
            out |= {f"{prefix}.speedup_gamma{g}": f"{s:.4f}" for g, s in enumerate(self.speedup, start=1)}
        out[f"{prefix}.best_gamma"] = str(self.best_gamma)
        out[f"{prefix}.score"] = f"{self.score:.4f}"
        return out

    @classmethod
    def from_tags(cls, tags: Mapping[str, str], prefix: str) -> Figures | None:
        tau = _series(_floats(tags, f"{prefix}.tau_gamma"))
        if not tau:
            return None
        speedup = _series(_floats(tags, f"{prefix}.speedup_gamma")) or None
        try:
            best = int(tags.get(f"{prefix}.best_gamma", "1"))
            score = float(tags.get(f"{prefix}.score", "nan"))
        except ValueError:
            best, score = 1, float("nan")
        return cls(tau, speedup, best, score)


@dataclass(frozen=True)
class GateVerdict:
    """The gate's decision on a candidate and its evidence. `evidence_tags` are written before the
    decision is carried out and `decision_tags` after it: a gate stopped in between leaves a version
    gated again, never a champion without its figures."""

    decision: Decision
    reason: str
    figures: Figures | None = None
    baseline: str | None = None  # "<model> v<version>", or "none": promoted without one
    baseline_figures: Figures | None = None
    gain: str | None = None  # the paired tau gain over the baseline and its standard error, in words
    held_out_positions: int | None = None
    profile: str | None = None  # the step times it was scored at, in words
    time: str = field(default_factory=now)

    def evidence_tags(self) -> dict[str, str]:
        out: dict[str, str] = {"gate.reason": self.reason}
        if self.held_out_positions is not None:
            out["gate.held_out_positions"] = str(self.held_out_positions)
        if self.profile is not None:
            out["gate.profile"] = self.profile
        if self.figures is not None:
            out |= self.figures.to_tags(GATE)
        if self.baseline_figures is not None:
            out |= self.baseline_figures.to_tags(BASELINE)
        if self.baseline is not None:
            out[BASELINE] = self.baseline
        if self.gain is not None:
            out["gate.gain"] = self.gain
        return out

    def decision_tags(self) -> dict[str, str]:
        return {"gate.decision": self.decision, "gate.time": self.time}

    def to_tags(self) -> dict[str, str]:
        return self.evidence_tags() | self.decision_tags()

    @property
    def baseline_version(self) -> str | None:
        """The baseline's version number; None when judged without one."""
        if not self.baseline or self.baseline == "none" or " v" not in self.baseline:
            return None
        return self.baseline.rsplit(" v", 1)[1]

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> GateVerdict | None:
        """None while the version is undecided (or its decision tag is not one the gate writes)."""
        decision = tags.get("gate.decision")
        if decision not in DECISIONS:
            return None
        positions = tags.get("gate.held_out_positions")
        return cls(
            decision,  # type: ignore[arg-type]  # checked against DECISIONS above
            tags.get("gate.reason", ""),
            Figures.from_tags(tags, GATE),
            tags.get(BASELINE),
            Figures.from_tags(tags, BASELINE),
            tags.get("gate.gain"),
            int(positions) if positions and positions.isdigit() else None,
            tags.get("gate.profile"),
            tags.get("gate.time", ""),
        )


@dataclass(frozen=True)
class Recall:
    """An earlier champion made champion again: its figures on today's traffic and why."""

    figures: Figures
    reason: str
    time: str = field(default_factory=now)

    def to_tags(self) -> dict[str, str]:
        return {**self.figures.to_tags(RECALL), f"{RECALL}.time": self.time, f"{RECALL}.reason": self.reason}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Recall | None:
        figures = Figures.from_tags(tags, RECALL)
        if f"{RECALL}.time" not in tags or figures is None:
            return None
        return cls(figures, tags.get(f"{RECALL}.reason", ""), tags[f"{RECALL}.time"])


@dataclass(frozen=True)
class LiveReport:
    """A serving node's judgement of a version after `steps` sequence steps at `gamma`."""

    node: str
    gamma: int
    tau: float
    steps: int

    def to_tags(self) -> dict[str, str]:
        return {
            f"live.{self.node}.tau_gamma{self.gamma}": f"{self.tau:.4f}",
            f"live.{self.node}.steps": str(self.steps),
        }


@dataclass(frozen=True)
class Rollback:
    """A serving node went back from this version: why, where to, and what became of `champion`."""

    node: str
    reason: str
    to: str  # a version number, or "default draft"
    champion: str  # "moved", or "left alone: <why>" (it no longer pointed at the version judged)
    time: str = field(default_factory=now)

    def to_tags(self) -> dict[str, str]:
        return {
            "rollback.reason": self.reason,
            "rollback.node": self.node,
            "rollback.to": self.to,
            "rollback.champion": self.champion,
            "rollback.time": self.time,
        }

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Rollback | None:
        if "rollback.reason" not in tags:
            return None
        return cls(
            tags.get("rollback.node", ""),
            tags["rollback.reason"],
            tags.get("rollback.to", ""),
            tags.get("rollback.champion", ""),
            tags.get("rollback.time", ""),
        )


@dataclass(frozen=True)
class VersionTags:
    """Everything a version's tags say, each part None where absent."""

    candidate: CandidateTags | None
    verdict: GateVerdict | None
    figures: Figures | None  # the gate's, tagged before its decision is (a champion may be read between)
    recall: Recall | None
    rollback: Rollback | None
    champion_until: str | None  # when it stopped being champion (it may be recalled)
    source: str | None  # who registered a version no trainer made

    @classmethod
    def from_tags(cls, tags: Mapping[str, str] | None) -> VersionTags:
        tags = tags or {}
        return cls(
            CandidateTags.from_tags(tags),
            GateVerdict.from_tags(tags),
            Figures.from_tags(tags, GATE),
            Recall.from_tags(tags),
            Rollback.from_tags(tags),
            tags.get(CHAMPION_UNTIL),
            tags.get("source"),
        )

    @property
    def was_champion(self) -> bool:
        return (
            self.verdict is not None and self.verdict.decision == "promoted"
        ) or self.champion_until is not None

    @property
    def predicted_tau(self) -> dict[int, float]:
        """tau by gamma as the gate last measured the version: when it was recalled, if it was (that
        measurement is on more recent traffic), else when it was gated."""
        figures = self.recall.figures if self.recall else self.figures
        return dict(enumerate(figures.tau, start=1)) if figures else {}


def source_tags(source: str) -> dict[str, str]:
    """For a version registered by hand or by a tool rather than a trainer."""
    return {"source": source}


def champion_until_tags() -> dict[str, str]:
    return {CHAMPION_UNTIL: now()}
