"""Serving nodes follow the registry (real MLflow, artifacts in a real S3 server): broken versions
are refused and counted while the old draft keeps serving, two nodes converge on the same champion,
a draft that falls short live is rolled back, and a registry or store that goes away costs nothing
but a counter."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tide.infra.mlflow.server import MlflowServer
from tide.infra.s3.server import S3Server
from tide.models.loader import Target
from tide.stack import as_account

from .conftest import serve_process
from .drafts import Registrar, copy_draft, foreign_draft, nan_draft

FOLLOW, ROLLBACK = f"follow-{uuid.uuid4().hex[:4]}", f"rollback-{uuid.uuid4().hex[:4]}"


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def drafts(url: str) -> dict[str, str]:
    return dict(httpx.get(f"{url}/health", timeout=10).json()["drafts"])


def refused(url: str, reason: str) -> bool:
    return metric(url, "tide_draft_refused_total", reason=reason) >= 1


def serves(url: str, workload: str, version: str) -> bool:
    return drafts(url).get(workload) == version


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def complete(url: str, workload: str, max_tokens: int = 24) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tide", "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0},
        headers={"X-Tide-Workload": workload},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def node_args(draft: Path, registry: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--draft", str(draft), "--registry", registry, "--registry-poll", "1", "--max-batch", "2",
            "--max-model-len", "512", "--gamma", "3", "--rollback-steps", "40", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def nodes(
    registry: MlflowServer, trained_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[str]]:
    """Two serving nodes following the same registry."""
    logs = tmp_path_factory.mktemp("nodes")
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                serve_process(
                    node_args(
                        trained_draft_dir, registry.url, ("--workloads", f"{FOLLOW},{ROLLBACK}", "--node", n)
                    ),
                    logs / f"{n}.log",
                )
            )
            for n in ("node-a", "node-b")
        ]
        yield urls


def test_nodes_refuse_broken_versions_and_converge_on_the_champion(
    nodes: list[str], registry: MlflowServer, target_native: Target, trained_draft_dir: Path, tmp_path: Path
) -> None:
    reg = Registrar(registry.url, target_native.fingerprint, FOLLOW)
    for mv, reason in (
        (reg.register_wrong_checksum(trained_draft_dir), "checksum"),
        (reg.register(nan_draft(trained_draft_dir, tmp_path / "nan")), "invalid_weights"),
        (reg.register(foreign_draft(trained_draft_dir, tmp_path / "foreign")), "foreign_target"),
    ):
        reg.champion(mv)
        for url in nodes:
            wait_for(f"{reason} refused", partial(refused, url, reason))
            assert FOLLOW not in drafts(url)  # the workload still runs on the default draft
            assert complete(url, FOLLOW)["usage"]["completion_tokens"] == 24  # serving never stopped

    good = reg.register(copy_draft(trained_draft_dir, tmp_path / "good", "follow-good"))
    reg.champion(good)
    for url in nodes:
        wait_for("the champion swapped in", partial(serves, url, FOLLOW, "follow-good"))
        assert metric(url, "tide_registry_version", workload=FOLLOW, version=str(good.version)) == 1
        assert metric(url, "tide_draft_swaps_total") >= 1
        complete(url, FOLLOW)
        assert metric(url, "tide_draft_steps", workload=FOLLOW) > 0  # the workload runs on its own draft now
    # both nodes also published their measured step times for the gate
    profile = json.loads(reg.client.get_registered_model(reg.name).tags["serving.profile"])
    assert profile["node"] in ("node-a", "node-b") and profile["target"]["1"] > 0


def test_a_draft_that_falls_short_live_is_rolled_back(
    nodes: list[str], registry: MlflowServer, target_native: Target, trained_draft_dir: Path, tmp_path: Path
) -> None:
    url = nodes[0]
    reg = Registrar(registry.url, target_native.fingerprint, ROLLBACK)
    honest = {f"gate.tau_gamma{g}": "1.0" for g in range(1, 5)}
    first = reg.register(copy_draft(trained_draft_dir, tmp_path / "first", "rb-first"), honest)
    reg.champion(first)
    wait_for("the first version", lambda: drafts(url).get(ROLLBACK) == "rb-first")
    # a version whose gate promised more than any draft can deliver at gamma 3 (at most 4 tokens)
    promised = {f"gate.tau_gamma{g}": "6.0" for g in range(1, 5)}
    second = reg.register(copy_draft(trained_draft_dir, tmp_path / "second", "rb-second"), promised)
    reg.client.set_registered_model_alias(reg.name, "previous", first.version)
    reg.champion(second)
    wait_for("the second version", lambda: drafts(url).get(ROLLBACK) == "rb-second")
    deadline = time.monotonic() + 180
    while metric(url, "tide_draft_rollbacks_total") < 1:
        assert time.monotonic() < deadline, "no rollback"
        complete(url, ROLLBACK, 48)
    wait_for("the previous version back", lambda: drafts(url).get(ROLLBACK) == "rb-first")
    tags = reg.tags(second)
    assert "fell short" in tags["rollback.reason"] and tags["rollback.node"] == "node-a"
    assert tags["rollback.to"] == str(first.version)
    assert float(tags["live.node-a.tau_gamma3"]) <= 4.0
    assert reg.alias("champion") == str(first.version)  # every node follows the rollback
    wait_for("the other node back too", lambda: drafts(nodes[1]).get(ROLLBACK) == "rb-first")


def test_registry_or_store_away_serving_goes_on_and_catches_up(
    target_native: Target, trained_draft_dir: Path, tmp_path: Path
) -> None:
    """Its own registry and S3 server, so stopping them disturbs no other test."""
    store = S3Server(tmp_path / "s3").start()
    with as_account(store.env):  # this test's own S3 account, for the in-process registrar
        mlflow = MlflowServer(tmp_path / "mlflow", s3=store, bucket="tide-away").start()
        try:
            workload = "away"
            reg = Registrar(mlflow.url, target_native.fingerprint, workload)
            v1 = reg.register(copy_draft(trained_draft_dir, tmp_path / "v1", "away-1"))
            reg.champion(v1)
            args = node_args(trained_draft_dir, mlflow.url, ("--workloads", workload))
            with serve_process(args, tmp_path / "node.log", env=store.env) as url:
                wait_for("v1", lambda: drafts(url).get(workload) == "away-1")
                v2 = reg.register(copy_draft(trained_draft_dir, tmp_path / "v2", "away-2"))

                store.stop()  # the artifacts are out of reach: the champion changes, the download fails
                reg.champion(v2)
                errors = metric(url, "tide_registry_errors_total")
                wait_for("a failed download", lambda: metric(url, "tide_registry_errors_total") > errors)
                assert complete(url, workload)["usage"]["completion_tokens"] == 24
                assert drafts(url).get(workload) == "away-1"

                url_before = mlflow.url
                mlflow.stop()  # and the registry too
                errors = metric(url, "tide_registry_errors_total")
                wait_for("a failed poll", lambda: metric(url, "tide_registry_errors_total") > errors)
                assert complete(url, workload)["usage"]["completion_tokens"] == 24
                assert drafts(url).get(workload) == "away-1"

                store.start()
                mlflow.start()
                assert mlflow.url == url_before  # back where the node expects it
                wait_for("v2 once both are back", lambda: drafts(url).get(workload) == "away-2", timeout=120)
                assert metric(url, "tide_draft_refused_total") == 0  # unreachable is not refused
        finally:
            mlflow.stop()
            store.stop()


def test_the_sync_reads_when_training_stopped_paying_off(
    registry: MlflowServer, target_native: Target, trained_draft_dir: Path, tmp_path: Path
) -> None:
    """From the trainer's and the gate's tags: a trainer whose candidates stopped improving on each
    other is saturated; one whose candidates the gate kept refusing is outdone, until one is promoted.
    Each is dated by the oldest candidate it counts (the advisor weighs them against when training
    was called for)."""
    from types import SimpleNamespace

    from tide.serving.candidate_history import HistoryConfig
    from tide.serving.draft_sync import DraftSync, SyncConfig

    workload = f"sat-{uuid.uuid4().hex[:4]}"
    reg = Registrar(registry.url, target_native.fingerprint, workload)
    engine = SimpleNamespace(fingerprint=target_native.fingerprint, workloads=set)
    cfg = SyncConfig(
        registry.url, tmp_path / "cache", "t", history=HistoryConfig(patience=2, outdone_after=3)
    )
    sync = DraftSync(cfg, engine).candidates  # it reads the fingerprint and the workloads only

    def candidate(gain: float, decision: str) -> float:
        mv = reg.register(trained_draft_dir, {"held_out_gain": str(gain)})
        reg.client.set_model_version_tag(reg.name, mv.version, "gate.decision", decision)
        sync.check(workload, reg.name)
        return int(mv.creation_timestamp) / 1000.0

    first = candidate(0.05, "refused")
    second = candidate(0.04, "refused")
    assert workload not in sync.saturated and workload not in sync.outdone  # improving, two refused
    candidate(0.03, "refused")
    assert workload in sync.outdone and workload not in sync.saturated
    assert sync.outdone[workload] == first  # the oldest of the three refusals
    third_small = candidate(0.002, "refused")
    assert sync.outdone[workload] == second  # dated by the oldest of the last three refusals
    candidate(0.001, "promoted")
    assert sync.saturated[workload] == third_small  # the last two gained nothing
    assert workload not in sync.outdone and workload in sync.saturated
