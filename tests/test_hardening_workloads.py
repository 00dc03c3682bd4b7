"""Hardening of workloads and capture state (issue 30): a node serves a bounded set of workload names,
a new workload's topic never stalls the others' records, and no request's captured states outlive it
(aborted, or silent while others keep the publisher busy)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch
from confluent_kafka.admin import AdminClient
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import tide.producers.publisher as publisher_module
from tide.infra.kafka.broker import KafkaBroker
from tide.models.loader import Target
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.tap import TapEvent
from tide.producers.topics import TopicConfig
from tide.serving.api import ServerConfig, make_app
from tide.serving.capture import CapturePolicy, WorkloadSet
from tide.serving.engine import Engine, EngineConfig
from tide.serving.node import ServingNode
from tide.serving.sampling import SamplingParams

from .conftest import tiny_target
from .test_capture_kafka import _assemble, _drain


def _workload_labels(metrics: str) -> set[str]:
    return {
        s.labels["workload"]
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if "workload" in s.labels
    }


def _sample(metrics: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples if s.name == name)


def test_made_up_workload_names_make_no_state_past_the_cap(target_native: Target) -> None:
    """200 made-up names used to grow /metrics eightfold, each with a topic and a registry poll: past the
    cap, names are served as `default` and counted, and nothing keyed by workload grows."""
    engine = Engine(target_native, None, EngineConfig(max_batch=4, max_model_len=128, gamma=0))
    server = ServerConfig(capture=CapturePolicy(workloads=WorkloadSet(cap=3)))
    body = {"model": "tide", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    names = [f"made-up-{i}" for i in range(12)]
    with TestClient(make_app(ServingNode(target_native, engine), server)) as client:
        for name in names:
            r = client.post("/v1/completions", json=body, headers={"X-Tide-Workload": name})
            assert r.status_code == 200, r.text
        bad = client.post("/v1/completions", json=body, headers={"X-Tide-Workload": "No Spaces!"})
        assert bad.status_code == 400 and "X-Tide-Workload" in bad.json()["error"]["message"]
        metrics = client.get("/metrics").text
    admitted = {"default", *names[:3]}
    assert _workload_labels(metrics) == admitted
    assert _sample(metrics, "tide_workloads_overflow_total") == 9
    assert _sample(metrics, "tide_workloads") == 4
    assert _sample(metrics, "tide_prompt_tokens_total") == 3 * 12  # served all the same
    assert engine.workloads_seen == admitted  # the registry follower polls these, topics are named so


def _run(engine: Engine, rid: str, workload: str, max_tokens: int = 6) -> None:
    engine.add([1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid, workload)
    while engine.has_work:
        engine.step()


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_new_workloads_topic_never_stalls_the_others(
    kafka: KafkaBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating a topic used to happen on the publisher's one worker thread: while the broker took its
    time over a new workload's topic, every other workload's records waited behind it."""
    fast, slow = f"fast-{uuid.uuid4().hex[:6]}", f"slow-{uuid.uuid4().hex[:6]}"
    release = threading.Event()
    real = publisher_module.ensure_topic

    def ensure(admin: AdminClient, workload: str, cfg: TopicConfig, timeout: float = 10.0) -> str:
        if workload == slow:
            release.wait(300)  # the broker taking its time over this one
        return real(admin, workload, cfg, timeout)

    monkeypatch.setattr(publisher_module, "ensure_topic", ensure)
    target = tiny_target(seed=3)
    publisher = RecordPublisher(
        PublisherConfig(kafka.bootstrap, "bf16", chunk_positions=64), target.fingerprint
    )
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=64, gamma=0), tap=publisher)
    try:
        _run(engine, "first", fast)
        _until("the first record", lambda: publisher.stats.records_published == 1)
        _run(engine, "new", slow)  # its topic is being created, and stays so until released
        _run(engine, "after", fast)
        _until(
            "the fast workload's record behind the new topic", lambda: publisher.stats.records_published == 2
        )
        assert not release.is_set()
    finally:
        release.set()
    assert publisher.flush(30) == 0
    publisher.close()
    assert publisher.stats.records_published == 3 and publisher.stats.records_dropped == 0
    by_request, _ = _drain(kafka.bootstrap, slow, target.fingerprint, {"new"}, timeout=30)
    assert set(by_request) == {"new"}  # parked while its topic was made, then published


def test_an_aborted_request_frees_its_capture_state_at_once(kafka: KafkaBroker) -> None:
    """An aborted request's states stayed in the publisher until an idle moment, which steady load
    never gives: now the engine tells the tap at once, and what it got so far is published."""
    workload = f"abort-{uuid.uuid4().hex[:6]}"
    target = tiny_target(seed=5)
    publisher = RecordPublisher(
        PublisherConfig(kafka.bootstrap, "bf16", chunk_positions=1000), target.fingerprint
    )
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=128, gamma=0), tap=publisher)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    steady = engine.add([5, 6, 7], params, "steady", workload)
    left = engine.add([1, 2, 3, 4], params, "left", workload)
    for _ in range(5):
        engine.step()
    assert publisher.pending_requests == {"steady", "left"}
    engine.abort(left)  # its client went away
    engine.step()  # the other request keeps the engine busy
    assert publisher.pending_requests == {"steady"} and not steady.finished
    while engine.has_work:
        engine.step()
    publisher.close()
    assert not publisher.pending_requests
    by_request, _ = _drain(kafka.bootstrap, workload, target.fingerprint, {"steady", "left"}, timeout=30)
    assert _assemble(by_request["left"]) == [1, 2, 3, 4, *left.output]
    assert _assemble(by_request["steady"]) == [5, 6, 7, *steady.output]


def _event(rid: str, workload: str, first: int, tokens: list[int], final: bool) -> TapEvent:
    m = len(tokens) - 1
    return TapEvent(rid, workload, first, torch.tensor(tokens), torch.randn(m, 192), torch.randn(m, 64),
                    first == 0, "none", final)  # fmt: skip


def test_a_silent_request_is_flushed_under_steady_load(kafka: KafkaBroker) -> None:
    """A request that falls silent without an end (its engine gave up on it) is published after
    `idle_flush_s`; the flush used to wait for a second without records, which steady load never gives."""
    workload = f"silent-{uuid.uuid4().hex[:6]}"
    cfg = PublisherConfig(kafka.bootstrap, "bf16", chunk_positions=1000, idle_flush_s=0.5)
    publisher = RecordPublisher(cfg, "f" * 64)
    publisher(_event("silent", workload, 0, [1, 2, 3, 4], final=False))
    busy = 0
    deadline = time.monotonic() + 60
    while "silent" in publisher.pending_requests:  # other requests keep coming, ten a second
        assert time.monotonic() < deadline, "the silent request was never flushed"
        publisher(_event(f"busy-{busy}", workload, 0, [7, 8, 9], final=True))
        busy += 1
        time.sleep(0.1)
    publisher.close()
    by_request, _ = _drain(kafka.bootstrap, workload, "f" * 64, {"silent"}, timeout=30)
    assert _assemble(by_request["silent"]) == [1, 2, 3, 4]
