"""After a swap, does the draft deliver what the gate predicted?

Once a followed draft has served `min_steps` sequence steps, its live tokens per step are compared
with the gate's prediction at the serving gamma (`gate.tau_gamma<gamma>`, or the recall's). Short by
more than `tolerance`, the node goes back to the `previous` version (or to the default draft), points
`champion` there, so every node follows, if `champion` still points at the version it judged (a gate
or another node may have moved it since: then it is left alone), and tags the version with what it
measured (`live.<node>.*`, `rollback.*`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from tide.models.eagle3 import Eagle3Draft
from tide.registry.store import CHAMPION, PREVIOUS, AliasMoved, alias_version, move_alias, set_tags
from tide.registry.tags import LiveReport, Rollback, VersionTags
from tide.serving.draft_sink import DraftSink

log = logging.getLogger("tide.serving")


@dataclass
class Following:
    """The registry version a workload's draft came from, and what the gate predicted for it."""

    name: str
    version: str
    draft_version: str
    predicted_tau: dict[int, float]
    judged: bool = False


def predicted(mv: ModelVersion) -> dict[int, float]:
    return VersionTags.from_tags(mv.tags).predicted_tau


class LiveCheck:
    def __init__(
        self,
        client: MlflowClient,
        sink: DraftSink,
        node: str,
        tolerance: float,
        min_steps: int,
        following: dict[str, Following],
        refused: set[tuple[str, str]],
        fetch: Callable[[ModelVersion], Eagle3Draft | None],
    ):
        self.client, self.sink, self.node = client, sink, node
        self.tolerance, self.min_steps = tolerance, min_steps
        self.following, self.refused, self.fetch = following, refused, fetch  # the follower's, shared
        self.rollbacks = 0

    def watch(self) -> None:
        gamma = self.sink.gamma
        for workload, f in list(self.following.items()):
            now = self.sink.acceptance(workload)
            if f.judged or now is None or now.version != f.draft_version or gamma not in f.predicted_tau:
                continue
            if now.steps < self.min_steps:
                continue
            f.judged = True
            live, expected = now.tokens_per_step, f.predicted_tau[gamma]
            tags = LiveReport(self.node, gamma, live, now.steps).to_tags()
            if live >= expected * (1 - self.tolerance):
                self._tag(f, tags)
                continue
            try:
                self.roll_back(workload, f, live, expected, tags)
            except Exception:
                f.judged = False  # the registry went away midway: judge again at the next poll
                raise

    def roll_back(
        self, workload: str, f: Following, live: float, expected: float, tags: dict[str, str]
    ) -> None:
        reason = (f"live tau {live:.3f} at gamma {self.sink.gamma} fell short of the gate's "
                  f"{expected:.3f} by more than {self.tolerance:.0%}")  # fmt: skip
        log.warning("%s version %s: %s; rolling back", f.name, f.version, reason)
        self.refused.add((f.name, f.version))
        prev = alias_version(self.client, f.name, PREVIOUS)
        draft = self.fetch(prev) if prev is not None and str(prev.version) != f.version else None
        # None: the workload falls back to the default draft
        self.sink.set_draft(draft, workload, predicted(prev) or None if prev is not None else None)
        self.following.pop(workload, None)
        to = str(prev.version) if draft is not None and prev is not None else None
        if draft is not None and prev is not None:
            self.following[workload] = Following(
                f.name, str(prev.version), draft.cfg.version, predicted(prev), True
            )
        try:  # only if the champion is still the version judged here; else the next poll follows it
            move_alias(self.client, f.name, CHAMPION, f.version, to)
            moved = "moved"
        except AliasMoved as e:
            log.warning("%s; this node rolled back alone", e)
            moved = f"left alone: {e}"
        self._tag(f, {**tags, **Rollback(self.node, reason, to or "default draft", moved).to_tags()})
        self.rollbacks += 1  # counted once its evidence is on the version

    def _tag(self, f: Following, tags: dict[str, str]) -> None:
        set_tags(self.client, self.client.get_model_version(f.name, f.version), dict(tags))
