"""The gate against a real registry (MLflow, artifacts in a real S3 server) and real held-out
records in Kafka: a better candidate is promoted, worse and broken ones are refused with tags
saying why, and the old champion stays reachable as `previous`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target, load_head
from tide.producers.records import HeldOutWindow
from tide.registry.gate import Evaluation, Gate, GateConfig
from tide.registry.store import PROFILE_TAG
from tide.serving.cost_model import measure_profile

from .conftest import serve_into_kafka
from .drafts import Registrar, copy_draft, foreign_draft, nan_draft, noisy_draft, read_held_out


@pytest.fixture(scope="module")
def gate_setup(
    kafka: KafkaBroker, registry: MlflowServer, target_native: Target, trained_draft_dir: Path
) -> Iterator[tuple[Gate, Registrar]]:
    workload = f"gate-{uuid.uuid4().hex[:6]}"
    # held-out records of the workload: request ids the trainers never learn from
    serve_into_kafka(target_native, kafka.bootstrap, workload, "code.jsonl", 8, held_out=True)
    reg = Registrar(registry.url, target_native.fingerprint, workload)
    draft = Eagle3Draft.load(
        trained_draft_dir, target_native.model.embed_tokens, target_native.config, target_native.fingerprint,
        target_native.model.dtype,
    )  # fmt: skip
    # step times as a serving node publishes them: the gate scores by the cost model's speedup
    profile = measure_profile(target_native.model, draft, 1, 256, 5)
    reg.client.set_registered_model_tag(reg.name, PROFILE_TAG, profile.to_json("test-node"))
    # the records are served once, here: the whole module judges on all of them, however long it runs
    cfg = GateConfig(
        registry.url, kafka.bootstrap, registry.data_dir / "gate-cache", held_out=HeldOutWindow(3600)
    )
    gate = Gate(cfg, load_head())
    read_held_out(gate, workload, 8)
    try:
        yield gate, reg
    finally:
        gate.close()  # releases the registry's gate lease for the next module's gate


def _decide(gate: Gate, reg: Registrar) -> dict[str, str]:
    decisions = [d for d in gate.run_once() if d.name == reg.name]
    assert decisions, "the gate decided nothing"
    return decisions[-1].tags


def test_gate_promotes_better_refuses_worse_and_broken(
    gate_setup: tuple[Gate, Registrar], trained_draft_dir: Path, tmp_path: Path
) -> None:
    gate, reg = gate_setup
    # a weaker draft first: no champion yet, so it only has to pay at all
    weak = reg.register(noisy_draft(trained_draft_dir, tmp_path / "weak", 0.5))
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "promoted", tags["gate.reason"]
    assert tags["gate.baseline"] == "none" and float(tags["gate.score"]) >= 1.0
    assert len(gate.held_out[reg.workload].examples) == 8  # requests, each joined from its records
    assert {f"gate.tau_gamma{g}" for g in range(1, 5)} <= tags.keys()
    assert {f"gate.speedup_gamma{g}" for g in range(1, 5)} <= tags.keys()
    assert reg.alias("champion") == str(weak.version)

    # the trained draft beats it: promoted, and the weak one becomes `previous`
    good = reg.register(trained_draft_dir)
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "promoted", tags["gate.reason"]
    assert float(tags["gate.score"]) > float(tags["gate.baseline.score"])
    assert tags["gate.gain"].startswith("tau gain +")  # over eight held-out requests: significant
    assert tags["gate.baseline"].endswith(f"v{weak.version}")
    assert reg.alias("champion") == str(good.version) and reg.alias("previous") == str(weak.version)
    assert reg.tags(good) == {**reg.tags(good), **tags}  # the evidence is on the version

    # worse than the champion: refused, with both scores and the reason on the version
    worse = reg.register(noisy_draft(trained_draft_dir, tmp_path / "worse", 0.5, seed=1))
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "refused"
    assert float(tags["gate.score"]) < float(tags["gate.baseline.score"])
    assert "baseline" in tags["gate.reason"] or "minimum" in tags["gate.reason"]
    assert reg.tags(worse)["gate.decision"] == "refused"

    # as good as the champion is not enough: the margin is required
    same = reg.register(trained_draft_dir)
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "refused" and "does not beat" in tags["gate.reason"], tags["gate.reason"]
    assert reg.tags(same)["gate.decision"] == "refused"

    # broken versions never get as far as an evaluation
    reg.register_wrong_checksum(trained_draft_dir)
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "refused" and tags["gate.reason"].startswith("checksum"), tags
    reg.register(nan_draft(trained_draft_dir, tmp_path / "nan"))
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "refused" and "non-finite" in tags["gate.reason"], tags
    reg.register(foreign_draft(trained_draft_dir, tmp_path / "foreign"))
    tags = _decide(gate, reg)
    assert tags["gate.decision"] == "refused" and tags["gate.reason"].startswith("foreign target"), tags
    assert reg.alias("champion") == str(good.version)  # through all of it

    # a candidate that beats the champion but not the floor: refused (the floor set out of reach)
    gate.cfg.min_speedup = 100.0
    try:
        reg.register(copy_draft(trained_draft_dir, tmp_path / "floor", "floor"))
        tags = _decide(gate, reg)
    finally:
        gate.cfg.min_speedup = 1.0
    assert tags["gate.decision"] == "refused" and "below the minimum 100.000" in tags["gate.reason"], tags
    assert reg.alias("champion") == str(good.version)


def test_gate_skips_superseded_versions_and_waits_for_held_out_records(
    gate_setup: tuple[Gate, Registrar], trained_draft_dir: Path, registry: MlflowServer
) -> None:
    gate, reg = gate_setup
    a, b = reg.register(trained_draft_dir), reg.register(trained_draft_dir)
    decisions = {d.version: d for d in gate.run_once() if d.name == reg.name}
    assert decisions[str(a.version)].decision == "skipped"
    assert f"superseded by version {b.version}" in decisions[str(a.version)].reason
    assert str(b.version) in decisions  # the newest one was gated

    # a workload without held-out records yet: no decision, no tag, until they arrive
    other = f"quiet-{uuid.uuid4().hex[:6]}"
    quiet = Registrar(registry.url, gate.head.fingerprint, other)
    v = quiet.register(trained_draft_dir)
    assert not [d for d in gate.run_once() if d.name == quiet.name]
    assert "gate.decision" not in quiet.tags(v)


def test_gate_recalls_an_earlier_champion_that_serves_better(
    gate_setup: tuple[Gate, Registrar], trained_draft_dir: Path, tmp_path: Path
) -> None:
    gate, reg = gate_setup
    good, weak = reg.alias("champion"), reg.alias("previous")
    assert good and weak and good != weak
    # a node rolled the workload back to the weak draft; then a mediocre candidate arrives
    reg.client.set_registered_model_alias(reg.name, "champion", weak)
    cand = reg.register(noisy_draft(trained_draft_dir, tmp_path / "mediocre", 0.5, seed=2))
    tags = _decide(gate, reg)
    # the trained draft, champion once, beats both on the held-out traffic: it is champion again
    assert tags["gate.decision"] == "refused" and f"earlier champion v{good}" in tags["gate.reason"], tags
    assert reg.alias("champion") == good and reg.alias("previous") == weak
    recalled = reg.tags(reg.client.get_model_version(reg.name, good))
    assert f"beat candidate v{cand.version}" in recalled["gate.recall.reason"]
    assert float(recalled["gate.recall.score"]) > float(tags["gate.score"])
    assert "gate.champion_until" in reg.tags(reg.client.get_model_version(reg.name, weak))


def test_gate_brings_an_earlier_champion_back_when_its_traffic_comes_back(
    gate_setup: tuple[Gate, Registrar], target_native: Target, kafka: KafkaBroker
) -> None:
    gate, reg = gate_setup
    good, weak = reg.alias("champion"), reg.alias("previous")
    assert good and weak
    # the weak draft serves (say the traffic moved away and the trainer's draft for it won); no candidate
    reg.client.set_registered_model_alias(reg.name, "champion", weak)
    assert not [d for d in gate.run_once() if d.name == reg.name]  # no new held-out traffic: nothing to judge
    # the good draft's traffic comes back: new held-out records, and the gate weighs the champions again
    serve_into_kafka(
        target_native, kafka.bootstrap, reg.workload, "code.jsonl", 3, held_out=True, batch="back"
    )
    decisions = [d for d in gate.run_once() if d.name == reg.name]
    assert [d.decision for d in decisions] == ["recalled"] and decisions[0].version == good, decisions
    assert reg.alias("champion") == good and reg.alias("previous") == weak
    tags = reg.tags(reg.client.get_model_version(reg.name, good))
    assert f"champion v{weak}" in tags["gate.recall.reason"] and float(tags["gate.recall.score"]) > 1.0


def _evaluation(accepted: list[int], anchors: list[int]) -> Evaluation:
    acc = torch.tensor(accepted).unsqueeze(-1).repeat(1, 4)  # the same at every gamma
    n = torch.tensor(anchors)
    tau = [1.0 + float(acc[:, 0].sum()) / float(n.sum())] * 4
    return Evaluation("1", tau, None, acc, n)


def test_a_gain_on_a_few_examples_is_not_significant() -> None:
    z = GateConfig("", "", Path()).confidence
    base = _evaluation([40] * 8, [64] * 8)
    # the same mean gain (+0.109 tokens per step): from one example that happened to suit the
    # candidate, or from all eight
    lucky = _evaluation([104, 32, 40, 40, 40, 40, 40, 40], [64] * 8)
    steady = _evaluation([47] * 8, [64] * 8)
    assert (
        lucky.gain_over(base, 3)[0] == pytest.approx(steady.gain_over(base, 3)[0]) == pytest.approx(56 / 512)
    )
    assert not lucky.beats(base, z)[0]
    assert steady.beats(base, z)[0]
    # examples without anchors (prompt chunks) count for nothing; one example alone proves nothing
    assert lucky.gain_over(base, 3) == _evaluation(
        [104, 32, 40, 40, 40, 40, 40, 40, 0], [64] * 8 + [0]
    ).gain_over(_evaluation([40] * 9, [64] * 8 + [0]), 3)
    assert not _evaluation([64], [64]).beats(_evaluation([0], [64]), z)[0]
