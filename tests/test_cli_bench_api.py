"""The `tide` command end to end: bench report keys, and the HTTP API on the default model."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tide.cli import app
from tide.serving.api import make_app
from tide.serving.engine import Engine, EngineConfig

from .conftest import WORKLOADS


def test_bench_spec_report(trained_draft_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["bench", "spec", "--prompts", str(WORKLOADS / "code.jsonl"), "--draft", str(trained_draft_dir),
            "--max-new-tokens", "24", "--batch-size", "2", "--limit", "4", "--gamma", "3", "--no-llama-cpp",
            "--out", str(out), "--plot", str(tmp_path / "spec.png")]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert (tmp_path / "spec.png").stat().st_size > 1000
    for key in (
        "speedup",
        "predicted_speedup",
        "greedy_match_rate",
        "greedy_identical",
        "tap_overhead",
        "dtype",
        "batch_size",
        "gamma",
    ):
        assert key in r, key
    assert r["baseline"]["tokens_per_s"] > 0 and r["speculative"]["tokens_per_s"] > 0
    assert len(r["speculative"]["accept_rate_by_depth"]) == 3
    assert r["speculative"]["mean_accept_length"] >= 1.0
    assert 0 <= r["greedy_match_rate"] <= 1 and r["dtype"] == "bfloat16" and r["batch_size"] == 2
    assert len(r["divergence_top2_logit_gaps"]) == round((1 - r["greedy_match_rate"]) * r["prompts"])
    assert r["predicted_speedup"] > 0 and 0 <= r["tap_overhead"] < 1


def test_http_api_answers_and_refuses_nonsense(target_bf16, trained_draft_dir: Path) -> None:
    engine = Engine(target_bf16, None, EngineConfig(max_batch=4, max_model_len=512, gamma=3))
    engine.load_draft(trained_draft_dir)
    with TestClient(make_app(target_bf16, engine)) as client:
        assert client.get("/health").json()["status"] == "ok"
        body = {
            "model": "tide",
            "messages": [{"role": "user", "content": "Say hello in French."}],
            "max_tokens": 12,
            "temperature": 0,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] <= 12 and data["choices"][0]["message"]["content"]
        streamed = ""
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    streamed += delta.get("content", "")
        assert streamed == data["choices"][0]["message"]["content"]
        r = client.post(
            "/v1/completions",
            json={"model": "tide", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
        assert client.post("/v1/chat/completions", json={**body, "model": "gpt-9"}).status_code == 404
        assert client.post("/v1/chat/completions", json={**body, "n": 2}).status_code == 400
        assert client.post("/v1/chat/completions", json={**body, "max_tokens": -1}).status_code == 400
        assert client.post("/v1/chat/completions", json={**body, "temperature": 7}).status_code == 400
        long = {"model": "tide", "prompt": "word " * 2000, "max_tokens": 8}
        r = client.post("/v1/completions", json=long)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
