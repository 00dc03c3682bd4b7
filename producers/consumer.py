"""Reads hidden-state records of chosen workloads; what does not decode is counted and skipped."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, TopicPartition

from tide.producers.records import ForeignTarget, HiddenStateRecord, RecordError, SchemaMismatch, decode
from tide.producers.topics import TopicConfig, topic_for

log = logging.getLogger("tide.producers")


@dataclass
class ConsumedRecord:
    record: HiddenStateRecord
    topic: str
    partition: int
    offset: int


@dataclass
class ConsumerStats:
    records: int = 0
    corrupt: int = 0
    foreign: int = 0  # another target model's records
    schema: int = 0  # another schema version

    @property
    def skipped(self) -> int:
        return self.corrupt + self.foreign + self.schema


class RecordConsumer:
    def __init__(
        self,
        bootstrap: str,
        workloads: list[str],
        group_id: str,
        target_fingerprint: str,
        topics: TopicConfig | None = None,
    ):
        topics = topics or TopicConfig()
        self.fingerprint = target_fingerprint
        self.stats = ConsumerStats()
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group_id,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,  # offsets are committed by whoever made the records durable
                "session.timeout.ms": 10_000,  # a crashed trainer's partitions free up in seconds
                "fetch.max.bytes": max(52_428_800, topics.max_message_bytes),
                "max.partition.fetch.bytes": max(1_048_576, topics.max_message_bytes),
                "logger": log,
            }
        )
        self.consumer.subscribe([topic_for(w) for w in workloads])

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
            try:
                record = decode(msg.value() or b"", self.fingerprint)
            except ForeignTarget:
                self.stats.foreign += 1
                continue
            except SchemaMismatch:
                self.stats.schema += 1
                continue
            except RecordError as e:
                self.stats.corrupt += 1
                log.warning(
                    "skipping a corrupt record at %s[%s]@%s: %s",
                    msg.topic(),
                    msg.partition(),
                    msg.offset(),
                    e,
                )
                continue
            self.stats.records += 1
            out.append(
                ConsumedRecord(record, str(msg.topic()), int(msg.partition() or 0), int(msg.offset() or 0))
            )
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
