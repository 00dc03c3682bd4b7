"""`tide bench shift --engine vllm`: the same workload shift with vLLM serving all three systems.

Three vLLM OpenAI servers (`tide serve --engine vllm`) share the serving cores: one without
speculation, one with the static draft at a fixed gamma, and a TIDE node: the same draft and gamma,
its tap publishing every request's hidden states to the broker and its follower swapping in the
`default` champion. `tide train` and `tide gate` run on the training core as in TIDE's own run. The
systems take turns over HTTP, each sending the same request sequence from its own cursor for a
slot; tokens come from each response's usage and acceptance from vLLM's speculation counters on
`/metrics`, read between slots.

What differs from TIDE's run, because vLLM does not do it: the vLLM node has no controller (it drafts
gamma tokens every step and captures every request), it publishes no step profile (the gate judges
its candidates on tokens per step, `--min-tau`), and vLLM gives each request a random internal id,
so a prompt that comes again may land on the other side of the held-out split.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tide.bench.shift import (
    WORKLOAD,
    Setting,
    ShiftBenchConfig,
    Slot,
    Track,
    shift_report,
    spawn_tide,
    start_learning,
)
from tide.infra.process import free_port, log_tail, stop_groups, wait_http_ok
from tide.registry.store import CHAMPION
from tide.registry.tags import VersionTags

START_TIMEOUT_S = 900.0  # three vLLM servers start one after another on the serving core
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    "tide_draft_rollbacks_total": "rollbacks",
    "tide_capture_records_published_total": "records",
}


@dataclass(kw_only=True)
class VllmSystem(Track):
    url: str
    http: httpx.Client
    last: dict[str, float] = field(default_factory=dict)  # the counters as the last slot ended

    def draft(self) -> str:
        """The version of the draft the server drafts with (TIDE's `/health`)."""
        return str(self.http.get(f"{self.url}/health").json()["draft"])

    def counters(self) -> dict[str, float]:
        totals = dict.fromkeys(COUNTERS.values(), 0.0)
        text = self.http.get(f"{self.url}/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in COUNTERS:
                    totals[COUNTERS[s.name]] += s.value
        return totals

    def serve(self, phase: int, workload: str, prompts: list[list[int]], t0: float, seconds: float,
              max_tokens: int) -> None:  # fmt: skip
        """Requests one after another (batch 1) until `seconds` have passed; the last one finishes."""
        before = self.counters()
        start = time.perf_counter()
        tokens = 0
        while time.perf_counter() - start < seconds:
            _, prompt = self.next_request(phase, workload, prompts)
            body = {"model": "tide", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            r = self.http.post(f"{self.url}/v1/completions", json=body, headers={"X-Tide-Workload": WORKLOAD})
            r.raise_for_status()
            tokens += int(r.json()["usage"]["completion_tokens"])
        elapsed = time.perf_counter() - start
        self.last = self.counters()
        d = {k: v - before[k] for k, v in self.last.items()}
        drafts = int(d["drafts"])  # vLLM drafts at every decode step of a speculating server
        self.slots.append(Slot(start - t0, elapsed, tokens, drafts, drafts + int(d["accepted"]), drafts,
                               int(d["draft_tokens"])))  # fmt: skip


def run_vllm(setting: Setting) -> dict[str, Any]:
    from mlflow import MlflowClient

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    cfg, work, kafka, mlflow = setting.cfg, setting.work, setting.kafka, setting.mlflow
    client = MlflowClient(mlflow.url)
    start = setting.register_static(client)
    dtype = str(cfg.dtype).removeprefix("torch.")
    draft = ["--draft", str(cfg.static_draft), "--gamma", str(cfg.static_gamma)]
    servers = {
        "nospec": ["--gamma", "0"],
        "static": draft,
        "tide": [*draft, "--kafka", kafka.bootstrap, "--chunk-positions", "64", "--registry", mlflow.url,
                 "--registry-poll", "5", "--node", "bench", "--workloads", WORKLOAD],
    }  # fmt: skip

    with contextlib.ExitStack() as stack, httpx.Client(timeout=300) as http:
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(stop_groups, procs, 60)  # every process spawned below
        systems: list[VllmSystem] = []
        for name, args in servers.items():
            port = free_port()
            procs.append(spawn_tide(["serve", "--engine", "vllm", "--port", str(port), "--dtype", dtype, "--max-batch",
                                     str(cfg.max_batch), "--max-model-len", str(setting.max_model_len), *args],
                                    work / f"{name}.log", setting.serving_cores))  # fmt: skip
            systems.append(VllmSystem(name, url=f"http://127.0.0.1:{port}", http=http))
            wait_http_ok(f"{systems[-1].url}/health", procs[-1], START_TIMEOUT_S, f"the {name} vLLM server",
                         functools.partial(log_tail, work / f"{name}.log"))  # fmt: skip
        procs += start_learning(setting, ("--gamma", str(cfg.static_gamma)))
        events = _serve(
            cfg, systems, setting.phases, lambda: client.get_model_version_by_alias(start.name, CHAMPION)
        )
        records = int(systems[2].counters()["records"])
    return shift_report(cfg, systems, events, {}, records, [len(ph) for ph in setting.phases], [])


def _serve(
    cfg: ShiftBenchConfig,
    systems: list[VllmSystem],
    phases: list[list[list[int]]],
    champion: Callable[[], Any],
) -> list[dict[str, Any]]:
    """The systems in turn until the schedule ends; the TIDE node's swaps as events."""
    tide = systems[2]
    events: list[dict[str, Any]] = []
    serving, rollbacks = tide.draft(), tide.counters()["rollbacks"]
    t0 = time.perf_counter()
    total = cfg.phase_seconds * len(phases)
    with tqdm(total=int(total), desc="bench shift (vLLM)", unit="s") as bar:
        while (now := time.perf_counter() - t0) < total:
            phase = int(now // cfg.phase_seconds)
            for s in systems:
                s.serve(
                    phase, str(cfg.schedule[phase]), phases[phase], t0, cfg.slot_seconds, cfg.max_new_tokens
                )
            draft, rolled = tide.draft(), tide.last["rollbacks"]
            if draft != serving:
                if rolled > rollbacks:
                    kind = "rollback"
                elif VersionTags.from_tags(champion().tags or {}).recall is not None:
                    kind = "recall"  # the gate brought an earlier champion back
                else:
                    kind = "promotion"
                events.append({"t": time.perf_counter() - t0, kind: draft, "phase": phase})
            serving, rollbacks = draft, rolled
            bar.update(int(time.perf_counter() - t0) - bar.n)
    return events
