"""The suffix feed: requests one node served reach another node's suffix index through the
workload's topic on a real broker; what is not a record is counted and skipped, and a request the
node served itself is not indexed twice."""

from __future__ import annotations

import time
import uuid

import torch
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from tests.conftest import tiny_target
from tide.cli import app
from tide.infra.kafka.broker import KafkaBroker
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import TargetShape
from tide.producers.topics import TopicConfig, ensure_topic
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.suffix_feed import SuffixFeed, SuffixFeedConfig


def test_a_node_indexes_what_another_node_served(kafka: KafkaBroker) -> None:
    target = tiny_target(seed=5, scale=2.0)
    workload = f"feed-{uuid.uuid4().hex[:6]}"
    topic = ensure_topic(AdminClient({"bootstrap.servers": kafka.bootstrap}), workload, TopicConfig())
    node = Engine(target, None, EngineConfig(max_batch=4, max_model_len=64, gamma=3, proposer="suffix"))
    assert node.suffix is not None
    shape = TargetShape(target.config.hidden_size, target.config.vocab_size)
    feed = SuffixFeed(SuffixFeedConfig(kafka.bootstrap), node.suffix, target.fingerprint, shape)
    try:
        deadline = time.monotonic() + 60  # the feed reads from the newest record on: wait for its partitions
        while not any(tp.topic == topic for tp in feed.consumer.consumer.assignment()):
            assert time.monotonic() < deadline, "the feed was never assigned the workload's topic"
            feed.poll(0.5)

        # another node serves three requests with capture on
        publisher = RecordPublisher(PublisherConfig(kafka.bootstrap, chunk_positions=8), target.fingerprint)
        other = Engine(target, None, EngineConfig(max_batch=4, max_model_len=64, gamma=0), tap=publisher)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(3)]
        ids = [f"other-{i}" for i in range(3)]
        seqs = [
            other.add(p, SamplingParams(max_tokens=20, ignore_eos=True), rid, workload=workload)
            for rid, p in zip(ids, prompts, strict=True)
        ]
        while other.has_work:
            other.step()
        served = {s.request_id: s.prompt + s.output for s in seqs}
        publisher.close()
        with_garbage = Producer({"bootstrap.servers": kafka.bootstrap})
        with_garbage.produce(topic, b"\x28\xb5\x2f\xfd not a record")  # hostile bytes in the same topic
        with_garbage.flush(10)
        node.suffix.remember(workload, served[ids[2]], ids[2])  # as if this node had served the third

        deadline = time.monotonic() + 60
        while node.suffix.fed + node.suffix.fed_dropped < 2 or not feed.consumer.stats.skipped:
            assert time.monotonic() < deadline, (node.suffix.fed, feed.consumer.stats)
            feed.poll(0.5)
            node.suffix.take_fed()  # what the engine does once a step
        assert node.suffix.fed == 2 and node.suffix.fed_dropped == 0  # the third was this node's own
        assert feed.consumer.stats.corrupt == 1
        tokens = served[ids[0]]
        proposal = node.suffix.propose(workload, torch.tensor(tokens[:9]), 4)
        assert proposal is not None and proposal.tokens == tokens[9 : 9 + len(proposal.tokens)]
    finally:
        feed.stop()


def test_a_suffix_feed_needs_a_broker_and_the_index() -> None:
    for args in (
        ["--suffix-feed", "--proposer", "hybrid"],
        ["--suffix-feed", "--kafka", "127.0.0.1:1"],
        ["--suffix-feed", "--kafka", "127.0.0.1:1", "--engine", "vllm"],  # vLLM drafts with the draft only
    ):
        res = CliRunner().invoke(app, ["serve", *args])
        assert res.exit_code == 2 and "--suffix-feed" in res.output, res.output
