"""Topics sized from their traffic: the rule, the rate a trainer measures, and the change made on a
real broker (retention and segments set, partitions grown, never shrunk)."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from tide.infra.kafka.broker import KafkaBroker
from tide.names import topic_for
from tide.producers.topics import (
    MIN_SEGMENT_BYTES,
    TopicConfig,
    TopicSizing,
    TrafficMeter,
    ensure_topic,
    resize_topic,
    sized,
    topic_partitions,
)
from tide.trainers import topic_sizer
from tide.trainers.checkpoint import Ledger
from tide.trainers.topic_sizer import TopicSizer


def test_a_topic_keeps_what_a_trainer_that_far_behind_needs() -> None:
    sizing = TopicSizing(keep_seconds=600, segments=4, partition_bytes_per_s=4e6)
    quiet = sized(300e3, sizing, TopicConfig())  # a CPU node: about 200 tokens/s of 1.5 kB records
    assert quiet.partitions == 1 and quiet.retention_bytes == 180_000_000
    assert quiet.segment_bytes == 45_000_000  # retention deletes a quarter of it at a time
    busy = sized(10e6, sizing, TopicConfig())  # GPU nodes
    assert busy.partitions == 3 and busy.retention_bytes == 2_000_000_000
    tiny = sized(10.0, sizing, TopicConfig())  # never below what one segment (and one record) needs
    assert tiny.segment_bytes >= MIN_SEGMENT_BYTES and tiny.retention_bytes == tiny.segment_bytes
    assert sized(1e12, sizing, TopicConfig()).partitions == sizing.max_partitions


def test_the_traffic_rate_comes_from_when_records_were_made() -> None:
    meter = TrafficMeter()
    assert meter.rate() is None
    for i in range(100):  # 10 records a second of 2,000 bytes, read all at once by a trainer behind
        meter.add(1000.0 + i / 10, 2000)
    assert abs(meter.rate() - 20_000) < 1  # type: ignore[operator]
    for t in (0.0, 1e12):  # forged or skewed times move no estimate
        meter.add(t, 10**6)
    assert abs(meter.rate() - 20_000) < 300  # type: ignore[operator]
    still = TrafficMeter()
    for _ in range(50):  # made in the same instant: no span to measure over
        still.add(5.0, 100)
    assert still.rate() is None


def _topic_settings(admin: AdminClient, workload: str) -> dict[str, str]:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic_for(workload))
    entries = admin.describe_configs([resource])[resource].result(30)
    return {k: v.value for k, v in entries.items() if k in ("retention.bytes", "segment.bytes")}


def test_a_trainer_sizes_its_topic_on_the_broker(kafka: KafkaBroker) -> None:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    workload = f"sized-{uuid.uuid4().hex[:6]}"
    ensure_topic(admin, workload, TopicConfig())
    assert (
        topic_partitions(admin, workload) == 1 and _topic_settings(admin, workload)["retention.bytes"] == "-1"
    )

    ledger = Ledger()
    sizer = TopicSizer(kafka.bootstrap, workload, TopicSizing(keep_seconds=60), 0.0, ledger)
    meter = TrafficMeter()
    for i in range(200):
        meter.add(i / 20, 50_000)  # 1 MB/s
    sizer(meter)
    assert sizer.applied is not None and ledger.outages == 0
    assert _topic_settings(admin, workload) == {
        "retention.bytes": str(sizer.applied.retention_bytes),
        "segment.bytes": str(sizer.applied.segment_bytes),
    }
    assert 55e6 < sizer.applied.retention_bytes < 65e6
    # more traffic than a partition takes: partitions grow; less again: they stay
    resize_topic(admin, workload, TopicConfig(partitions=3, retention_bytes=8 << 20, segment_bytes=2 << 20))
    assert topic_partitions(admin, workload) == 3
    resize_topic(admin, workload, TopicConfig(partitions=1, retention_bytes=8 << 20, segment_bytes=2 << 20))
    assert topic_partitions(admin, workload) == 3


def _resize_once(bootstrap: str) -> tuple[TopicSizer, Ledger]:
    """A sizer due at once, given 20 s of traffic to size for."""
    ledger = Ledger()
    sizer = TopicSizer(bootstrap, "w", TopicSizing(), 0.0, ledger)
    meter = TrafficMeter()
    for i in range(20):
        meter.add(float(i), 1000)
    sizer(meter)
    return sizer, ledger


def test_a_broker_that_is_away_is_an_outage_not_a_crash() -> None:
    sizer, ledger = _resize_once("127.0.0.1:1")
    assert sizer.applied is None and ledger.outages == 1


def test_no_failure_to_resize_ends_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise ValueError("a bug, or an answer the client did not expect")

    monkeypatch.setattr(topic_sizer, "resize_topic", broken)
    sizer, ledger = _resize_once("127.0.0.1:1")
    assert sizer.applied is None and ledger.outages == 1
