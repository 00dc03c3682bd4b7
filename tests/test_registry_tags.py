"""The registry's tags: each record reads back what it wrote, and hand-edited or partial tags read as
absent rather than as wrong figures."""

from __future__ import annotations

from tide.registry.tags import (
    CandidateTags,
    Figures,
    GateVerdict,
    LiveReport,
    Recall,
    Rollback,
    VersionTags,
    champion_until_tags,
    parse_time,
    source_tags,
)

FIGS = Figures([1.5, 1.9, 2.1, 2.2], [1.1, 1.3, 1.25, 1.2], 2, 1.3)


def test_each_record_round_trips() -> None:
    cand = CandidateTags("code", "ab" * 32, "v7", 120, 300, "tide.code:0=0..120", 2.25, 0.03)
    verdict = GateVerdict(
        "promoted", "speedup 1.300", FIGS, "tide-draft-x-code v3", FIGS, "tau gain +0.1", 2048, "batch 1"
    )
    recall = Recall(FIGS, "came back")
    rollback = Rollback("node-a", "live tau fell short", "3", "moved")
    tags = {**cand.to_tags(), **verdict.to_tags(), **recall.to_tags(), **rollback.to_tags()}
    tags |= LiveReport("node-a", 4, 2.0, 1000).to_tags()
    read = VersionTags.from_tags(tags)
    assert read.candidate == cand
    assert read.verdict == verdict and read.verdict.baseline_version == "3"
    assert read.recall == recall and read.rollback == rollback
    assert read.was_champion and parse_time(verdict.time) > 0


def test_prediction_comes_from_the_recall_when_there_was_one() -> None:
    gated = GateVerdict("promoted", "ok", FIGS).to_tags()
    assert VersionTags.from_tags(gated).predicted_tau == {1: 1.5, 2: 1.9, 3: 2.1, 4: 2.2}
    later = Figures([1.2, 1.4], None, 1, 1.2)
    both = {**gated, **Recall(later, "back").to_tags()}
    assert VersionTags.from_tags(both).predicted_tau == {1: 1.2, 2: 1.4}
    # between the gate's two writes (evidence, alias, decision) a node may read the champion
    evidence = GateVerdict("promoted", "ok", FIGS).evidence_tags()
    assert VersionTags.from_tags(evidence).predicted_tau == {1: 1.5, 2: 1.9, 3: 2.1, 4: 2.2}


def test_partial_or_foreign_tags_read_as_absent() -> None:
    assert VersionTags.from_tags(None) == VersionTags.from_tags({})
    read = VersionTags.from_tags({"gate.decision": "maybe", "held_out_gain": "lots", "workload": "x"})
    assert read.verdict is None and read.candidate is None  # an unknown decision: still undecided
    gap = {"gate.decision": "refused", "gate.tau_gamma1": "1.5", "gate.tau_gamma3": "2.0"}
    verdict = VersionTags.from_tags(gap).verdict
    assert verdict is not None and verdict.figures is None  # gamma 2 missing: no series at all
    poisoned = {**gap, "gate.tau_gamma2": "nan"}
    assert VersionTags.from_tags(poisoned).predicted_tau == {}  # not a number: as if missing
    assert VersionTags.from_tags({"gate.recall.reason": "x"}).recall is None  # no figures, no time
    assert GateVerdict("promoted", "", baseline="none").baseline_version is None


def test_versions_no_trainer_made() -> None:
    read = VersionTags.from_tags({**source_tags("tide up"), **champion_until_tags()})
    assert read.source == "tide up" and read.candidate is None and read.was_champion
