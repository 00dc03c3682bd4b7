"""`tide up` as users run it: every part starts, requests are served and captured, the stack's gate
decides on a candidate, `tide status` reports on each part, the MLflow UI shows the draft model in headless
Chromium (its versions, the `champion` alias, the gate's tags; screenshots kept in out/test-artifacts),
and Ctrl-C stops every process the stack started.

The candidate is registered by the test, the way a trainer registers one: on two cores the stack's own
trainer needs several minutes for its first, and the loop from capture to promotion is the loop e2e
test's (tests/test_loop_e2e.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from tide.infra.process import free_port
from tide.models.loader import load_head

from .conftest import ROOT, WORKLOADS, tide_process
from .drafts import Registrar, copy_draft

ARTIFACTS = ROOT / "out" / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(what: str, check: object, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(1.0)


def _chat(url: str, i: int) -> None:
    prompts = [json.loads(line) for line in (WORKLOADS / "code.jsonl").read_text().splitlines()]
    body = {"model": "tide", "messages": prompts[i % len(prompts)]["messages"], "max_tokens": 64}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def test_tide_up_serves_gates_and_stops(trained_draft_dir: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    data, log = tmp_path / "stack", tmp_path / "up.log"
    port, ui_port = free_port(), free_port()
    args = ["up", "--data", str(data), "--port", str(port), "--mlflow-port", str(ui_port),
            "--draft", str(trained_draft_dir)]  # fmt: skip
    with tide_process(args, log) as proc:
        url, ui = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"
        _wait("the stack", lambda: proc.poll() is not None or "MLflow UI:" in log.read_text(), 600, log)
        assert proc.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert f"HTTP endpoint: {url}/v1" in text and f"MLflow UI:     {ui}" in text

        # traffic: captured (auto) for the trainer and, a tenth of it, held out for the gate
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: _chat(url, i), range(32)))
        client = MlflowClient(ui)
        [model] = client.search_registered_models("name LIKE 'tide-draft-%-default'")
        # a candidate as a trainer registers one: the starting draft again, under another version name
        registrar = Registrar(ui, load_head().fingerprint, "default")
        assert registrar.name == model.name
        registrar.register(copy_draft(trained_draft_dir, tmp_path / "candidate", "candidate"))

        def evaluated(v: ModelVersion) -> bool:  # a candidate the gate measured, not the start draft
            return (v.tags or {}).get("gate.decision") in ("promoted", "refused") and "gate.score" in v.tags

        def gated() -> bool:
            return any(evaluated(v) for v in client.search_model_versions(f"name = '{model.name}'"))

        # a trickle of traffic until the gate has the held-out positions it needs to decide
        with ThreadPoolExecutor(4) as pool:
            deadline, last = time.monotonic() + 300, time.monotonic()
            while not gated():
                assert time.monotonic() < deadline, (
                    "no gate decision:\n" + (data / "logs" / "gate.log").read_text()[-3000:]
                )
                if time.monotonic() - last > 20:
                    list(pool.map(lambda i: _chat(url, i), range(4)))
                    last = time.monotonic()
                # not 5 s: polling every 5 s once failed on a dropped connection, and uvicorn (MLflow's
                # server) closes connections idle for 5 s; a race is the likely cause
                time.sleep(2)
        versions = client.search_model_versions(f"name = '{model.name}'")
        decided = next(v for v in versions if evaluated(v))
        champion = client.get_model_version_by_alias(model.name, "champion")

        status = subprocess.run([str(Path(sys.executable).parent / "tide"), "status", "--data", str(data)],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        assert "trainer:default" in status.stdout and "consumer lag" in status.stdout
        assert "trainer for default started" in (data / "logs" / "trainer-default.log").read_text()
        assert "champion:default  " in status.stdout and f"v{champion.version}" in status.stdout

        # the MLflow UI in a real browser: the model, its versions, the alias, the gate's tags
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                         "--disable-background-networking", "--disable-component-update",
                                         "--disable-sync", "--no-first-run"])  # fmt: skip
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{ui}/#/models/{model.name}")
            page.get_by_text(model.name).first.wait_for(timeout=60_000)
            page.get_by_text(f"Version {decided.version}").first.wait_for(timeout=60_000)
            page.get_by_text("champion").first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "mlflow_model.png"), full_page=True)
            page.goto(f"{ui}/#/models/{model.name}/versions/{decided.version}")
            for tag in ("gate.decision", "gate.reason", "gate.score", "gate.tau_gamma1", "gate.baseline"):
                page.get_by_text(tag, exact=True).first.wait_for(timeout=60_000)
            page.get_by_text(decided.tags["gate.decision"], exact=True).first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "mlflow_version.png"), full_page=True)
            browser.close()

        pids = [p["pid"] for p in json.loads((data / "stack.json").read_text())["processes"].values()]
        assert all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        # each of the five (three parts, MLflow, Kafka) gets 30 s to stop cleanly before SIGKILL, so 150 s
        # at most by design (a suite started as a background job once ran `tide up` with SIGINT ignored)
        proc.wait(300)
        assert not any(_alive(p) for p in pids), "a part outlived the stack"
        with pytest.raises(httpx.TransportError):  # the registry and the endpoint went with it
            httpx.get(f"{ui}/health", timeout=2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
