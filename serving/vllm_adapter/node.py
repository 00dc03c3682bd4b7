"""What TIDE runs inside vLLM's OpenAI server: the tap attached to the workers, the registry follower
(`DraftSync` over `VllmDrafts`) and TIDE's metrics, composed from the node's `VllmConfig` (which
`tide serve --engine vllm` hands the server in `TIDE_VLLM_NODE`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tide.producers.publisher import PublisherStats
from tide.serving.draft_sync import DraftSync, SyncConfig
from tide.serving.metrics import CaptureCollector, SyncCollector
from tide.serving.vllm_adapter.config import NODE_ENV, VllmConfig
from tide.serving.vllm_adapter.drafts import VllmDrafts


class _DraftCollector(Collector):
    def __init__(self, drafts: VllmDrafts):
        self.drafts = drafts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        d = self.drafts
        now = d.acceptance(d.follow.workload)
        assert now is not None
        labels = [d.follow.workload, now.version]
        for name, doc, value in (
            ("tide_draft_info", "The draft in use, by workload (value 1)", 1.0),
            ("tide_draft_steps", "Sequence steps on the draft since it was swapped in", float(now.steps)),
            ("tide_draft_tokens_per_step", "Tokens per sequence step on the draft since it was swapped in",
             now.tokens_per_step),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=["workload", "version"])
            family.add_metric(labels, value)
            yield family


class VllmNode:
    def __init__(self, cfg: VllmConfig, engine: Any):
        self.cfg, self.engine = cfg, engine
        self.drafts: VllmDrafts | None = None
        self.sync: DraftSync | None = None

    @classmethod
    def from_env(cls, engine: Any) -> VllmNode | None:
        text = os.environ.get(NODE_ENV)
        return cls(VllmConfig.from_json(text), engine) if text else None

    async def start(self) -> None:
        if self.cfg.tap is not None:
            await self.engine.collective_rpc("tide_attach_tap", args=(json.dumps(asdict(self.cfg.tap)),))
        f = self.cfg.follow
        if f is not None:
            self.drafts = VllmDrafts(self.cfg, self.engine, asyncio.get_running_loop())
            sync = SyncConfig(f.tracking_uri, Path(f.cache_dir), f.node, f.poll_seconds, (),
                              f.rollback_tolerance, f.rollback_min_steps, publish_profile=False)  # fmt: skip
            self.sync = DraftSync(sync, self.drafts).start()

    def stop(self) -> None:
        if self.sync is not None:
            self.sync.stop()
        if self.drafts is not None:
            self.drafts.close()

    def health(self) -> dict[str, object]:
        """What TIDE's `/health` says of a node (vLLM's answers whether the engine is alive)."""
        if self.drafts is not None:
            version, drafts = self.drafts.version, {self.drafts.follow.workload: self.drafts.version}
        else:
            version = self.cfg.draft_version or "none"
            drafts = {"default": version} if self.cfg.draft_dir else {}
        return {"status": "ok", "engine": "vllm", "draft": version, "drafts": drafts,
                "gamma": self.cfg.gamma if self.cfg.draft_dir else 0}  # fmt: skip

    async def metrics(self) -> bytes:
        """TIDE's metrics of this node, in Prometheus' text format (appended to vLLM's own)."""
        registry = CollectorRegistry()
        if self.cfg.tap is not None:
            counters: dict[str, int] = (await self.engine.collective_rpc("tide_tap_stats"))[0]
            stats = PublisherStats(**{f.name: counters.get(f.name, 0) for f in fields(PublisherStats)})
            pending = counters.get("pending_requests", 0)
            registry.register(CaptureCollector(lambda: (stats, pending)))
        if self.sync is not None and self.drafts is not None:
            registry.register(SyncCollector(self.sync, None))
            registry.register(_DraftCollector(self.drafts))
        return generate_latest(registry)
