"""A serving node follows the registry: the `champion` of each workload it serves, swapped in live.

A background thread polls the champion alias of each workload its engine takes drafts for (TIDE's
engine: `default` and every workload it has served; a vLLM node: the one it serves). On a change it
downloads the version (MLflow; S3 through boto3 when the store is S3), checks every file against the
version's sha256 tags, has the engine load and check the draft (every config field against the
target, shapes, finiteness, the vocabulary map, a forward on a few tokens) off the engine's thread,
and hands it over; the engine swaps it in between two steps. A refused version is counted and
remembered; the old draft keeps serving. The engine is reached through `DraftSink` only
(`draft_sink.py`), so vLLM follows the registry with this same code.

Each poll also runs the parts with one job each that read or write the registry for the node:
`LiveCheck` (`live_check.py`: after a swap, does the draft deliver what the gate predicted, else
roll back), `RegistryCandidates` (`candidate_history.py`: has training stopped paying, for the
capture advisor) and the step-time profile the gate scores candidates at.

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
    PROFILE_TAG,
    ArtifactRefused,
    alias_version,
    download_version,
)
from tide.serving.candidate_history import HistoryConfig, RegistryCandidates
from tide.serving.draft_sink import DraftSink
from tide.serving.live_check import Following, LiveCheck, predicted

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
    history: HistoryConfig = field(default_factory=HistoryConfig)


@dataclass
class SyncStats:
    polls: int = 0
    swaps: int = 0
    registry_errors: int = 0  # polls or downloads that failed because a service was away
    refused: Counter[str] = field(default_factory=Counter)  # by reason


class DraftSync:
    def __init__(self, cfg: SyncConfig, sink: DraftSink):
        # a poll must fail fast when the registry is away: no minutes of HTTP retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.cfg = cfg
        self.sink = sink
        self.fingerprint = sink.fingerprint
        self.client = MlflowClient(cfg.tracking_uri)
        self.stats = SyncStats()
        self.following: dict[str, Following] = {}
        self.refused: set[tuple[str, str]] = set()  # (model name, version) never to try again
        self.candidates = RegistryCandidates(self.client, cfg.history)
        self.live = LiveCheck(self.client, sink, cfg.node, cfg.rollback_tolerance, cfg.rollback_min_steps,
                              self.following, self.refused, self._fetch)  # fmt: skip
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
        return sorted({*self.cfg.workloads, *self.sink.workloads()})

    # -- one poll -------------------------------------------------------------------------------
    def poll_once(self) -> None:
        self.stats.polls += 1
        try:
            self._measure_profile()
            for workload in self.workloads():
                self._follow(workload)
            self.live.watch()
        except Exception as e:  # the registry or the store is away: keep the drafts we have
            self.stats.registry_errors += 1
            log.warning("registry poll failed, serving on with the current drafts: %s", e)

    def _follow(self, workload: str) -> None:
        name = model_name(self.fingerprint, workload)
        self._publish_profile(name)
        self.candidates.check(workload, name)
        mv = alias_version(self.client, name, CHAMPION)
        if mv is None:
            return
        now = self.following.get(workload)
        if (now is not None and now.version == str(mv.version)) or (name, str(mv.version)) in self.refused:
            return
        draft = self._fetch(mv)
        if draft is None:
            return
        expected = predicted(mv)
        try:
            self.sink.set_draft(draft, workload, expected or None)
        except DraftLoadError as e:  # the engine itself refused it (vLLM: the weights would not load)
            self._refuse(mv, e.reason, str(e))
            return
        self.following[workload] = Following(name, str(mv.version), draft.cfg.version, expected)
        self.stats.swaps += 1
        log.info("%s: swapping in %s version %s (%s)", workload, name, mv.version, draft.cfg.version)

    def _fetch(self, mv: ModelVersion) -> Eagle3Draft | None:
        """The version's draft, checked; None when refused (counted, remembered) or unreachable."""
        try:
            folder = download_version(self.client, mv, self.cfg.cache_dir)
            return self.sink.read_draft(folder)
        except ArtifactRefused as e:
            reason, message = e.reason, str(e)
        except DraftMismatchError as e:
            reason, message = "foreign_target", str(e)
        except DraftLoadError as e:
            reason, message = e.reason, str(e)
        self._refuse(mv, reason, message)
        return None

    def _refuse(self, mv: ModelVersion, reason: str, message: str) -> None:
        self.refused.add((mv.name, str(mv.version)))
        self.stats.refused[reason] += 1
        log.error(
            "refused %s version %s (%s): %s; the current draft stays", mv.name, mv.version, reason, message
        )

    # -- step times for the gate ----------------------------------------------------------------
    def _measure_profile(self) -> None:
        if self._profile is not None or not self.cfg.publish_profile:
            return
        profile = self.sink.step_profile()  # measured once, judged on for the node's lifetime
        if profile is not None:
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
