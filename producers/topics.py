"""One Kafka topic per workload, created on demand, so a trainer reads one workload alone."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from tide.names import topic_for


@dataclass
class TopicConfig:
    partitions: int = 3  # a hot workload spreads over several; a request's chunks share one (keyed)
    retention_ms: int = 24 * 3600 * 1000
    max_message_bytes: int = 1_048_588  # the broker's default limit
    replication: int = 1  # the local single-node broker; more on a real cluster
    # records only need to outlive the trainer's lag: bounding the log by size keeps storage small
    retention_bytes: int = -1  # per partition; -1: no size limit
    segment_bytes: int = 64 << 20  # retention deletes whole closed segments


def ensure_topic(admin: AdminClient, workload: str, cfg: TopicConfig, timeout: float = 10.0) -> str:
    """Create the workload's topic unless it exists; raises KafkaException when the broker is away."""
    topic = topic_for(workload)
    new = NewTopic(
        topic,
        num_partitions=cfg.partitions,
        replication_factor=cfg.replication,
        config={
            "retention.ms": str(cfg.retention_ms),
            "retention.bytes": str(cfg.retention_bytes),
            "segment.bytes": str(cfg.segment_bytes),
            "max.message.bytes": str(cfg.max_message_bytes),
        },
    )
    future = admin.create_topics([new], operation_timeout=timeout, request_timeout=timeout)[topic]
    try:
        future.result(timeout=timeout)
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
    return topic
