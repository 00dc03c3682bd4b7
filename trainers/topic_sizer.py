"""Keeps a workload's topic sized for its traffic: every `every_s`, the rate the trainer measured
(`producers.topics.TrafficMeter`, over every node's records) sets retention, segment size and
partitions (`producers.topics.sized`). The topic is changed only when that moves partitions or moves
retention by more than a quarter; a broker that is away is counted as an outage and tried next time."""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from tide.producers.topics import TopicConfig, TopicSizing, TrafficMeter, resize_topic, sized
from tide.trainers.checkpoint import Ledger

log = logging.getLogger("tide.trainers")


class TopicSizer:
    def __init__(self, bootstrap: str, workload: str, sizing: TopicSizing, every_s: float, ledger: Ledger):
        self.workload, self.sizing, self.every_s, self.ledger = workload, sizing, every_s, ledger
        self.admin = AdminClient({"bootstrap.servers": bootstrap, "logger": log})  # type: ignore[dict-item]
        self.applied: TopicConfig | None = None  # what this trainer last set
        self._due = time.monotonic() + every_s

    def __call__(self, meter: TrafficMeter) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.every_s
        rate = meter.rate()
        if rate is None:
            return
        want = sized(rate, self.sizing, TopicConfig())
        last = self.applied
        if (
            last is not None
            and want.partitions <= last.partitions
            and abs(want.retention_bytes / last.retention_bytes - 1) <= 0.25
        ):
            return
        try:
            resize_topic(self.admin, self.workload, want)
        except (KafkaException, TimeoutError) as e:  # an error from the broker, or no answer
            self.ledger.outages += 1
            log.warning(
                "could not resize %s's topic (tried again in %.0f s): %s", self.workload, self.every_s, e
            )
            return
        except Exception:  # a topic's size is never worth the trainer
            self.ledger.outages += 1
            log.exception("could not resize %s's topic", self.workload)
            return
        self.applied = want
        log.info(
            "%s's topic sized for %.0f kB/s: %d partition(s), %.1f MB retained each, %.1f MB segments",
            self.workload, rate / 1e3, want.partitions, want.retention_bytes / 1e6, want.segment_bytes / 1e6,
        )  # fmt: skip
