"""Serving → Kafka with a real broker: every request's tokens land in its workload's topic, an outage
never touches a request, and consumers skip what they cannot use."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from pathlib import Path

import httpx
import torch
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tide.infra.kafka.broker import KafkaBroker
from tide.models.loader import Target
from tide.names import topic_for
from tide.producers.consumer import ConsumedRecord, RecordConsumer
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import HiddenStateRecord, encode
from tide.producers.topics import TopicConfig, ensure_topic
from tide.serving.api import make_app
from tide.serving.engine import Engine, EngineConfig
from tide.serving.node import ServingNode
from tide.serving.sampling import SamplingParams

from .conftest import serve_process, tiny_target


def _drain(
    bootstrap: str, workload: str, fingerprint: str, until: set[str], timeout: float = 90
) -> tuple[dict[str, list[HiddenStateRecord]], RecordConsumer]:
    """Read the workload's topic until every request in `until` has its last chunk."""
    consumer = RecordConsumer(bootstrap, [workload], f"test-{uuid.uuid4().hex[:8]}", fingerprint)
    by_request: dict[str, list[HiddenStateRecord]] = {}
    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while not until <= done and time.monotonic() < deadline:
        batch: list[ConsumedRecord] = consumer.poll(64, 1.0)
        for c in batch:
            by_request.setdefault(c.record.request_id, []).append(c.record)
            if c.record.last:
                done.add(c.record.request_id)
    consumer.close()
    return by_request, consumer


