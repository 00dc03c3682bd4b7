"""Every node's traffic into this node's suffix indexes, within seconds: the token streams of the
records already flowing through the workload topics.

A `SuffixFeed` reads every workload's topic (those made later too) in a consumer group of its own,
from the newest record on, joins each request's records back together (`RequestAssembler`) and
hands its tokens, prompt and completion, to the `SuffixProposer` (`feed`: the engine indexes them at
its next proposal; a request this node served itself is not indexed twice). Records are checked as
every reader checks them: a corrupt, foreign or hostile one is counted by reason and skipped.
Nothing is committed: a node that starts again reads on from the newest record.

What it costs is the node's: decoding a record decompresses its hidden states too (the tokens ride
in the same blob), on this thread, beside serving.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from tide.names import suffix_group
from tide.producers.assembler import RequestAssembler
from tide.producers.consumer import RecordConsumer
from tide.producers.records import TargetShape
from tide.serving.suffix import SuffixProposer

log = logging.getLogger("tide.serving")


@dataclass
class SuffixFeedConfig:
    bootstrap: str
    node: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names this node's group
    stale_seconds: float = 30.0  # a request whose records stop coming goes in as the part it has


class SuffixFeed:
    def __init__(self, cfg: SuffixFeedConfig, proposer: SuffixProposer, fingerprint: str, shape: TargetShape):
        self.cfg, self.proposer = cfg, proposer
        self.consumer = RecordConsumer(cfg.bootstrap, None, suffix_group(cfg.node), fingerprint, shape=shape,
                                       newest=True)  # fmt: skip
        self.requests = RequestAssembler(stale_seconds=cfg.stale_seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tide-suffix-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        self.consumer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(1.0)
            except Exception:  # a broker gone away, say: serving goes on without the feed meanwhile
                log.exception("the suffix feed failed to read; trying again")
                self._stop.wait(5.0)

    def poll(self, timeout: float) -> None:
        """Read what has come and feed the requests it completes."""
        done = self.requests.flush()
        for c in self.consumer.poll(256, timeout):
            done += self.requests.add(c.record)
        for r in done:
            self.proposer.feed(r.workload, r.request_id, r.tokens.tolist())
