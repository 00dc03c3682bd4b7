"""The draft sink and acceptance source of a vLLM node, for the same `DraftSync` a TIDE node runs.

It lives in vLLM's OpenAI server process, beside vLLM's engine client. A downloaded draft is checked
as TIDE's engine checks it (`Eagle3Draft.load` against the target's embedding and config, read from
the HF folder vLLM serves), exported to the speculators format and swapped into vLLM's drafter by
the worker (`worker.TideWorker.tide_load_draft`, through `collective_rpc`, between two steps); the
prefix cache is then emptied, since its blocks hold the old draft's KV entries. Live acceptance is
vLLM's own speculation counters (the ones its `/metrics` shows) since the swap.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from prometheus_client import REGISTRY

from tide.models.eagle3 import DraftLoadError, Eagle3Draft
from tide.models.loader import TargetHead, load_head
from tide.registry.profile import StepProfile
from tide.serving.draft_sink import LiveAcceptance
from tide.serving.vllm_adapter.config import VllmConfig
from tide.trainers.export import export_speculators

log = logging.getLogger("tide.serving.vllm")
SWAP_SECONDS = 300.0  # a swap waits for the step in flight; one that takes longer failed


def spec_counters() -> tuple[float, float]:
    """vLLM's speculation counters in this process: drafts (sequence-steps that drafted), accepted
    draft tokens."""
    drafts = accepted = 0.0
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "vllm:spec_decode_num_drafts_total":
                drafts += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_total":
                accepted += s.value
    return drafts, accepted


class VllmDrafts:
    """`DraftSink` over vLLM's engine client (its methods are called from the sync's thread)."""

    def __init__(self, cfg: VllmConfig, engine: Any, loop: asyncio.AbstractEventLoop):
        assert cfg.follow is not None and cfg.draft_dir is not None
        self.cfg, self.follow, self.engine, self.loop = cfg, cfg.follow, engine, loop
        self.start: Path = cfg.draft_dir  # the draft vLLM started with, exported
        self.version = self.cfg.draft_version
        self.since = spec_counters()
        # what a downloaded draft is checked against; a node told the wrong target does not start
        self.head: TargetHead = load_head(cfg.model_dir)
        if self.head.fingerprint != self.fingerprint:
            raise ValueError(f"{cfg.model_dir} is not the target {self.fingerprint[:12]} the node follows")
        self._work = Path(tempfile.mkdtemp(prefix="tide-vllm-drafts-"))
        self._serving: Path | None = None  # the exported folder of the last draft swapped in
        self._exports = itertools.count()
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        return self.follow.fingerprint

    @property
    def gamma(self) -> int:
        return self.cfg.gamma

    def workloads(self) -> set[str]:
        return {self.follow.workload}

    def read_draft(self, path: str | Path) -> Eagle3Draft:
        return Eagle3Draft.load(path, self.head.embed, self.head.config, self.fingerprint, torch.float32)

    def set_draft(
        self, draft: Eagle3Draft | None, workload: str = "default", expected: dict[int, float] | None = None
    ) -> None:
        if workload != self.follow.workload:
            raise ValueError(f"this vLLM node follows {self.follow.workload!r}, not {workload!r}")
        with self._lock:
            folder, version = (self.start, self.cfg.draft_version) if draft is None else self._export(draft)
            try:
                asyncio.run_coroutine_threadsafe(self._swap(folder), self.loop).result(SWAP_SECONDS)
            except Exception as e:
                if draft is not None:
                    shutil.rmtree(folder, ignore_errors=True)
                raise DraftLoadError(f"vLLM refused draft {version}: {e}", "engine_refused") from e
            if self._serving is not None and self._serving != folder:
                shutil.rmtree(self._serving, ignore_errors=True)
            self._serving = folder if draft is not None else None
            self.version, self.since = version, spec_counters()
            log.info("vLLM serves draft %s for %s", version, workload)

    def _export(self, draft: Eagle3Draft) -> tuple[Path, str]:
        version = draft.cfg.version
        source, out = self._work / "source", self._work / f"draft-{next(self._exports)}"
        draft.save(source)
        try:
            export_speculators(source, out, verifier_name_or_path=str(self.cfg.model_dir),
                               speculative_tokens=self.cfg.gamma)  # fmt: skip
        finally:
            shutil.rmtree(source, ignore_errors=True)
        return out, version

    async def _swap(self, folder: Path) -> None:
        await self.engine.collective_rpc("tide_load_draft", args=(str(folder),))
        # best effort: vLLM keeps blocks that running requests hold (they are freed as they end)
        await self.engine.reset_prefix_cache()

    def acceptance(self, workload: str) -> LiveAcceptance | None:
        if workload != self.follow.workload:
            return None
        drafts, accepted = (now - then for now, then in zip(spec_counters(), self.since, strict=True))
        return LiveAcceptance(self.version, int(drafts), 1.0 + accepted / drafts if drafts else 0.0)

    def step_profile(self) -> StepProfile | None:
        return None  # vLLM's step times are not measured here: the gate judges its versions by tau

    def close(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)
