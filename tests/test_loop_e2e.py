"""The whole loop as users start it, `tide up`, every part real and in its own process: a serving node
whose draft was trained on code serves French chat → its hidden states flow to Kafka → the stack's
trainer registers candidates in MLflow (artifacts in S3) → its gate promotes one that beats the code
draft on held-out French records → the node swaps it in without a restart → measured acceptance on
French rises. Then `tide status` reports on each part, the MLflow UI shows the French draft model in
headless Chromium (its versions, the `champion` alias, the gate's tags; screenshots kept in
out/test-artifacts), and Ctrl-C stops every process the stack started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from tide.infra.process import free_port
from tide.prompts import load_prompts, split

from .conftest import ROOT, WORKLOADS, tide_process
from .test_registry_serving import drafts, metric

ARTIFACTS = ROOT / "out" / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"


def chat(url: str, workload: str, messages: list[dict[str, str]]) -> int:
    """One request with capture off (an evaluation, not traffic to learn from)."""
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tide", "messages": messages, "max_tokens": 64, "temperature": 0},
        headers={"X-Tide-Workload": workload, "X-Tide-Capture": "off"},
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
        list(pool.map(lambda m: chat(url, workload, m), prompts))
    s1, t1 = totals()
    assert s1 > s0
    return (t1 - t0) / (s1 - s0)


def send_traffic(
    url: str, workload: str, prompts: list[list[dict[str, str]]], stop: threading.Event, sent: list[int]
) -> None:
    """Requests with capture on, four at a time and 10 s apart (between batches the node leaves the
    trainer and the gate both cores), until `stop`: requests in flight then hang up, so the node is
    free at once (a batch takes up to two minutes here while the trainer and the gate run)."""
    with ThreadPoolExecutor(4) as pool:
        while not stop.is_set():
            batch = [prompts[(sent[0] + i) % len(prompts)] for i in range(4)]
            list(pool.map(lambda m: stream_chat(url, workload, m, stop), batch))
            sent[0] += len(batch)
            stop.wait(10)


def stream_chat(url: str, workload: str, messages: list[dict[str, str]], stop: threading.Event) -> None:
    body = {"model": "tide", "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True}
    headers = {"X-Tide-Workload": workload, "X-Tide-Capture": "on"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if stop.is_set() or line == "data: [DONE]":
                return


def promoted(client: MlflowClient, workload: str) -> list[ModelVersion]:
    versions = client.search_model_versions(f"name LIKE 'tide-draft-%-{workload}'")
    return sorted(
        (v for v in versions if v.tags.get("gate.decision") == "promoted"), key=lambda v: int(v.version)
    )


def improved_serves(url: str, client: MlflowClient, workload: str, gamma: int = 3, gain: float = 0.1) -> bool:
    """The node serves (swapped in, not just promoted) a French draft whose held-out tau at the serving
    gamma the gate measured `gain` tokens/step above the code draft's, which the first promotion had to
    beat: the unit the test asserts in, with twice its margin. (The gate's score is the best predicted
    speedup over gamma; one CI run stopped at a draft scored 1.12x, mostly from gamma 1, that measured
    only +0.04 tokens/step at gamma 3.)"""
    served = drafts(url).get(workload)
    ups = promoted(client, workload)
    if served is None or not ups:
        return False
    key = f"tau_gamma{gamma}"
    code = float(ups[0].tags[f"gate.baseline.{key}"])
    return any(v.tags["draft_version"] == served and float(v.tags[f"gate.{key}"]) >= code + gain for v in ups)


def wait_up(proc: subprocess.Popen[bytes], log: Path) -> float:
    """Seconds until `tide up` printed its endpoints."""
    start = time.monotonic()
    while proc.poll() is None and "MLflow UI:" not in log.read_text():
        assert time.monotonic() < start + 600, "the stack not up in 600 s:\n" + log.read_text()[-3000:]
        time.sleep(1)
    assert proc.poll() is None, log.read_text()[-3000:]
    return time.monotonic() - start


def learn(
    proc: subprocess.Popen[bytes], data: Path, url: str, workload: str, client: MlflowClient
) -> tuple[float, float, int]:
    """French acceptance on the code draft; French traffic (capture on) until a clearly better French
    draft serves; French acceptance on it, with the gate paused. Returns (before, after, requests)."""
    fr = load_prompts(WORKLOADS / "chat_fr.jsonl")
    evaluation = [p.messages for p in split(fr, "test")[:8] if p.messages]
    traffic = [p.messages for p in split(fr, "train") if p.messages]
    logs, log = data / "logs", data / "logs" / f"trainer-{workload}.log"
    before = acceptance(url, workload, evaluation)  # French on the code draft
    deadline, sent, stop = time.monotonic() + 900, [0], threading.Event()
    with ThreadPoolExecutor(1) as background:
        sending = background.submit(send_traffic, url, workload, traffic, stop, sent)
        try:
            # training goes on until a French draft clearly better than the code draft serves
            while not improved_serves(url, client, workload):
                assert proc.poll() is None, "the stack ended"
                if sending.done():
                    sending.result()  # its error
                assert time.monotonic() < deadline, (
                    f"no French draft 0.1 tokens/step better than the code draft after {sent[0]} requests:\n"
                    + log.read_text()[-2000:]
                    + (logs / "gate.log").read_text()[-2000:]
                )
                time.sleep(2)
        finally:
            stop.set()
        sending.result()
    gate = json.loads((data / "stack.json").read_text())["processes"]["gate"]["pid"]
    os.kill(gate, signal.SIGSTOP)  # no promotion while `after` is measured: one draft serves all of it
    try:
        time.sleep(3)  # one promoted just before is swapped in first (the node polls every 2 s)
        served = drafts(url)[workload]
        after = acceptance(url, workload, evaluation)  # French on a promoted French draft
        assert drafts(url)[workload] == served
    finally:
        os.kill(gate, signal.SIGCONT)
    return before, after, sent[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tide_up_learns_a_mismatched_workload_and_stops(trained_draft_dir: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    workload = f"fr-{uuid.uuid4().hex[:6]}"
    data, log = tmp_path / "stack", tmp_path / "up.log"
    port, ui_port = free_port(), free_port()
    # γ fixed, so acceptance is measured on every step; the trainer evaluates (and may publish) every
    # 25 steps, the gate looks every 3 s: minutes, not tens of minutes, on 2 cores. No speedup floor:
    # whether a draft trained for a few minutes on two shared cores predicts ≥ 1.0× depends on the
    # machine's step times (on one CI machine 0.99× after 300 steps, and nothing was promoted); what
    # this test checks is that a French draft better than the code draft is promoted and served. The
    # floor has its own test (test_registry_gate).
    args = ["up", "--data", str(data), "--port", str(port), "--mlflow-port", str(ui_port), "--s3",
            "--workloads", workload, "--draft", str(trained_draft_dir),
            # dense and eager as the draft was trained: the loop is under test here, the default weights
            # in test_stack_first_run
            "--serve-args", "--gamma 3 --max-batch 4 --max-model-len 768 --chunk-positions 48 --registry-poll 2 "
                            "--weights bf16 --no-compile",
            "--train-args", "--eval-every 25 --checkpoint-every 25 --vocab-warmup 1024",
            "--gate-args", "--poll-seconds 3 --min-positions 128 --min-speedup 0"]  # fmt: skip
    # every part one thread: the node, the trainer and the gate share two cores
    with tide_process(args, log, {"OMP_NUM_THREADS": "1"}) as proc:
        url, ui = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"
        start = time.monotonic()
        up = wait_up(proc, log)
        text = log.read_text()
        assert f"HTTP endpoint: {url}/v1" in text and f"MLflow UI:     {ui}" in text
        client = MlflowClient(ui)
        # the starting (code) draft is the `default` workload's champion: the baseline to beat
        [default] = client.search_registered_models("name LIKE 'tide-draft-%-default'")
        assert client.get_model_version_by_alias(default.name, "champion")
        before, after, sent = learn(proc, data, url, workload, client)
        learnt = time.monotonic() - start
        assert metric(url, "tide_draft_swaps_total") >= 1
        assert metric(url, "tide_capture_records_published_total") > 0
        ups = promoted(client, workload)
        last = ups[-1].tags
        print(f"\nacceptance on {workload}: {before:.3f} -> {after:.3f} tokens/step after {sent} requests; "
              f"gate: {last['gate.reason']}; stack up at {up:.0f} s, draft learnt at {learnt:.0f} s")  # fmt: skip
        # greedy decoding of the same prompts: both figures are deterministic for a given draft
        assert after > before + 0.05, (before, after)
        assert ups[0].tags["gate.baseline"].startswith(default.name)  # the first had to beat the code draft
        for v in ups:
            assert v.tags["gate.baseline"].startswith(
                (default.name, v.name)
            )  # code, or an earlier French one
            assert float(v.tags["gate.score"]) > float(v.tags["gate.baseline.score"])
            assert v.tags["gate.reason"].startswith("speedup")  # scored at the node's measured step times

        status = subprocess.run([str(Path(sys.executable).parent / "tide"), "status", "--data", str(data)],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"trainer:{workload}" in status.stdout and "consumer lag" in status.stdout
        [line] = [ln for ln in status.stdout.splitlines() if f"champion:{workload}" in ln]
        assert any(f" v{v.version} " in line for v in promoted(client, workload)), (
            line
        )  # the gate may have moved on
        champion = client.get_model_version_by_alias(ups[-1].name, "champion")

        # the MLflow UI in a real browser: the French model, its versions, the alias, the gate's tags
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                         "--disable-background-networking", "--disable-component-update",
                                         "--disable-sync", "--no-first-run"])  # fmt: skip
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{ui}/#/models/{champion.name}")
            page.get_by_text(champion.name).first.wait_for(timeout=60_000)
            page.get_by_text(f"Version {champion.version}").first.wait_for(timeout=60_000)
            page.get_by_text("champion").first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "mlflow_model.png"), full_page=True)
            page.goto(f"{ui}/#/models/{champion.name}/versions/{champion.version}")
            for tag in ("gate.decision", "gate.reason", "gate.score", "gate.tau_gamma1", "gate.baseline"):
                page.get_by_text(tag, exact=True).first.wait_for(timeout=60_000)
            page.get_by_text("promoted", exact=True).first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "mlflow_version.png"), full_page=True)
            browser.close()

        pids = [p["pid"] for p in json.loads((data / "stack.json").read_text())["processes"].values()]
        assert all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        # each part (three `tide` processes, MLflow, S3, Kafka) gets 30 s to stop cleanly before SIGKILL
        proc.wait(300)
        assert not any(_alive(p) for p in pids), "a part outlived the stack"
        with pytest.raises(httpx.TransportError):  # the registry and the endpoint went with it
            httpx.get(f"{ui}/health", timeout=2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


def test_tide_up_with_vllm_serving_learns_a_mismatched_workload(
    trained_draft_dir: Path, tmp_path: Path
) -> None:
    """The same loop with vLLM serving (`tide up --engine vllm`): its tap feeds the trainer, the gate
    promotes a French draft, the vLLM node swaps it in without a restart and acceptance on French
    rises. (The stack's own parts, status, UI and Ctrl-C are the test above's: the engine changes none.)"""
    workload = f"fr-{uuid.uuid4().hex[:6]}"
    data, log = tmp_path / "stack", tmp_path / "up.log"
    port, ui_port = free_port(), free_port()
    args = ["up", "--engine", "vllm", "--data", str(data), "--port", str(port), "--mlflow-port", str(ui_port),
            "--workloads", workload, "--draft", str(trained_draft_dir),
            "--serve-args", "--max-batch 4 --max-model-len 768 --chunk-positions 48 --registry-poll 2",
            "--train-args", "--eval-every 25 --checkpoint-every 25 --vocab-warmup 1024",
            "--gate-args", "--poll-seconds 3 --min-positions 128 --min-speedup 0"]  # fmt: skip
    with tide_process(args, log, {"OMP_NUM_THREADS": "1"}) as proc:
        url, client = f"http://127.0.0.1:{port}", MlflowClient(f"http://127.0.0.1:{ui_port}")
        start = time.monotonic()
        wait_up(proc, log)
        assert httpx.get(f"{url}/health", timeout=10).json()["engine"] == "vllm"
        before, after, sent = learn(proc, data, url, workload, client)
        learnt = time.monotonic() - start
        assert metric(url, "tide_draft_swaps_total") >= 1
        assert metric(url, "tide_capture_records_published_total") > 0
        ups = promoted(client, workload)
        print(f"\nvLLM serving: acceptance on {workload}: {before:.3f} -> {after:.3f} tokens/step after "
              f"{sent} requests; gate: {ups[-1].tags['gate.reason']}; draft learnt at {learnt:.0f} s")  # fmt: skip
        assert after > before + 0.05, (before, after)
        # a promoted French draft serves: trained on records only the vLLM node captured (it is the only node)
        assert any(v.tags["draft_version"] == drafts(url)[workload] for v in ups)
