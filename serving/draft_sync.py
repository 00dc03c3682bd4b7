"""A serving node follows the registry: the `champion` of each workload it serves, swapped in live.

A background thread polls the champion alias of `default` and of every workload the node has
served. On a change it downloads the version (MLflow; S3 through boto3 when the store is S3),
checks every file against the version's sha256 tags, loads and checks the draft (every config
field against the target, shapes, finiteness, the vocabulary map, a forward on a few tokens) off
the engine's thread, and hands it to the engine, which swaps it in between two steps. A refused
version is counted and remembered; the old draft keeps serving.

After a swap the node watches the draft's live acceptance. If, over `rollback_min_steps` sequence
steps, tokens per step fall short of the gate's prediction (`gate.tau_gamma<gamma>`) by more than
`rollback_tolerance`, the node goes back to the `previous` version, points `champion` there (so
every node follows) if `champion` still points at the version it judged (a gate or another node
may have moved it since: then it is left alone), and tags the version with what it measured.

A registry or store that is away costs nothing but a counter: the engine keeps its draft and the
next poll tries again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from tide.models.eagle3 import DraftLoadError, DraftMismatchError, Eagle3Draft
from tide.names import model_name
from tide.registry.store import (
    CHAMPION,
    PREVIOUS,
    PROFILE_TAG,
    AliasMoved,
    ArtifactRefused,
    alias_version,
    download_version,
    move_alias,
    set_tags,
)
from tide.registry.tags import LiveReport, Rollback, VersionTags
from tide.serving.cost_model import measure_profile
from tide.serving.engine import Engine

log = logging.getLogger("tide.serving")


@dataclass
class SyncConfig:
    tracking_uri: str
    cache_dir: Path  # downloaded versions
    node: str  # this node's name in tags
    poll_seconds: float = 10.0
    workloads: tuple[str, ...] = ()  # followed from the start; workloads seen in traffic join later
    rollback_tolerance: float = 0.25  # live tau may fall this fraction short of the gate's prediction
    # sequence-steps on a new draft before it is judged: several requests (one hard request after
    # a gate that judged on a few easy ones is not a failed draft)
    rollback_min_steps: int = 1000
    publish_profile: bool = True  # measure step times once and publish them for the gate
    patience: int = 3  # candidates without held-out improvement before training counts as done
    min_improvement: float = 0.01
    # gated candidates in a row that the gate refused before training counts as done while the
    # workload's draft pays: its trainer keeps "improving" on its own last candidate without ever
    # beating what serves (on code, thirteen in ten minutes), and every captured request costs
    outdone_after: int = 5


@dataclass
class SyncStats:
    polls: int = 0
    swaps: int = 0
    rollbacks: int = 0
    registry_errors: int = 0  # polls or downloads that failed because a service was away
    refused: Counter[str] = field(default_factory=Counter)  # by reason


@dataclass
class Following:
    """The registry version a workload's draft came from, and what the gate predicted for it."""

    name: str
    version: str
    draft_version: str
    predicted_tau: dict[int, float]
    judged: bool = False


