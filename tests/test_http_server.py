"""`tide serve` as users run it: a real server process, driven with the official `openai` client."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from .conftest import serve_process

ADMIN = "s3cret-admin-token"
CHINESE = "我喜欢吃中国菜，因为"


@dataclass
class Server:
    url: str
    log: Path
    draft: Path

    def client(self, **headers: str) -> Any:  # untyped: the tests pass plain dicts to the client
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120, default_headers=headers
        )

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


@pytest.fixture(scope="module")
def server(trained_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--draft", str(trained_draft_dir), "--gamma", "3", "--max-batch", "2", "--max-queue", "2",
            "--max-model-len", "512", "--verbose"]  # fmt: skip
    with serve_process(args, log, {"TIDE_ADMIN_TOKEN": ADMIN}) as url:
        yield Server(url, log, trained_draft_dir)


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_chat_and_completions_streaming_and_not(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tide"]
    messages = _chat("Write a Python function that reverses a string.")
    full = client.chat.completions.create(model="tide", messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content or ""
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and 1 <= full.usage.completion_tokens <= 40
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model="tide",
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == text
    assert reasons[-1] == full.choices[0].finish_reason and usage == full.usage

    comp = client.completions.create(model="tide", prompt="def add(a, b):", max_tokens=16, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tide", prompt="def add(a, b):", max_tokens=16, temperature=0, stream=True
        )
        if c.choices
    )
    assert comp.choices[0].text and streamed == comp.choices[0].text


def test_concurrent_requests(server: Server) -> None:
    client = server.client(**{"X-Tide-Workload": "concurrent"})
    prompts = ["Name three colours.", "What is 2 + 2?", "Say hi in German.", "Count to five."]

    def ask(p: str) -> int:
        r = client.chat.completions.create(model="tide", messages=_chat(p), max_tokens=24, temperature=0)
        assert r.choices[0].message.content
        assert r.usage is not None
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # two slots, two queued: all fit
        tokens = list(pool.map(ask, prompts))
    assert server.metric("tide_generated_tokens_total", workload="concurrent") == sum(tokens)
    assert server.metric("tide_batch_size_bucket", le="2.0") > server.metric(
        "tide_batch_size_bucket", le="1.0"
    )


def test_multibyte_stream_never_breaks_characters(server: Server) -> None:
    """Sampled Chinese continuations: characters span tokens, and bursts of accepted drafts."""
    client = server.client()
    split_seen = False
    for seed in range(2):
        kw = dict(model="tide", prompt=CHINESE, max_tokens=40, temperature=0.9, seed=seed)
        whole = client.completions.create(**kw).choices[0].text
        chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
        assert "".join(chunks) == whole
        # U+FFFD only where the non-streamed text has one too: a truncated character at the very end,
        # or bytes the model sampled that form no character (the whole text has those too)
        assert sum(c.count("\ufffd") for c in chunks) == whole.count("\ufffd")
        split_seen |= any(len(ch.encode()) >= 3 for ch in whole)
    assert split_seen, "no multi-byte characters generated: the test proves nothing"


def test_seed_makes_sampling_reproducible(server: Server) -> None:
    client = server.client()
    kw = dict(
        model="tide", messages=_chat("Tell me a short story."), max_tokens=32, temperature=1.0, top_p=0.95
    )
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2)}
    assert a == b
    assert len(others | {a}) > 1  # the seed does steer the sampling


def test_bad_input_gets_a_reason_and_the_server_keeps_serving(server: Server) -> None:
    client = server.client()
    ok = dict(model="tide", messages=_chat("Hi"), max_tokens=4)
    bad: list[tuple[dict[str, object], type[openai.APIStatusError], str]] = [
        ({**ok, "model": "gpt-9"}, openai.NotFoundError, "does not exist"),
        ({**ok, "max_tokens": -1}, openai.BadRequestError, "max_tokens"),
        ({**ok, "temperature": 3}, openai.BadRequestError, "temperature"),
        ({**ok, "top_p": 0}, openai.BadRequestError, "top_p"),
        ({**ok, "n": 2}, openai.BadRequestError, "n=1"),
        ({**ok, "messages": []}, openai.BadRequestError, "messages"),
        ({**ok, "stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop"),
        ({**ok, "messages": _chat("word " * 1000)}, openai.BadRequestError, "context"),
        ({**ok, "max_tokens": 100_000}, openai.BadRequestError, "context"),
        # issue 30: was a 500 for the whole batch
        ({**ok, "extra_body": {"top_k": 2**63}}, openai.BadRequestError, "top_k"),
        ({**ok, "seed": 2**64}, openai.BadRequestError, "seed"),
        ({**ok, "stop": ["x" * 300]}, openai.BadRequestError, "stop"),
    ]
    for body, error, reason in bad:
        with pytest.raises(error) as info:
            client.chat.completions.create(**body)
        assert reason in info.value.message, (body, info.value.message)
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json")
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]
    huge = httpx.post(f"{server.url}/v1/completions", json={"model": "tide", "prompt": "x" * (2 << 20)})
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    wrong = httpx.post(
        f"{server.url}/v1/chat/completions", json=ok, headers={"X-Tide-Workload": "No Spaces!"}
    )
    assert wrong.status_code == 400 and "workload" in wrong.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/completions", json={"model": "tide"}).status_code == 400
    nested = httpx.post(f"{server.url}/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert nested.status_code == 400 and "JSON" in nested.json()["error"]["message"]
    # a lone surrogate reaches no tokenizer
    surrogate = json.dumps({**ok, "messages": _chat("\ud800")})
    assert httpx.post(f"{server.url}/v1/chat/completions", content=surrogate).status_code == 400
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert client.chat.completions.create(**ok).choices[0].message.content is not None


def test_client_disconnect_frees_its_slot(server: Server) -> None:
    body = {
        "model": "tide",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    before = server.metric("tide_client_disconnects_total")
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers={"X-Tide-Workload": "leaver"}
        ) as r,
    ):
        lines = r.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))  # generation has started
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/health").json()["running"] == 0
    assert server.metric("tide_client_disconnects_total") == before + 1
    # the slot was given up long before the 400 tokens the request asked for
    assert server.metric("tide_generated_tokens_total", workload="leaver") < 200


def test_burst_beyond_the_queue_gets_429_never_a_hang(server: Server) -> None:
    body = {"model": "tide", "prompt": "List the planets:", "max_tokens": 48, "ignore_eos": True}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:  # 2 slots + 2 queued < 10
        responses = list(pool.map(post, range(10)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.headers["retry-after"]
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses if r.status_code == 200)
    assert server.metric("tide_rejected_requests_total", reason="queue_full") >= codes.count(429)


def test_metrics_report_serving_figures(server: Server) -> None:
    server.client().completions.create(model="tide", prompt="def fib(n):", max_tokens=32, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("tide_generated_tokens", "tide_tokens_per_step", "tide_draft_info", "tide_batch_size",
                 "tide_queue_depth", "tide_request_latency_seconds", "tide_time_to_first_token_seconds",
                 "tide_accept_rate", "tide_gamma"):  # fmt: skip
        assert name in families, name
    version = json.loads((server.draft / "config.json").read_text())["version"]
    assert server.metric("tide_draft_info", version=version) == 1
    assert server.metric("tide_tokens_per_step_count") > 0
    # speculation pays on code: steps emit more than one token on average
    mean = server.metric("tide_tokens_per_step_sum") / server.metric("tide_tokens_per_step_count")
    assert mean > 1.0
    assert server.metric("tide_request_latency_seconds_count", endpoint="completions") > 0


def test_admin_endpoints_need_the_token(server: Server, tmp_path: Path) -> None:
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert httpx.get(f"{server.url}/admin/state").status_code == 401
    assert httpx.get(f"{server.url}/admin/state", headers={"Authorization": "Bearer nope"}).status_code == 401
    state = admin.get("/admin/state").json()
    assert state["speculation"]["gamma"] == 3 and state["drafts"]["default"]["version"] != "none"

    assert admin.put("/admin/speculation", json={"gamma": 0}).json() == {"gamma": 0, "adaptive": False}
    assert admin.put("/admin/speculation", json={"adaptive": True}).status_code == 400  # no controller here
    assert httpx.get(f"{server.url}/health").json()["gamma"] == 0
    assert admin.put("/admin/speculation", json={"gamma": 99}).status_code == 400
    assert admin.put("/admin/speculation", json={"gamma": 3}).status_code == 200

    r = admin.put("/admin/capture", json={"workload": "code", "enabled": True, "fraction": 0.25})
    assert (
        r.status_code == 200 and admin.get("/admin/capture").json()["workloads"]["code"]["fraction"] == 0.25
    )
    assert admin.put("/admin/capture", json={"workload": "code", "fraction": 2}).status_code == 400

    # a draft with NaN weights or from nowhere is refused, the current one keeps serving
    version = state["drafts"]["default"]["version"]
    broken = tmp_path / "nan-draft"
    broken.mkdir()
    for f in server.draft.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    name = next(k for k, v in weights.items() if v.is_floating_point() and v.dim() == 2)
    weights[name] = torch.full_like(weights[name], math.nan)
    save_file(weights, broken / "model.safetensors")
    for path in (broken, tmp_path / "missing"):
        r = admin.post("/admin/drafts", json={"path": str(path)})
        assert r.status_code == 400 and "refused" in r.json()["error"]["message"]
    assert admin.get("/admin/drafts").json()["default"]["version"] == version
    r = admin.post("/admin/drafts", json={"path": str(server.draft)})
    assert r.status_code == 200 and r.json()["version"] == version


def test_logs_hold_no_prompt_or_completion(server: Server) -> None:
    marker = "Zanzibar quokka 7319"
    client = server.client(**{"X-Tide-Workload": "private", "X-Tide-Capture": "off"})
    out = client.chat.completions.create(
        model="tide", messages=_chat(f"Repeat after me: {marker}"), max_tokens=24, temperature=0
    )
    text = out.choices[0].message.content or ""
    list(client.completions.create(model="tide", prompt=marker, max_tokens=8, stream=True))
    log = server.log.read_text()
    assert "POST /v1/chat/completions" in log  # the log is being written
    assert "Zanzibar" not in log and "quokka" not in log
    assert len(text) < 12 or text not in log