def _assemble(records: list[HiddenStateRecord]) -> list[int]:
    """One request's chunks, in order and contiguous, back into its token ids."""
    records = sorted(records, key=lambda r: r.chunk)
    assert [r.chunk for r in records] == list(range(len(records))), "a chunk is missing or repeated"
    assert [r.last for r in records] == [False] * (len(records) - 1) + [True]
    position, tokens = 0, []
    for r in records:
        assert r.first_position == position
        tokens += r.tokens[:-1].tolist()
        position += r.num_positions
    return tokens + records[-1].tokens[-1:].tolist()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_every_http_request_lands_in_its_workload_topic(
    kafka: KafkaBroker, trained_draft_dir: Path, target_native: Target, tmp_path: Path
) -> None:
    tok = target_native.tok
    args = ["--draft", str(trained_draft_dir), "--gamma", "3", "--max-batch", "4", "--max-model-len", "512",
            "--kafka", kafka.bootstrap, "--chunk-positions", "24"]  # fmt: skip
    workload = f"http-{uuid.uuid4().hex[:6]}"
    chats = [
        "Write a Python function that adds two numbers.",
        "Explain recursion briefly.",
        "List three fruits.",
    ]
    completions = ["def fibonacci(n):", "import numpy as np\n", "Le chat est"]
    with serve_process(args, tmp_path / "server.log") as url:
        client = httpx.Client(base_url=url, timeout=120, headers={"X-Tide-Workload": workload})

        def chat(p: str) -> tuple[list[int], dict]:
            body = {
                "model": "tide",
                "messages": [{"role": "user", "content": p}],
                "max_tokens": 40,
                "temperature": 0,
            }
            return tok.chat_prompt([{"role": "user", "content": p}]), client.post(
                "/v1/chat/completions", json=body
            ).json()

        def complete(p: str) -> tuple[list[int], dict]:
            # stop strings and sampling: the record must end exactly where the returned completion does
            body = {
                "model": "tide",
                "prompt": p,
                "max_tokens": 50,
                "temperature": 0.8,
                "seed": 3,
                "stop": ["\n\n"],
            }
            return tok.encode(p), client.post("/v1/completions", json=body).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(chat, p) for p in chats] + [pool.submit(complete, p) for p in completions]
            answered = [f.result() for f in futures]
        private = client.post("/v1/completions", headers={"X-Tide-Capture": "off"},
                              json={"model": "tide", "prompt": "my secret", "max_tokens": 8}).json()  # fmt: skip
        ids = {r["id"].split("-", 1)[1]: (prompt, r) for prompt, r in answered}
        by_request, consumer = _drain(kafka.bootstrap, workload, target_native.fingerprint, set(ids))
        assert _metric(url, "tide_capture_records_published_total") == sum(
            len(v) for v in by_request.values()
        )
        assert _metric(url, "tide_capture_records_dropped_total") == 0
    assert set(by_request) == set(ids), "requests missing from the topic, or foreign ones in it"
    assert private["id"].split("-", 1)[1] not in by_request
    assert consumer.stats.skipped == 0
    multi_chunk = 0
    for rid, (prompt, response) in ids.items():
        tokens = _assemble(by_request[rid])
        assert tokens[: len(prompt)] == prompt
        completion = tokens[len(prompt) :]
        assert len(completion) == response["usage"]["completion_tokens"]
        choice = response["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        decoded = tok.decode(completion)
        assert decoded.startswith(text)  # past it: at most the stop string's token
        if choice["finish_reason"] == "length":
            assert decoded == text
        records = by_request[rid]
        multi_chunk += len(records) > 1
        assert all(
            r.workload == workload and r.target_fingerprint == target_native.fingerprint for r in records
        )
        assert records[0].prefill[: len(prompt) - 1].all() and not records[-1].prefill[-1]
    assert multi_chunk >= 3  # chunking was exercised


def test_a_request_that_stops_on_eos_lands_whole_at_once(kafka: KafkaBroker) -> None:
    """The EOS a request stops on is not kept, so its last step taps no position: the publisher must
    still hear that the request ended and publish its last chunk then. (It used to wait for the idle
    flush, 30 s later, and a publisher closed before that lost the chunk: the whole completion.)"""
    prompt = [1, 2, 3, 4]
    free = (
        Engine(tiny_target(seed=7), None, EngineConfig(max_batch=1, max_model_len=64, gamma=0))
        .generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        .output
    )
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    target = tiny_target(seed=7, eos_token_ids=(stop,))
    workload = f"eos-{uuid.uuid4().hex[:6]}"
    publisher = RecordPublisher(
        PublisherConfig(kafka.bootstrap, "bf16", chunk_positions=4), target.fingerprint
    )
    engine = Engine(target, None, EngineConfig(max_batch=1, max_model_len=64, gamma=0), tap=publisher)
    seq = engine.add(prompt, SamplingParams(max_tokens=12), "eos-0", workload=workload)
    while engine.has_work:
        engine.step()
    publisher.close()  # what it still held back would be lost here
    assert seq.finish_reason == "stop" and seq.output == free[: free.index(stop)]
    by_request, _ = _drain(kafka.bootstrap, workload, target.fingerprint, {"eos-0"}, timeout=20)
    assert _assemble(by_request["eos-0"]) == prompt + seq.output


def test_broker_outage_drops_records_never_requests(target_native: Target, tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka").start()
    try:
        cfg = PublisherConfig(broker.bootstrap, "int8-g64", chunk_positions=32, delivery_timeout_ms=3000)
        publisher = RecordPublisher(cfg, target_native.fingerprint)
        engine = Engine(
            target_native, None, EngineConfig(max_batch=4, max_model_len=256, gamma=0), tap=publisher
        )
        body = {"model": "tide", "prompt": "The weather today is", "max_tokens": 12, "temperature": 0}

        def burst(client: TestClient, n: int) -> list[str]:
            ids = []
            for _ in range(n):
                start = time.monotonic()
                r = client.post("/v1/completions", json=body, headers={"X-Tide-Workload": "outage"})
                assert r.status_code == 200, r.text
                assert time.monotonic() - start < 60, "a request stalled"
                ids.append(r.json()["id"].split("-", 1)[1])
            return ids

        with TestClient(make_app(ServingNode(target_native, engine, publisher))) as client:
            before = burst(client, 3)
            publisher.flush()
            assert publisher.stats.records_published == 3 and publisher.stats.records_failed == 0

            broker.stop()
            during = burst(client, 4)
            deadline = time.monotonic() + 30
            lost = 0
            while time.monotonic() < deadline:
                s = publisher.stats
                lost = s.records_dropped + s.records_failed
                if lost >= 4:
                    break
                time.sleep(0.2)
            assert lost >= 4, publisher.stats

            broker.start()
            published = publisher.stats.records_published
            deadline = time.monotonic() + 60
            after: list[str] = []
            while publisher.stats.records_published == published and time.monotonic() < deadline:
                after += burst(client, 1)
                publisher.flush(5)
            assert publisher.stats.records_published > published, "publishing did not resume"
        by_request, _ = _drain(broker.bootstrap, "outage", target_native.fingerprint, {after[-1]})
        assert set(before) <= set(by_request) and after[-1] in by_request
        assert not set(during) & set(by_request)  # dropped, not delivered twice or late
    finally:
        broker.stop()


def test_consumer_counts_and_skips_corrupt_and_foreign_records(kafka: KafkaBroker) -> None:
    workload = f"mixed-{uuid.uuid4().hex[:6]}"
    mine, theirs = "a" * 64, "b" * 64
    ensure_topic(AdminClient({"bootstrap.servers": kafka.bootstrap}), workload, TopicConfig(partitions=1))

    def record(fp: str, rid: str) -> bytes:
        m = 5
        return encode(HiddenStateRecord(torch.arange(m + 1), torch.randn(m, 192), torch.randn(m, 64),
                                        torch.zeros(m, dtype=torch.bool), fp, "v1", workload, rid, 0, 0, True))  # fmt: skip

    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for key, value in [("ok-1", record(mine, "ok-1")), ("junk", b"\x00\x01 not a record"),
                       ("foreign", record(theirs, "foreign")), ("cut", record(mine, "cut")[:40]),
                       ("ok-2", record(mine, "ok-2"))]:  # fmt: skip
        producer.produce(topic_for(workload), key=key, value=value)
    assert producer.flush(30) == 0
    by_request, consumer = _drain(kafka.bootstrap, workload, mine, {"ok-1", "ok-2"})
    assert set(by_request) == {"ok-1", "ok-2"}
    assert consumer.stats.foreign == 1 and consumer.stats.corrupt == 2 and consumer.stats.records == 2
