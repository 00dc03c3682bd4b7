"""The whole loop on one machine, every part real and in its own process: a serving node whose draft
was trained on code serves French chat → its hidden states flow to Kafka → `tide train` registers
candidates in MLflow (artifacts in S3) → `tide gate` promotes one that beats the code draft on
held-out French records → the node swaps it in without a restart → measured acceptance on French
rises."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.infra.s3.server import S3Server
from tide.models.loader import Target
from tide.prompts import load_prompts, split

from .conftest import WORKLOADS, serve_process, tide_process
from .drafts import Registrar
from .test_registry_serving import drafts, metric, wait_for


def chat(url: str, workload: str, messages: list[dict[str, str]], capture: bool) -> int:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tide", "messages": messages, "max_tokens": 64, "temperature": 0},
        headers={"X-Tide-Workload": workload, "X-Tide-Capture": "on" if capture else "off"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])


def acceptance(url: str, workload: str, prompts: list[list[dict[str, str]]]) -> float:
    """Tokens per sequence step of the draft serving `workload`, over these prompts only."""
    key = workload if workload in drafts(url) else "default"

    def totals() -> tuple[float, float]:
        steps = metric(url, "tide_draft_steps", workload=key)
        return steps, steps * metric(url, "tide_draft_tokens_per_step", workload=key)

    s0, t0 = totals()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda m: chat(url, workload, m, capture=False), prompts))
    s1, t1 = totals()
    assert s1 > s0
    return (t1 - t0) / (s1 - s0)


def improved(registry: str, workload: str, factor: float = 1.15) -> bool:
    """A promoted French draft the gate scored `factor` times the code draft it first had to beat
    (the first promotions come after a few dozen steps, a few percent better: too close to measure)."""
    client = MlflowClient(registry)
    versions = client.search_model_versions(f"name LIKE 'tide-draft-%-{workload}'")
    promoted = sorted(
        (v for v in versions if v.tags.get("gate.decision") == "promoted"), key=lambda v: int(v.version)
    )
    if not promoted:
        return False
    code = float(promoted[0].tags["gate.baseline.score"])
    return max(float(v.tags["gate.score"]) for v in promoted) >= factor * code


def runs_version(url: str, workload: str, version: str) -> bool:
    return metric(url, "tide_registry_version", workload=workload, version=version) == 1


def test_the_loop_raises_acceptance_on_a_mismatched_workload(
    kafka: KafkaBroker,
    s3: S3Server,
    target_native: Target,
    trained_draft_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in s3.env.items():  # this process registers the default draft: it reaches S3 too
        monkeypatch.setenv(k, v)
    workload = f"fr-{uuid.uuid4().hex[:6]}"
    fr = load_prompts(WORKLOADS / "chat_fr.jsonl")
    evaluation = [p.messages for p in split(fr, "test")[:8] if p.messages]
    traffic = [p.messages for p in split(fr, "train") if p.messages]
    env = {**s3.env, "OMP_NUM_THREADS": "1"}  # trainer and gate: one core between them
    # its own registry: a default champion here must not leak into other tests' baselines
    with MlflowServer(tmp_path / "mlflow", s3=s3, bucket="tide-e2e") as mlflow:
        # the operator registered the code draft as the default champion: the baseline to beat
        default = Registrar(mlflow.url, target_native.fingerprint, "default")
        default.champion(default.register(trained_draft_dir))
        node = ["--draft", str(trained_draft_dir), "--kafka", kafka.bootstrap, "--registry", mlflow.url,
                "--registry-poll", "2", "--workloads", workload, "--max-batch", "4", "--max-model-len", "768",
                "--gamma", "3", "--chunk-positions", "48"]  # fmt: skip
        with serve_process(node, tmp_path / "serve.log", env={**s3.env}) as url:
            before = acceptance(url, workload, evaluation)  # French on the code draft
            trainer = ["train", "--kafka", kafka.bootstrap, "--workload", workload, "--mlflow", mlflow.url,
                       "--state-dir", str(tmp_path / "trainer"), "--eval-every", "25", "--checkpoint-every", "25",
                       "--vocab-warmup", "1024"]  # fmt: skip
            gate = ["gate", "--mlflow", mlflow.url, "--kafka", kafka.bootstrap, "--poll-seconds", "3",
                    "--min-positions", "128"]  # fmt: skip
            with (
                tide_process(trainer, tmp_path / "trainer.log", env) as trainer_proc,
                tide_process(gate, tmp_path / "gate.log", env) as gate_proc,
            ):
                deadline = time.monotonic() + 900
                sent = 0
                with ThreadPoolExecutor(4) as pool:
                    # training goes on until a French draft clearly better than the code draft serves
                    while workload not in drafts(url) or not improved(mlflow.url, workload):
                        for proc, log in ((trainer_proc, "trainer.log"), (gate_proc, "gate.log")):
                            assert proc.poll() is None, (tmp_path / log).read_text()[-3000:]
                        assert time.monotonic() < deadline, (
                            f"no French draft 15% better than the code draft after {sent} requests:\n"
                            + (tmp_path / "trainer.log").read_text()[-2000:]
                            + (tmp_path / "gate.log").read_text()[-2000:]
                        )
                        batch = [traffic[(sent + i) % len(traffic)] for i in range(4)]
                        list(pool.map(lambda m: chat(url, workload, m, capture=True), batch))
                        sent += len(batch)
                        # paced: between batches the node leaves the trainer and the gate both cores
                        time.sleep(10)
            # trainer and gate stopped: measure on the last champion, once the node runs it
            name = Registrar(mlflow.url, target_native.fingerprint, workload).name
            champion = default.client.get_model_version_by_alias(name, "champion")
            wait_for("the last champion", partial(runs_version, url, workload, str(champion.version)))
            after = acceptance(url, workload, evaluation)  # French on the promoted French draft
            assert metric(url, "tide_draft_swaps_total") >= 1
            assert metric(url, "tide_capture_records_published_total") > 0
        tags = champion.tags
        print(f"\nacceptance on {workload}: {before:.3f} -> {after:.3f} tokens/step after {sent} requests; "
              f"gate: {tags['gate.reason']}")  # fmt: skip
        # greedy decoding of the same prompts: both figures are deterministic for a given draft
        assert after > before + 0.05, (before, after)
        assert tags["gate.decision"] == "promoted"
        assert tags["gate.baseline"].startswith(
            (default.name, name)
        )  # the code draft or an earlier French one
        assert float(tags["gate.score"]) > float(tags["gate.baseline.score"])
        assert tags["gate.reason"].startswith("speedup")  # scored at the node's measured step times
        first = min(
            (
                v
                for v in default.client.search_model_versions(f"name = '{name}'")
                if v.tags.get("gate.decision") == "promoted"
            ),
            key=lambda v: int(v.version),
        )
        assert first.tags["gate.baseline"].startswith(
            default.name
        )  # the first one had to beat the code draft