class DraftSync:
    def __init__(self, cfg: SyncConfig, engine: Engine):
        # a poll must fail fast when the registry is away: no minutes of HTTP retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.cfg = cfg
        self.engine = engine
        self.fingerprint = engine.target.fingerprint
        self.client = MlflowClient(cfg.tracking_uri)
        self.stats = SyncStats()
        self.following: dict[str, Following] = {}
        self.refused: set[tuple[str, str]] = set()  # (model name, version) never to try again
        # workloads whose trainer stopped improving held-out tau, and since when (this node's clock)
        self.saturated: dict[str, float] = {}
        # workloads whose last `outdone_after` gated candidates the gate refused, and since when
        self.outdone: dict[str, float] = {}
        self._profile: str | None = None
        self._profiled: set[str] = set()  # models whose profile tag this node has set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tide-draft-sync", daemon=True)

    def start(self) -> DraftSync:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.cfg.poll_seconds)

    def workloads(self) -> list[str]:
        return sorted({"default", *self.cfg.workloads, *self.engine.workloads_seen})

    # -- one poll -------------------------------------------------------------------------------
    def poll_once(self) -> None:
        self.stats.polls += 1
        try:
            self._measure_profile()
            for workload in self.workloads():
                self._follow(workload)
            self._watch()
        except Exception as e:  # the registry or the store is away: keep the drafts we have
            self.stats.registry_errors += 1
            log.warning("registry poll failed, serving on with the current drafts: %s", e)

    def _follow(self, workload: str) -> None:
        name = model_name(self.fingerprint, workload)
        self._publish_profile(name)
        self._check_saturation(workload, name)
        mv = alias_version(self.client, name, CHAMPION)
        if mv is None:
            return
        now = self.following.get(workload)
        if (now is not None and now.version == str(mv.version)) or (name, str(mv.version)) in self.refused:
            return
        draft = self._fetch(mv)
        if draft is None:
            return
        predicted = _predicted(mv)
        self.engine.set_draft(draft, workload, predicted or None)
        self.following[workload] = Following(name, str(mv.version), draft.cfg.version, predicted)
        self.stats.swaps += 1
        log.info("%s: swapping in %s version %s (%s)", workload, name, mv.version, draft.cfg.version)

    def _fetch(self, mv: ModelVersion) -> Eagle3Draft | None:
        """The version's draft, checked; None when refused (counted, remembered) or unreachable."""
        try:
            folder = download_version(self.client, mv, self.cfg.cache_dir)
            return self.engine.read_draft(folder)
        except ArtifactRefused as e:
            reason, message = e.reason, str(e)
        except DraftMismatchError as e:
            reason, message = "foreign_target", str(e)
        except DraftLoadError as e:
            reason, message = e.reason, str(e)
        self.refused.add((mv.name, str(mv.version)))
        self.stats.refused[reason] += 1
        log.error(
            "refused %s version %s (%s): %s; the current draft stays", mv.name, mv.version, reason, message
        )
        return None

    def _check_saturation(self, workload: str, name: str) -> None:
        """Training is done for now when none of the last `patience` candidates beat the one before
        it by `min_improvement` on the trainer's held-out examples; and, while the draft pays (the
        advisor's call), when the gate refused the last `outdone_after` candidates it decided on.
        Each is dated by the oldest candidate it counts: the advisor ends training only on
        candidates made after the workload came to need it (refusals of the last traffic's
        candidates once ended a French phase's capture three minutes in)."""
        n, k = self.cfg.patience, self.cfg.outdone_after
        try:
            versions = self.client.search_model_versions(
                f"name = '{name}'", max_results=max(4 * n, 2 * k), order_by=["version_number DESC"]
            )
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return
            raise
        read = [(v, VersionTags.from_tags(v.tags)) for v in versions]
        made = [(v, t) for v, t in read if t.candidate is not None]  # the trainer's candidates
        last = made[:n]
        stalled = len(last) == n and max(t.candidate.held_out_gain for _, t in last if t.candidate) < (
            self.cfg.min_improvement
        )
        _dated(self.saturated, workload, [v for v, _ in last] if stalled else [])
        gated = [(v, t.verdict.decision) for v, t in made if t.verdict and t.verdict.decision != "skipped"][
            :k
        ]
        refused = len(gated) == k and all(d == "refused" for _, d in gated)
        _dated(self.outdone, workload, [v for v, _ in gated] if refused else [])

    # -- after a swap: does the draft deliver what the gate predicted? ---------------------------
    def _watch(self) -> None:
        gamma = self.engine.gamma
        for workload, f in list(self.following.items()):
            slot = self.engine.drafts.get(workload)
            if f.judged or slot is None or slot.version != f.draft_version or gamma not in f.predicted_tau:
                continue
            if slot.stats.steps < self.cfg.rollback_min_steps:
                continue
            f.judged = True
            live, predicted = slot.stats.mean_accept_length, f.predicted_tau[gamma]
            tags = LiveReport(self.cfg.node, gamma, live, slot.stats.steps).to_tags()
            if live >= predicted * (1 - self.cfg.rollback_tolerance):
                self._tag(f, tags)
                continue
            try:
                self._roll_back(workload, f, live, predicted, tags)
            except Exception:
                f.judged = False  # the registry went away midway: judge again at the next poll
                raise

    def _roll_back(
        self, workload: str, f: Following, live: float, predicted: float, tags: dict[str, str]
    ) -> None:
        reason = (f"live tau {live:.3f} at gamma {self.engine.gamma} fell short of the gate's "
                  f"{predicted:.3f} by more than {self.cfg.rollback_tolerance:.0%}")  # fmt: skip
        log.warning("%s version %s: %s; rolling back", f.name, f.version, reason)
        self.refused.add((f.name, f.version))
        prev = alias_version(self.client, f.name, PREVIOUS)
        draft = self._fetch(prev) if prev is not None and str(prev.version) != f.version else None
        # None: the workload falls back to the default draft
        self.engine.set_draft(draft, workload, _predicted(prev) or None if prev is not None else None)
        self.following.pop(workload, None)
        to = str(prev.version) if draft is not None and prev is not None else None
        if draft is not None and prev is not None:
            self.following[workload] = Following(
                f.name, str(prev.version), draft.cfg.version, _predicted(prev), True
            )
        try:  # only if the champion is still the version judged here; else the next poll follows it
            move_alias(self.client, f.name, CHAMPION, f.version, to)
            moved = "moved"
        except AliasMoved as e:
            log.warning("%s; this node rolled back alone", e)
            moved = f"left alone: {e}"
        self._tag(f, {**tags, **Rollback(self.cfg.node, reason, to or "default draft", moved).to_tags()})
        self.stats.rollbacks += 1  # counted once its evidence is on the version

    def _tag(self, f: Following, tags: dict[str, str]) -> None:
        set_tags(self.client, self.client.get_model_version(f.name, f.version), dict(tags))

    # -- step times for the gate ----------------------------------------------------------------
    def _measure_profile(self) -> None:
        if self._profile is not None or not self.cfg.publish_profile:
            return
        draft = self.engine.draft or next((s.draft for s in self.engine.drafts.values()), None)
        if draft is None:
            return  # a profile without a draft's step time would overstate every speedup
        e = self.engine
        # measured once and judged on for the node's lifetime: nine rounds (a few seconds); with five
        # the worst ratio at batch 1 was off by 0.09 at the median and 0.17 one time in ten, with nine
        # 0.07 and 0.12 (against 45 rounds on an idle machine here: scripts/profile_noise.py)
        profile = measure_profile(e.model, draft, 1, 256, e.cfg.max_gamma + 1)
        self._profile = profile.to_json(self.cfg.node)

    def _publish_profile(self, name: str) -> None:
        """Once per model, as soon as a trainer has created it (the gate reads it from there)."""
        if self._profile is None or name in self._profiled:
            return
        try:
            self.client.set_registered_model_tag(name, PROFILE_TAG, self._profile)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return
            raise
        self._profiled.add(name)


def _predicted(mv: ModelVersion) -> dict[int, float]:
    return VersionTags.from_tags(mv.tags).predicted_tau


def _dated(moments: dict[str, float], workload: str, counted: list[ModelVersion]) -> None:
    """A condition on these candidates holds (none: it does not), dated by the oldest one's
    registration (the registry's clock, in unix seconds, as this node's)."""
    if counted:
        moments[workload] = min(int(v.creation_timestamp or 0) for v in counted) / 1000.0
    else:
        moments.pop(workload, None)
