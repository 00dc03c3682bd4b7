"""Issue 30, isolation: no request can hurt another, and a failing draft costs speculation, not requests.

Tiny random models with a byte-level tokenizer keep these fast; faults are injected at the
boundary of one sequence's own work (fault hooks), next to an innocent sequence whose text must be
exactly what it is alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tiny_draft, tiny_target
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target
from tide.producers.tap import TapEvent
from tide.serving.api import make_app
from tide.serving.engine import Engine, EngineConfig
from tide.serving.node import ServingNode
from tide.serving.sampling import SamplingParams
from tide.serving.sequence import Sequence

POISON = 7  # a byte the test tokenizer refuses to decode


class ByteTokenizer:
    """Token id = UTF-8 byte; decoding a window holding POISON raises (a hostile value that passes
    every check before the engine)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        if POISON in ids:
            raise RuntimeError("injected: this token cannot be decoded")
        return bytes(ids).decode(errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


@pytest.fixture(scope="module")
def target() -> Target:
    t = tiny_target(seed=5)
    return Target(t.model, ByteTokenizer(), t.fingerprint, Path("/nonexistent"))  # type: ignore[arg-type]


def _engine(target: Target, draft: Eagle3Draft | None = None, gamma: int = 0, **kw: Any) -> Engine:
    return Engine(target, draft, EngineConfig(max_batch=4, max_model_len=128, gamma=gamma, **kw))


def _alone(target: Target, prompt: list[int], params: SamplingParams) -> list[int]:
    return _engine(target).generate([prompt], params)[0].output


def _run(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


INNOCENT = [60, 61, 62, 63, 64, 65]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=24, ignore_eos=True)


# -- per-sequence faults inside a step -------------------------------------------------------------
def _fault_in_append(engine: Engine) -> None:
    real = Sequence.append

    def append(self: Sequence, tokens: list[int], eos: set[int]) -> list[int]:
        if self.request_id == "hostile" and len(self.output) >= 3:
            raise RuntimeError("injected: appending fails")
        return real(self, tokens, eos)

    Sequence.append = append  # restored by the test


def _fault_in_forward(engine: Engine, in_prefill: bool) -> None:
    """The target's forward raises on any batch that holds the hostile sequence (in its prefill,
    or once it has a few tokens): the batched decode has to find the culprit."""
    real = engine.model.forward

    def forward(tokens: torch.Tensor, batch: Any, *args: Any, **kw: Any) -> Any:
        rows = range(batch.slot0, batch.slot0 + tokens.shape[0])
        seqs = [engine.running[r] for r in rows if r < len(engine.running)]
        hostile = [s for s in seqs if s.request_id == "hostile"]
        if hostile and (in_prefill or len(hostile[0].output) >= 3):
            raise RuntimeError("injected: forward fails")
        return real(tokens, batch, *args, **kw)

    engine.model.forward = forward


FAULTS: dict[str, Callable[[Engine], None]] = {
    "append": _fault_in_append,
    "prefill_forward": lambda e: _fault_in_forward(e, True),
    "batched_decode_forward": lambda e: _fault_in_forward(e, False),
}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_sequence_whose_own_work_raises_fails_alone(
    target: Target, fault: str, params: SamplingParams
) -> None:
    alone = _alone(target, INNOCENT, params)
    engine = _engine(target)
    real_forward, real_append = engine.model.forward, Sequence.append
    try:
        FAULTS[fault](engine)
        first = engine.add(INNOCENT, params, "first")
        hostile = engine.add([1, 2, 3, 4], GREEDY, "hostile")
        last = engine.add(INNOCENT, params, "last")  # behind the hostile one in the batch
        _run(engine)
    finally:
        engine.model.forward = real_forward
        Sequence.append = real_append
    assert hostile.finish_reason == "error"
    for seq in (first, last):
        assert seq.finish_reason == "length" and seq.output == alone, seq.request_id
    # the slots it held are whole again: a later request is what it is alone
    assert engine.generate([INNOCENT], params)[0].output == alone


def test_a_failing_tap_stops_capture_of_that_request_only(target: Target) -> None:
    events: list[TapEvent] = []

    def tap(e: TapEvent) -> None:
        if e.request_id == "hostile" and not e.prefill:
            raise RuntimeError("injected: capture fails")
        events.append(e)

    engine = Engine(target, None, EngineConfig(max_batch=4, max_model_len=128, gamma=0), tap=tap)
    innocent = engine.add(INNOCENT, GREEDY, "innocent")
    hostile = engine.add(INNOCENT, GREEDY, "hostile")
    _run(engine)
    alone = _alone(target, INNOCENT, GREEDY)
    assert innocent.output == hostile.output == alone  # both served in full
    assert not hostile.capture
    mine = [e for e in events if e.request_id == "innocent"]
    assert mine[-1].final and sum(len(e.tokens) - 1 for e in mine) == len(INNOCENT) + len(alone) - 1


def test_hostile_sampling_values_are_refused_at_admission(target: Target) -> None:
    engine = _engine(target)
    for bad in (
        SamplingParams(temperature=1.0, top_k=2**63),
        SamplingParams(temperature=1.0, seed=2**64),
        SamplingParams(temperature=1.0, seed=-(2**63) - 1),
        SamplingParams(temperature=math.nan),
        SamplingParams(stop=("",)),
    ):
        with pytest.raises(ValueError):
            engine.add(INNOCENT, bad)
    with pytest.raises(ValueError, match="token ids"):
        engine.add([1, 2, 256], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add([1, -1], GREEDY)
    assert not engine.has_work
    # a top_k past the vocabulary is top_k off: the same sampling, not an overflow in a batch
    huge = SamplingParams(temperature=1.0, top_k=2**62, seed=5, max_tokens=16, ignore_eos=True)
    off = SamplingParams(temperature=1.0, top_k=0, seed=5, max_tokens=16, ignore_eos=True)
    assert engine.generate([INNOCENT, INNOCENT], [huge, SAMPLED])[0].output == _alone(target, INNOCENT, off)


# -- the HTTP server ---------------------------------------------------------------------------------
@pytest.fixture
def client(target: Target) -> Iterator[TestClient]:
    with TestClient(make_app(ServingNode(target, _engine(target)))) as c:
        yield c


OK_CHAT = {"model": "tide", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("top_k", {"top_k": 2**63}),
        ("top_k", {"top_k": -1}),
        ("seed", {"seed": 2**64}),
        ("seed", {"seed": -(2**63) - 1}),
        ("temperature", {"temperature": 2.5}),
        ("top_p", {"top_p": 0}),
        ("max_tokens", {"max_tokens": 0}),
        ("context", {"max_tokens": 10**30}),
        ("n", {"n": 3}),
        ("stop", {"stop": ["x" * 257]}),
        ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
        ("messages", {"messages": [{"role": "user", "content": "hi"}] * 1025}),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]}),
        (
            "context",
            {"messages": [{"role": "user", "content": "word " * 1000}]},
        ),  # long text: the room decides
        ("messages", {"messages": [{"role": "user", "content": 5}]}),
        ("messages", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("messages", {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("model", {"model": "m" * 1000}),
    ],
)
def test_out_of_bounds_fields_are_400(client: TestClient, field: str, body: dict[str, Any]) -> None:
    r = client.post("/v1/chat/completions", content=json.dumps({**OK_CHAT, **body}))  # \ud800 escaped
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("prompt", {"prompt": [1, 2, 10**30]}),
        ("prompt", {"prompt": [1, -2]}),
        ("prompt", {"prompt": "\udfff"}),
        ("prompt", {"prompt": [1.5]}),
        ("prompt", {"prompt": []}),
        ("context", {"prompt": [1] * 200}),
    ],
)
def test_out_of_bounds_prompts_are_400(client: TestClient, field: str, body: dict[str, Any]) -> None:
    r = client.post("/v1/completions", content=json.dumps({"model": "tide", "max_tokens": 4, **body}))
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError in the parser
        b'{"model": "tide", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",  # more digits than int() takes
        b'{"model": "tide", "prompt": "x", "temperature": NaN}',
        b'{"model": "tide", "prompt": "x", "top_p": Infinity}',
        b"[1, 2]",
        b'"a string"',
        b"null",
        b"",
        b'{"model": "tide", "prompt": "\xff\xfe"}',
        b'{"model": "tide", "messages": "hi"}',
        b'{"model": "tide", "prompt": "x", "stream_options": 5}',
        b'{"model": "tide", "prompt": "x", "stop": 5}',
        b'{"model": ["tide"], "prompt": "x"}',
    ],
)
def test_malformed_bodies_of_any_shape_are_400(client: TestClient, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["message"]


def test_server_serves_on_after_hostile_bodies(client: TestClient) -> None:
    for raw in (b"[" * 100_000, json.dumps({**OK_CHAT, "top_k": 2**63}).encode()):
        assert client.post("/v1/chat/completions", content=raw).status_code == 400
    r = client.post("/v1/chat/completions", json=OK_CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_a_request_failing_in_a_step_gets_500_and_its_batch_neighbour_200(target: Target) -> None:
    """Both requests enter the same step (the engine's thread is held until both wait); the
    hostile one's prompt cannot be decoded, which fails it in its prefill."""
    engine = _engine(target)
    gate = threading.Event()
    real_step = engine.step

    def held_step() -> Any:
        gate.wait(60)
        return real_step()

    engine.step = held_step
    innocent = {"model": "tide", "prompt": INNOCENT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    hostile = {**innocent, "prompt": [1, 2, POISON]}
    with (
        TestClient(make_app(ServingNode(target, engine))) as c,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(c.post, "/v1/completions", json=innocent)
        second = pool.submit(c.post, "/v1/completions", json=hostile)
        deadline = time.monotonic() + 60
        while len(engine.waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.waiting) == 2
        gate.set()
        ok, failed = first.result(60), second.result(60)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == ByteTokenizer().decode(_alone(target, INNOCENT, GREEDY))
        assert c.get("/health").json()["running"] == 0


# -- failing drafts ----------------------------------------------------------------------------------
def _draft(target: Target, version: str, seed: int = 1) -> Eagle3Draft:
    d = tiny_draft(target, seed=seed)
    d.cfg.version = version
    return d


def _broken(target: Target, how: str) -> Eagle3Draft:
    d = _draft(target, "broken", seed=2)
    if how == "raises":

        def fail(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected: the draft's step fails")

        d.step = fail
    else:  # its vocabulary map points outside the target's: the verify pass would fail
        d.d2t.fill_(1000)
    return d


@pytest.mark.parametrize("how", ["raises", "out_of_vocab"])
def test_a_failing_draft_costs_speculation_then_reverts_to_the_previous(target: Target, how: str) -> None:
    reverted: list[tuple[str, str, str]] = []
    engine = _engine(target, _draft(target, "good"), gamma=3)
    engine.drafts.on_revert = lambda *a: reverted.append(a)
    engine.set_draft(_broken(target, how))
    seqs = [engine.add(INNOCENT, p, f"r{i}") for i, p in enumerate((GREEDY, SAMPLED))]
    _run(engine)
    # greedy speculation is exact (a sampled row keeps the distribution, not the sample path)
    assert seqs[0].output == _alone(target, INNOCENT, GREEDY)
    assert all(s.finish_reason == "length" and len(s.output) == 24 for s in seqs)
    assert engine.draft_versions() == {"default": "good"}
    assert engine.drafts.step_failures == engine.cfg.draft_failures and engine.drafts.reverts == 1
    assert list(engine.drafts.degraded) == ["default"] and "broken" in engine.drafts.degraded["default"]
    assert [(w, v) for w, v, _ in reverted] == [("default", "broken")]
    # speculation goes on with the previous draft; a new draft clears the degraded state
    steps = engine.drafts["default"].stats.steps
    engine.generate([INNOCENT], GREEDY)
    assert engine.drafts["default"].stats.steps > steps
    engine.set_draft(_draft(target, "fresh", seed=3))
    engine.generate([INNOCENT], GREEDY)
    assert engine.draft_versions() == {"default": "fresh"} and not engine.drafts.degraded


def test_a_failing_workload_draft_reverts_to_the_default_one(target: Target) -> None:
    engine = _engine(target, _draft(target, "good"), gamma=3)
    engine.set_draft(_broken(target, "raises"), "code")
    mixed = [engine.add(INNOCENT, GREEDY, f"r{i}", workload=w) for i, w in enumerate(("default", "code"))]
    _run(engine)
    assert all(s.output == _alone(target, INNOCENT, GREEDY) for s in mixed)
    assert engine.draft_versions() == {"default": "good"} and list(engine.drafts.degraded) == ["code"]
    assert engine.drafts["default"].failures == 0


def test_health_says_degraded_after_a_revert(target: Target) -> None:
    engine = _engine(target, _broken(target, "raises"), gamma=3)
    with TestClient(make_app(ServingNode(target, engine))) as c:
        assert c.get("/health").json()["status"] == "ok"
        body = {"model": "tide", "prompt": INNOCENT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
        health = c.get("/health")
        assert health.status_code == 200  # still serving, without speculation: keep the node
        assert health.json()["status"] == "degraded" and "broken" in health.json()["degraded"]["default"]
        assert health.json()["drafts"] == {}
        assert _metric(c.get("/metrics").text, "tide_draft_reverts_total") == 1
        assert _metric(c.get("/metrics").text, "tide_draft_step_failures_total") == engine.cfg.draft_failures
        assert _metric(c.get("/metrics").text, "tide_degraded") == 1


def _metric(text: str, name: str) -> float:
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == name)
