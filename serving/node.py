"""A serving node, composed in one place: the target, its engine, the controller (adaptive gamma), the
tap (a record publisher), the draft follower, the capture advisor and the suffix feed. `tide serve` (`api.build_app`),
`tide up` (through `tide serve`), the benchmarks and the tests build nodes here.

The seams a second serving engine plugs into are the ones wired here: a tap sink (`TapCallback`,
`producers/tap.py`: the publisher), a draft sink (`Engine.set_draft`, fed by `DraftSync`) and an
acceptance source (the engine's per-draft `DraftStats` and the controller's estimates, read by
`DraftSync` and the capture advisor).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from tide.config import default_draft_dir
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import TargetShape
from tide.serving.capture import CapturePolicy, TrainingAdvisor
from tide.serving.controller import ControllerConfig, build_controller
from tide.serving.draft_sync import DraftSync, SyncConfig
from tide.serving.engine import Engine, EngineConfig
from tide.serving.suffix_feed import SuffixFeed, SuffixFeedConfig

log = logging.getLogger("tide.serving")


@dataclass
class NodeConfig:
    engine: EngineConfig
    kafka: PublisherConfig | None = None  # publish tapped hidden states there
    registry: SyncConfig | None = None  # follow each workload's champion draft
    adaptive: ControllerConfig | None = None  # the controller chooses gamma
    profile_batches: tuple[int, ...] = (1, 4, 16)  # batch sizes whose step times the controller measures
    suffix_feed: bool = False  # every node's requests into the suffix indexes, from the topics (needs kafka)


@dataclass
class ServingNode:
    target: Target
    engine: Engine
    publisher: RecordPublisher | None = None
    sync: DraftSync | None = None
    feed: SuffixFeed | None = None

    @classmethod
    def build(
        cls,
        target: Target,
        draft: Eagle3Draft | None,
        cfg: NodeConfig,
        host_side: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> ServingNode:
        """`host_side`: where background threads start (the publisher's, librdkafka's); a benchmark
        keeps them off the cores it measures."""
        with host_side():
            publisher = RecordPublisher(cfg.kafka, target.fingerprint) if cfg.kafka is not None else None
        engine = Engine(target, draft, cfg.engine, tap=publisher)
        if cfg.adaptive is not None:
            # step times measured here and now, at a few batch sizes (seconds), of the draft as the
            # engine serves it (quantized, given the compiled step); again once what serves changes
            stale = target.compiling
            controller = build_controller(
                target.model, draft, cfg.adaptive, cfg.engine.max_batch, cfg.profile_batches
            )
            engine.use_controller(controller, stale)
        sync = DraftSync(cfg.registry, engine) if cfg.registry is not None else None
        feed = None
        if cfg.suffix_feed:
            if cfg.kafka is None or engine.suffix is None:
                raise ValueError("a suffix feed needs a broker and a proposer that uses the suffix index")
            shape = TargetShape(target.config.hidden_size, target.config.vocab_size)
            with host_side():
                feed = SuffixFeed(
                    SuffixFeedConfig(cfg.kafka.bootstrap), engine.suffix, target.fingerprint, shape
                )
        return cls(target, engine, publisher, sync, feed)

    def advise(self, capture: CapturePolicy) -> None:
        """`auto` capture rules capture while a workload needs training, as the controller and the
        registry follower judge it."""
        if self.engine.controller is not None:
            history = self.sync.candidates if self.sync is not None else None
            capture.advisor = TrainingAdvisor(self.engine.controller, history)

    def start(self) -> None:
        if self.sync is not None:
            self.sync.start()
        if self.feed is not None:
            self.feed.start()

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
        if self.sync is not None:
            self.sync.stop()
        if self.publisher is not None:
            self.publisher.close()


def load_start_draft(target: Target, folder: str | Path | None, dtype: torch.dtype) -> Eagle3Draft | None:
    """The draft a node starts with: `folder`, else the cached default draft, else none (the node
    serves without speculation until the registry brings one)."""
    path = Path(folder) if folder else default_draft_dir(target.fingerprint)
    if not folder and not (path / "model.safetensors").exists():
        log.warning("no draft yet: serving without speculation until one arrives")
        return None
    draft = Eagle3Draft.load(path, target.model.embed_tokens, target.config, target.fingerprint, dtype)
    log.info("draft %s loaded from %s", draft.cfg.version, path)
    return draft
