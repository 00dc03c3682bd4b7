"""vLLM as a serving node (`tide serve --engine vllm`) and in `tide bench spec --engine vllm`.

Apart from test_vllm.py, whose module-wide vLLM engines would otherwise still hold their memory.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from tide.cli import app
from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.models.loader import Target
from tide.names import topic_for
from tide.producers.assembler import join
from tide.producers.consumer import RecordConsumer
from tide.producers.records import HiddenStateRecord

from .conftest import WORKLOADS, serve_process
from .drafts import Registrar, copy_draft, foreign_draft, nan_draft, noisy_draft
from .test_registry_serving import complete, metric, refused, wait_for

GAMMA = 3


def test_bench_spec_with_vllm(trained_draft_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["bench", "spec", "--prompts", str(WORKLOADS / "code.jsonl"), "--draft", str(trained_draft_dir),
            "--max-new-tokens", "24", "--limit", "2", "--gamma", str(GAMMA), "--no-llama-cpp",
            "--engine", "vllm", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert r["baseline"]["tokens_per_s"] > 0  # today's keys stay
    assert r["vllm"]["tokens_per_s"] > 0 and r["vllm_speculative"]["tokens_per_s"] > 0
    assert r["vllm_speculative"]["mean_accept_length"] > 1.0
    assert len(r["vllm_speculative"]["accept_rate_by_depth"]) == GAMMA
    assert 0 <= r["vllm_greedy_match_rate"] <= 1 and 0 <= r["vllm_vs_tide_greedy_match_rate"] <= 1


def test_vllm_node_serves_and_captures_by_its_headers(
    kafka: KafkaBroker, trained_draft_dir: Path, target_fp32: Target, tmp_path: Path
) -> None:
    """`tide serve --engine vllm`: vLLM's OpenAI server with the draft, publishing records for the
    workload its `X-Tide-Workload` names, none for a request with `X-Tide-Capture: off`."""
    args = ["--engine", "vllm", "--draft", str(trained_draft_dir), "--gamma", "3", "--max-batch", "2",
            "--max-model-len", "1024", "--kafka", kafka.bootstrap]  # fmt: skip
    body = {"model": "tide", "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip
    with serve_process(args, tmp_path / "vllm.log") as url:
        ok = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-Tide-Workload": "vllm-http"}, timeout=120
        )
        assert ok.status_code == 200, ok.text
        text = ok.json()["choices"][0]["message"]["content"]
        bad = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Tide-Workload": "Not A Name!"})
        assert bad.status_code == 400 and "workload name" in bad.json()["error"]["message"]
        huge = {**body, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=huge, timeout=60).status_code == 413
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["engine"] == "vllm" and health["drafts"] == {"default": health["draft"]}
        secret = {"X-Tide-Workload": "vllm-secret", "X-Tide-Capture": "off"}
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=body, headers=secret, timeout=120).status_code
            == 200
        )
        # a body cannot smuggle itself into capture past the headers
        smuggled = {**body, "vllm_xargs": {"tide_workload": "vllm-smuggled"}}
        r = httpx.post(f"{url}/v1/chat/completions", json=smuggled, headers=secret, timeout=120)
        assert r.status_code == 200
        reader = RecordConsumer(
            kafka.bootstrap, ["vllm-http"], f"check-{uuid.uuid4().hex[:6]}", target_fp32.fingerprint
        )
        records: list[HiddenStateRecord] = []
        deadline = time.monotonic() + 60
        while not any(r.last for r in records) and time.monotonic() < deadline:
            records += [c.record for c in reader.poll(64, 1.0)]
        reader.close()
    # `tide serve` was stopped (SIGTERM): vLLM's server went with it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=2)
        except httpx.TransportError:
            break
        time.sleep(1)
    else:
        raise AssertionError("vLLM's server outlived `tide serve`")
    request = join(sorted(records, key=lambda r: r.chunk))
    assert request.last and request.workload == "vllm-http" and request.first_position == 0
    completion = ok.json()["usage"]["completion_tokens"]
    assert target_fp32.tok.decode(request.tokens[-completion:].tolist()) == text
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert topic_for("vllm-secret") not in topics and topic_for("vllm-smuggled") not in topics


def test_vllm_node_follows_the_registry(
    registry: MlflowServer, trained_draft_dir: Path, target_fp32: Target, tmp_path: Path
) -> None:
    """A vLLM node follows its workload's champion as a TIDE node does: broken versions refused and
    counted while the draft it has serves on, a good one swapped in without a restart (greedy output
    unchanged), one that falls short live rolled back to the previous version."""
    workload = f"vf-{uuid.uuid4().hex[:4]}"
    reg = Registrar(registry.url, target_fp32.fingerprint, workload)
    args = ["--engine", "vllm", "--draft", str(trained_draft_dir), "--gamma", "3", "--max-batch", "2",
            "--max-model-len", "1024", "--registry", registry.url, "--registry-poll", "1",
            "--workloads", workload, "--node", "vllm-a", "--rollback-steps", "40"]  # fmt: skip

    def serves(version: str) -> bool:
        return metric(url, "tide_draft_info", workload=workload, version=version) == 1

    with serve_process(args, tmp_path / "vllm.log") as url:
        start = json.loads((trained_draft_dir / "config.json").read_text())["version"]
        assert serves(start)
        text = complete(url, workload)["choices"][0]["text"]
        for mv, reason in (
            (reg.register_wrong_checksum(trained_draft_dir), "checksum"),
            (reg.register(nan_draft(trained_draft_dir, tmp_path / "nan")), "invalid_weights"),
            (reg.register(foreign_draft(trained_draft_dir, tmp_path / "foreign")), "foreign_target"),
        ):
            reg.champion(mv)
            wait_for(f"{reason} refused", lambda r=reason: refused(url, r))  # type: ignore[misc]
            assert serves(start)
            assert complete(url, workload)["choices"][0]["text"] == text  # serving never stopped

        honest = {f"gate.tau_gamma{g}": "1.0" for g in range(1, 5)}
        noisy = reg.register(noisy_draft(trained_draft_dir, tmp_path / "noisy", 0.5), honest)
        reg.champion(noisy)
        wait_for("the champion swapped in", lambda: serves("noisy-0.5"))
        assert metric(url, "tide_registry_version", workload=workload, version=str(noisy.version)) == 1
        assert complete(url, workload)["choices"][0]["text"] == text  # greedy: the same text on any draft
        assert metric(url, "tide_draft_steps", workload=workload) > 0

        # a version whose gate promised more than any draft can deliver at gamma 3 (at most 4 tokens)
        promised = {f"gate.tau_gamma{g}": "6.0" for g in range(1, 5)}
        second = reg.register(copy_draft(trained_draft_dir, tmp_path / "second", "vf-second"), promised)
        reg.client.set_registered_model_alias(reg.name, "previous", noisy.version)
        reg.champion(second)
        wait_for("the second version", lambda: serves("vf-second"))
        deadline = time.monotonic() + 180
        while metric(url, "tide_draft_rollbacks_total") < 1:
            assert time.monotonic() < deadline, "no rollback"
            complete(url, workload, 48)
        wait_for("the previous version back", lambda: serves("noisy-0.5"))
        tags = reg.tags(second)
        assert "fell short" in tags["rollback.reason"] and tags["rollback.node"] == "vllm-a"
        assert float(tags["live.vllm-a.tau_gamma3"]) <= 4.0
        assert reg.alias("champion") == str(noisy.version)
        assert metric(url, "tide_draft_swaps_total") >= 2
        assert metric(url, "vllm:spec_decode_num_drafts_total") > 0  # vLLM's own metrics are still there


def test_a_vllm_node_told_another_target_does_not_start(trained_draft_dir: Path) -> None:
    """Its drafts are checked against the HF folder it serves: a fingerprint that is not that
    folder's would refuse every version, so the node refuses to start instead."""
    import asyncio

    from tide.models.hf_folder import write_hf_folder
    from tide.serving.vllm_adapter.config import FollowConfig, VllmConfig
    from tide.serving.vllm_adapter.drafts import VllmDrafts

    folder, fp = write_hf_folder(None)
    other = "0" * len(fp)
    cfg = VllmConfig(folder, trained_draft_dir, follow=FollowConfig("http://127.0.0.1:1", "n", other, "/tmp"))
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="is not the target"):
            VllmDrafts(cfg, None, loop)
    finally:
        loop.close()
