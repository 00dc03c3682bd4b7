"""The HTTP API under speculation: cuts inside accepted bursts are exact; capture follows header and policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tide.models.loader import Target
from tide.producers.tap import TapEvent
from tide.serving.api import ServerConfig, make_app
from tide.serving.capture import CapturePolicy, CaptureRule
from tide.serving.engine import Engine, EngineConfig
from tide.serving.node import ServingNode
from tide.serving.sampling import SamplingParams

PROMPT = "def is_prime(n):"
N = 48


def _spec_engine(target: Target, draft: Path) -> Engine:
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=256, gamma=4))
    engine.load_draft(draft)
    return engine


def _stream_text(client: TestClient, body: dict[str, Any]) -> str:
    text = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_stop_and_max_tokens_inside_accepted_bursts_cut_exactly(target_fp32, trained_draft_dir) -> None:
    """fp32 greedy speculation reproduces the plain decode token for token, so the reference for
    every cut is the plain decode's prefix; the cuts are chosen strictly inside multi-token bursts."""
    tok = target_fp32.tok
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    plain = Engine(target_fp32, None, EngineConfig(max_batch=1, max_model_len=256, gamma=0))
    ref = plain.generate([prompt], params)[0].output
    spec = _spec_engine(target_fp32, trained_draft_dir)
    seq = spec.add(prompt, params)
    ends, emitted = set(), 0
    while spec.has_work:
        for out in spec.step():
            emitted += len(out.new_tokens)
            ends.add(emitted)
    assert seq.output == ref
    inside = [k for k in range(2, N) if k not in ends]  # a cut after k tokens splits a burst
    assert len(inside) >= 3, f"too few accepted drafts to test with: bursts end at {sorted(ends)}"

    body = {"model": "tide", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    with TestClient(
        make_app(ServingNode(target_fp32, _spec_engine(target_fp32, trained_draft_dir)))
    ) as client:
        for k in inside[:4]:
            r = client.post("/v1/completions", json={**body, "max_tokens": k}).json()
            assert r["usage"]["completion_tokens"] == k and r["choices"][0]["finish_reason"] == "length"
            assert r["choices"][0]["text"] == tok.decode(ref[:k])
        stops = 0
        for j in inside:
            # a stop string made of the last characters of token j: completed by token j and no earlier
            text_j, before = tok.decode(ref[:j]), tok.decode(ref[: j - 1])
            stop = text_j[-3:]
            if (
                len(stop.strip()) < 2
                or "\ufffd" in stop
                or stop in before
                or text_j.find(stop) != len(text_j) - 3
            ):
                continue
            req = {**body, "max_tokens": N, "stop": [stop, "@@never@@"]}
            r = client.post("/v1/completions", json=req).json()
            assert r["choices"][0]["finish_reason"] == "stop"
            assert r["choices"][0]["text"] == text_j[:-3]
            assert r["usage"]["completion_tokens"] == j
            assert (
                _stream_text(client, req) == text_j[:-3]
            )  # nothing of the stop string leaks into the stream
            stops += 1
        assert stops >= 2


def test_capture_follows_the_header_and_the_workload_policy(target_native) -> None:
    events: list[TapEvent] = []
    engine = Engine(
        target_native, None, EngineConfig(max_batch=2, max_model_len=256, gamma=0), tap=events.append
    )
    policy = CapturePolicy()
    policy.set("quiet", CaptureRule(enabled=False))
    body = {"model": "tide", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    with TestClient(make_app(ServingNode(target_native, engine), ServerConfig(capture=policy))) as client:
        ids = {}
        for name, headers in {
            "captured": {"X-Tide-Workload": "news"},
            "opted_out": {"X-Tide-Workload": "news", "X-Tide-Capture": "off"},
            "policy_off": {"X-Tide-Workload": "quiet"},
        }.items():
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            ids[name] = r.json()["id"].removeprefix("cmpl-")
    seen = {e.request_id for e in events}
    assert seen == {ids["captured"]}
    assert {e.workload for e in events} == {"news"}
    captured = sorted((e for e in events), key=lambda e: e.first_position)
    assert sum(len(e.tokens) for e in captured) >= len(target_native.tok.encode(body["prompt"]))
