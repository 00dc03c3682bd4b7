"""One Kafka topic per workload, created on demand, so a trainer reads one workload alone; its size
follows the workload's traffic.

Records only need to outlive the trainer's lag, so a topic keeps `TopicSizing.keep_seconds` of its
traffic (by size: retention deletes whole closed segments, so a log holds retention plus at most one
segment a partition), and takes a partition per `partition_bytes_per_s`. The trainer measures its
topic's rate from the records' creation times (every node's records, not one node's) and resizes
(`sized`, `resize_topic`). Partitions only grow: a request in flight while they do may land its later
chunks in another partition, and the assembler then passes it on as the pieces it has.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from tide.names import topic_for

MIN_SEGMENT_BYTES = 1 << 20  # Kafka 4's floor for segment.bytes


@dataclass
class TopicConfig:
    partitions: int = 1  # the trainer adds more when the traffic needs them; a request's chunks share one
    retention_ms: int = 24 * 3600 * 1000
    max_message_bytes: int = 1_048_588  # the broker's default limit
    replication: int = 1  # the local single-node broker; more on a real cluster
    retention_bytes: int = -1  # per partition; -1: no size limit (until the trainer sizes it)
    segment_bytes: int = 64 << 20  # retention deletes whole closed segments


@dataclass(frozen=True)
class TopicSizing:
    keep_seconds: float = 1800.0  # how far a trainer may fall behind (a restart, an outage) losing nothing
    segments: int = 4  # retention in this many segments: the log is at most 1 + 1/segments of it
    partition_bytes_per_s: float = float(4 << 20)  # one partition's share of the traffic
    max_partitions: int = 32


def sized(bytes_per_s: float, sizing: TopicSizing, base: TopicConfig) -> TopicConfig:
    """`base` with partitions, retention and segments for this traffic rate (bytes a second, all nodes)."""
    partitions = min(sizing.max_partitions, max(1, math.ceil(bytes_per_s / sizing.partition_bytes_per_s)))
    keep = math.ceil(bytes_per_s * sizing.keep_seconds / partitions)
    segment = max(MIN_SEGMENT_BYTES, base.max_message_bytes, math.ceil(keep / sizing.segments))
    return replace(base, partitions=partitions, retention_bytes=max(keep, segment), segment_bytes=segment)


class TrafficMeter:
    """A topic's rate from the records read: their bytes over the span of their creation times (the
    middle 80% of the last `window` records: a clock far off, or a forged time, moves no estimate)."""

    def __init__(self, window: int = 512):
        self._seen: deque[tuple[float, int]] = deque(maxlen=window)

    def add(self, created_at: float, size: int) -> None:
        self._seen.append((created_at, size))

    def __len__(self) -> int:
        return len(self._seen)

    def rate(self) -> float | None:
        """Bytes a second, or None before there is a span to measure over."""
        seen = sorted(self._seen)
        lo, hi = len(seen) // 10, len(seen) - 1 - len(seen) // 10
        if hi - lo < 2 or seen[hi][0] - seen[lo][0] <= 0:
            return None
        # records lo+1 .. hi were made in the span from lo's time to hi's
        return sum(size for _, size in seen[lo + 1 : hi + 1]) / (seen[hi][0] - seen[lo][0])


def _topic_config(cfg: TopicConfig) -> dict[str, str]:
    return {
        "retention.ms": str(cfg.retention_ms),
        "retention.bytes": str(cfg.retention_bytes),
        "segment.bytes": str(cfg.segment_bytes),
        "max.message.bytes": str(cfg.max_message_bytes),
    }


def ensure_topic(admin: AdminClient, workload: str, cfg: TopicConfig, timeout: float = 10.0) -> str:
    """Create the workload's topic unless it exists; raises KafkaException when the broker is away."""
    topic = topic_for(workload)
    new = NewTopic(
        topic, num_partitions=cfg.partitions, replication_factor=cfg.replication, config=_topic_config(cfg)
    )
    future = admin.create_topics([new], operation_timeout=timeout, request_timeout=timeout)[topic]
    try:
        future.result(timeout=timeout)
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
    return topic


def topic_partitions(admin: AdminClient, workload: str, timeout: float = 10.0) -> int:
    topic = topic_for(workload)
    meta = admin.list_topics(topic, timeout=timeout).topics[topic]
    if meta.error is not None:
        raise KafkaException(meta.error)
    return len(meta.partitions)


def resize_topic(admin: AdminClient, workload: str, cfg: TopicConfig, timeout: float = 10.0) -> None:
    """Give the workload's existing topic `cfg`'s retention and segment size, and its partitions if
    more than it has (never fewer); raises KafkaException when the broker is away."""
    topic = topic_for(workload)
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in _topic_config(cfg).items()
            if k in ("retention.bytes", "segment.bytes")
        ],
    )
    for future in admin.incremental_alter_configs([resource], request_timeout=timeout).values():
        future.result(timeout=timeout)
    if cfg.partitions > topic_partitions(admin, workload, timeout):
        new = NewPartitions(topic, cfg.partitions)
        admin.create_partitions([new], request_timeout=timeout)[topic].result(timeout=timeout)
