"""The real single-node Kafka broker: topics, produce/consume, and data and offsets surviving a restart."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from tide.infra.kafka.broker import BrokerError, KafkaBroker

TOPIC = "tide-test-events"


def _consume(bootstrap: str, group: str, n: int, timeout: float = 30) -> list[bytes]:
    """Read n messages as consumer group `group` (from the start when it has no committed offset), then commit."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([TOPIC])
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg.value() or b"")
        if got:
            consumer.commit(asynchronous=False)
        # nothing beyond the expected messages
        extra = consumer.poll(1.0)
        assert extra is None or extra.error() is not None, f"unexpected message {extra.value()!r}"
    finally:
        consumer.close()
    return got


def _produce(producer: Producer, values: list[bytes]) -> None:
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    for v in values:
        producer.produce(TOPIC, value=v, on_delivery=on_delivery)
    assert producer.flush(30) == 0, "messages still queued after 30s"
    assert not errors, errors


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow  # starts a real server
def test_broker_produce_consume_restart(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka")
    try:
        broker.start(timeout=90)
    except BrokerError as e:  # no skip: a missing mvn/java or a broken pom must show up as a failure
        pytest.fail(f"could not start the Kafka broker: {e}")
    try:
        bootstrap, port = broker.bootstrap, broker.port
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=1)])[TOPIC].result(30)

        # the producer outlives the restart, as the serving side's will
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
        first = [b"msg-0", b"msg-1", b"msg-2"]
        _produce(producer, first)
        group = f"g-{uuid.uuid4().hex[:8]}"
        assert _consume(bootstrap, group, 3) == first

        assert broker.process is not None
        rss = _rss_mb(broker.process.pid)
        assert rss < 512, f"broker RSS {rss:.0f} MB"

        broker.restart(timeout=90)
        assert broker.port == port and broker.bootstrap == bootstrap
        assert _consume(bootstrap, f"fresh-{uuid.uuid4().hex[:8]}", 3) == first  # data survived
        _produce(producer, [b"msg-3"])
        assert _consume(bootstrap, group, 1) == [b"msg-3"]  # committed offsets survived too
        del producer, admin
    finally:
        broker.stop()
    assert not broker.running
    broker.stop()  # idempotent
