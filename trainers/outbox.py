"""What a trainer must get to services that may be away: the newest candidate to publish (MLflow)
and the newest offsets to commit (Kafka). Each is tried when its capped exponential backoff is due
and kept until it goes through; a newer one replaces a waiting one. Training never waits for them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tide.trainers.checkpoint import Ledger
from tide.trainers.ttt import Metrics

log = logging.getLogger("tide.trainers")


@dataclass
class Candidate:
    folder: Path
    version: str
    metrics: Metrics
    ledger: Ledger
    gain: float  # held-out tau over the previous candidate's (or the start draft's), same examples


@dataclass
class Backoff:
    """Capped exponential backoff for a service that may be away: `due()` says whether to try now."""

    first_s: float = 1.0
    cap_s: float = 60.0
    failures: int = 0
    next_at: float = 0.0  # time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self) -> float:
        """Record a failure; returns the seconds until the next try."""
        delay = min(self.cap_s, self.first_s * 2**self.failures)
        self.failures += 1
        self.next_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures, self.next_at = 0, 0.0


class Outbox:
    def __init__(
        self, publish: Callable[[Candidate], None] | None, commit: Callable[[dict[str, int]], None],
        ledger: Ledger, first_s: float, cap_s: float,
    ):  # fmt: skip
        self.publish, self.commit, self.ledger = publish, commit, ledger  # the ledger counts outages
        self.mlflow = Backoff(first_s, cap_s)
        self.kafka = Backoff(first_s, cap_s)
        self.candidate: Candidate | None = None  # waiting to be published
        self.offsets: dict[str, int] | None = None  # waiting to be committed

    def call(self, backoff: Backoff, what: str, call: Callable[[], None]) -> bool:
        """Call a service that may be away; a failure is counted, logged and retried after a backoff."""
        try:
            call()
        except Exception as e:  # MLflow, S3 and Kafka raise many types; none of them may end the trainer
            self.ledger.outages += 1
            log.warning(
                "could not %s (%s: %s); trying again in %.0f s", what, type(e).__name__, e, backoff.failed()
            )
            return False
        backoff.succeeded()
        return True

    def flush(self) -> None:
        """Publish the waiting candidate and commit the waiting offsets, each when its backoff is due."""
        c, publish, offsets = self.candidate, self.publish, self.offsets
        if (
            c is not None
            and self.mlflow.due()
            and (publish is None or self.call(self.mlflow, f"publish {c.version}", lambda: publish(c)))
        ):
            self.candidate = None
        if (
            offsets is not None
            and self.kafka.due()
            and self.call(self.kafka, "commit offsets", lambda: self.commit(offsets))
        ):
            self.offsets = None
