"""Reads hidden-state records of chosen workloads; what is not a usable record is counted by reason
and skipped. A record is checked against the target (its `TargetShape`, when given) and its topic's
workload. `positions` says how far every partition was read, refused messages included, so a reader
that commits it moves past poison instead of reading it again after every restart."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from tide.names import every_topic, topic_for, workload_of
from tide.producers.records import (
    ForeignTarget,
    HiddenStateRecord,
    RecordError,
    SchemaMismatch,
    TargetShape,
    decode,
)
from tide.producers.topics import TopicConfig

log = logging.getLogger("tide.producers")


@dataclass
class ConsumedRecord:
    record: HiddenStateRecord
    topic: str
    partition: int
    offset: int
    size: int  # the message's bytes, as it travelled


@dataclass
class ConsumerStats:
    records: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # RecordError.reason -> messages skipped

    @property
    def foreign(self) -> int:  # another target model's records
        return self.refused[ForeignTarget.reason]

    @property
    def schema(self) -> int:  # another schema version
        return self.refused[SchemaMismatch.reason]

    @property
    def skipped(self) -> int:
        return sum(self.refused.values())

    @property
    def corrupt(self) -> int:  # everything else: bytes that are no record, or content that is unusable
        return self.skipped - self.foreign - self.schema


class RecordConsumer:
    def __init__(
        self,
        bootstrap: str,
        workloads: list[str] | None,
        group_id: str,
        target_fingerprint: str,
        topics: TopicConfig | None = None,
        shape: TargetShape | None = None,
        newest: bool = False,
    ):
        """`workloads` None: every workload's topic, those made later too. `newest`: a group with
        no committed offsets starts at the newest record, not the oldest retained."""
        topics = topics or TopicConfig()
        self.fingerprint = target_fingerprint
        self.shape = shape
        self.stats = ConsumerStats()
        self.positions: dict[str, int] = {}  # "topic:partition" -> next offset, past refused messages too
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group_id,
                "auto.offset.reset": "latest" if newest else "earliest",
                "topic.metadata.refresh.interval.ms": 10_000,  # a pattern finds a new workload's topic soon
                "enable.auto.commit": False,  # offsets are committed by whoever made the records durable
                "session.timeout.ms": 10_000,  # a crashed trainer's partitions free up in seconds
                "fetch.max.bytes": max(52_428_800, topics.max_message_bytes),
                "max.partition.fetch.bytes": max(1_048_576, topics.max_message_bytes),
                "logger": log,
            }
        )
        subscribed = [every_topic()] if workloads is None else [topic_for(w) for w in workloads]
        self.consumer.subscribe(subscribed, on_assign=_log_assignment("assigned"),
                                on_revoke=_log_assignment("revoked"), on_lost=_log_assignment("lost"))  # fmt: skip

    @property
    def assigned(self) -> bool:
        """Whether the group has handed this consumer its partitions (until then every poll is empty)."""
        return bool(self.consumer.assignment())

    def poll(self, max_records: int = 64, timeout: float = 1.0) -> list[ConsumedRecord]:
        out: list[ConsumedRecord] = []
        for msg in self.consumer.consume(max_records, timeout):
            err = msg.error()
            if err is not None:
                if err.code() not in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                    log.warning("consumer: %s", err)
                continue
            topic, partition, offset = str(msg.topic()), int(msg.partition() or 0), int(msg.offset() or 0)
            where = f"{topic}:{partition}"
            self.positions[where] = max(self.positions.get(where, 0), offset + 1)
            value = msg.value() or b""
            try:
                record = decode(value, self.fingerprint, self.shape, workload_of(topic))
            except RecordError as e:
                self.stats.refused[e.reason] += 1
                if not isinstance(e, ForeignTarget | SchemaMismatch):  # those are expected, not poison
                    log.warning("skipping a record at %s@%s (%s): %s", where, offset, e.reason, e)
                continue
            except Exception as e:  # whoever can write to the topic must not be able to stop its readers
                self.stats.refused["unexpected"] += 1
                log.exception("skipping a record at %s@%s that failed to decode: %s", where, offset, e)
                continue
            self.stats.records += 1
            out.append(ConsumedRecord(record, topic, partition, offset, len(value)))
        return out

    def commit(self, consumed: list[ConsumedRecord]) -> None:
        """Commit past these records (synchronously): they will not be delivered to this group again."""
        last: dict[tuple[str, int], int] = {}
        for c in consumed:
            key = (c.topic, c.partition)
            last[key] = max(last.get(key, -1), c.offset)
        if last:
            self.consumer.commit(
                offsets=[TopicPartition(t, p, o + 1) for (t, p), o in last.items()], asynchronous=False
            )

    def commit_offsets(self, offsets: dict[str, int]) -> None:
        """Commit {"topic:partition": next offset} synchronously."""
        parts = []
        for where, offset in offsets.items():
            topic, _, partition = where.rpartition(":")
            parts.append(TopicPartition(topic, int(partition), offset))
        if parts:
            self.consumer.commit(offsets=parts, asynchronous=False)

    def close(self) -> None:
        self.consumer.close()


def _log_assignment(what: str) -> Callable[[Any, list[TopicPartition]], None]:
    """Which partitions a group member holds, in its log: a stalled reader shows there."""

    def log_it(_: Any, parts: list[TopicPartition]) -> None:
        log.info(
            "consumer: partitions %s: %s",
            what,
            ", ".join(f"{p.topic}:{p.partition}" for p in parts) or "none",
        )

    return log_it
