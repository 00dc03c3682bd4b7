"""Capture rules per workload: from the command line, changed at run time, the client's opt-out wins;
`auto` rules: the held-out share always, everything while the workload needs training; which
requests are held out; which workload names a node serves."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tide.producers.records import is_held_out
from tide.serving.capture import (
    CaptureDecision,
    CapturePolicy,
    CaptureRule,
    TrainingAdvisor,
    WorkloadSet,
    parse_rules,
)


def test_rules_from_the_command_line() -> None:
    policy = CapturePolicy(parse_rules("code=on, chat_fr=0.25, *=off"), seed=1)
    assert policy.rule("code") == CaptureRule(True, 1.0)
    assert policy.rule("unknown") == CaptureRule(False, 1.0)
    share = sum(policy.decide("chat_fr", opted_out=False).capture for _ in range(2000)) / 2000
    assert 0.2 < share < 0.3
    assert not any(policy.decide("code", opted_out=True).capture for _ in range(50))
    assert not any(policy.decide("unknown", opted_out=False).capture for _ in range(50))
    policy.set("unknown", CaptureRule(True, 1.0))
    assert all(policy.decide("unknown", opted_out=False).capture for _ in range(50))


@pytest.mark.parametrize("spec", ["code", "code=maybe", "code=1.5", "Bad Name=on"])
def test_bad_rules_say_why(spec: str) -> None:
    with pytest.raises(ValueError, match=r"capture rule|fraction|workload name"):
        parse_rules(spec)


@dataclass
class _Needs:
    """An advisor set by hand."""

    needs: dict[str, bool]

    def __call__(self, workload: str) -> bool:
        return self.needs[workload]


def test_auto_rules_follow_the_advisor() -> None:
    policy = CapturePolicy(parse_rules("code=auto,*=off"))
    assert policy.rule("code").auto
    assert policy.decide("code", False).capture  # no advisor yet: capture
    advisor = _Needs({"code": False})
    policy.advisor = advisor
    assert not policy.decide("code", False).capture and not policy.active("code")
    advisor.needs["code"] = True
    assert policy.decide("code", False).capture and policy.active("code")
    assert not policy.decide("code", True).capture  # the client's opt-out still wins
    assert not policy.active("other")
    ids = [f"req-{i}" for i in range(400)]
    advisor.needs["code"] = False
    captured = [(i, policy.decide("code", False, i)) for i in ids]
    held = [i for i, d in captured if d.capture]
    assert held and all(is_held_out(i) and d.held_out for i, d in captured if d.capture)  # the gate's share
    assert len(held) == sum(is_held_out(i) for i in ids)


def test_a_prompt_that_comes_again_keeps_its_held_out_status() -> None:
    policy = CapturePolicy(parse_rules("*=on"), remember_prompts=2, held_out_min=0)  # by id alone
    trained = next(f"r{i}" for i in range(100) if not is_held_out(f"r{i}"))
    held = next(f"r{i}" for i in range(100) if is_held_out(f"r{i}"))
    assert policy.decide("w", False, trained, [1, 2]) == CaptureDecision(True, False)
    assert policy.decide("w", False, held, [3]) == CaptureDecision(True, True)
    # greedy decoding answers them as before: what was learnt from never evaluates, and back
    assert policy.decide("w", False, held, [1, 2]) == CaptureDecision(True, False)
    assert policy.decide("w", False, trained, [3]) == CaptureDecision(True, True)
    policy.decide("w", False, trained, [4])
    policy.decide("w", False, trained, [5])  # [1, 2] and [3] are forgotten: the id decides again
    assert policy.decide("w", False, held, [1, 2]) == CaptureDecision(True, True)


@dataclass
class _Signals:
    """The controller's two signals, set by hand (as if each had held long enough to count)."""

    shift: bool = False
    paying: bool = True

    def needs_training(self, workload: str) -> bool:
        return self.shift or not self.paying


@dataclass
class _Sync:
    saturated: dict[str, float] = field(default_factory=dict)
    outdone: dict[str, float] = field(default_factory=dict)


def test_training_lasts_from_a_shift_until_the_trainer_saturates() -> None:
    signals, sync, now = _Signals(), _Sync(), [0.0]
    advise = TrainingAdvisor(signals, sync, clock=lambda: now[0])
    assert advise("w")  # first sight: train until the trainer says there is nothing left to learn
    sync.saturated["w"] = 5.0
    assert not advise("w")
    restarted = TrainingAdvisor(signals, sync, clock=lambda: now[0])
    assert not restarted("w")  # a node that starts beside a saturated trainer does not capture
    sync.saturated["w"] = -100.0  # saturated long before: says nothing about what comes
    now[0], signals.shift = 10.0, True
    assert advise("w")
    now[0], signals.shift = 20.0, False  # the short average caught up with the long one: training goes on
    assert advise("w")
    sync.saturated["w"] = 30.0  # candidates after the shift stopped improving
    assert not advise("w")
    now[0], signals.paying = 40.0, False  # the draft stopped paying: a new reason, training again
    assert advise("w")
    sync.saturated["w"] = 50.0
    now[0] = 60.0
    assert not advise("w") and not advise("w")  # still not paying, but nothing new: no endless training


def test_after_a_shift_the_gate_gets_the_new_traffic_at_once() -> None:
    """One request in ten by id leaves the first held-out request of a new workload to chance; while
    it needs training, every other captured request is held out until the gate's window holds three."""
    signals, sync, now = _Signals(), _Sync(), [0.0]
    advise = TrainingAdvisor(signals, sync, clock=lambda: now[0])
    policy = CapturePolicy(parse_rules("*=auto"), clock=lambda: now[0])
    policy.advisor = advise
    ids = iter(f"w-{i}" for i in range(200) if not is_held_out(f"w-{i}"))  # none held out by id

    def serve(n: int) -> list[tuple[bool, bool]]:
        return [(d.capture, d.held_out) for d in (policy.decide("w", False, next(ids)) for _ in range(n))]

    assert serve(8) == [(True, True), (True, False)] * 3 + [(True, False)] * 2  # first sight: training
    now[0], signals.shift = 60.0, True  # the detector fires again within the gate's window
    assert serve(2) == [(True, False)] * 2  # three held out in the last two minutes are enough
    sync.saturated["w"] = 61.0
    now[0], signals.shift = 62.0, False
    assert serve(1) == [(False, False)]  # saturated: not captured
    now[0], signals.shift = 300.0, True  # the traffic moved, and the window holds none of it
    assert serve(6) == [(True, True), (True, False)] * 3


def test_a_gate_that_keeps_refusing_ends_training_only_while_the_draft_pays() -> None:
    signals, sync, now = _Signals(), _Sync(), [0.0]
    advise = TrainingAdvisor(signals, sync, clock=lambda: now[0])
    assert advise("w")  # first sight
    now[0], sync.outdone["w"] = 10.0, 8.0  # the gate refused the trainer's last candidates
    assert not advise("w")  # the draft pays: the trainer improves on itself, not on what serves
    now[0], signals.paying = 20.0, False  # the traffic changed: the draft stopped paying
    assert advise("w")
    sync.outdone["w"] = 30.0  # candidates refused while the draft does not pay: keep learning
    now[0] = 40.0
    assert advise("w")
    signals.paying = True  # a promoted draft pays; the refusals since the change now end training
    assert not advise("w")


def test_captured_at_low_traffic_the_gate_gets_its_share() -> None:
    """Capture `on`: one in ten by id, and every other request while the gate's window of two minutes
    holds fewer than three held out (a loop test once had none among its first forty requests)."""
    now = [0.0]
    policy = CapturePolicy(parse_rules("*=on"), clock=lambda: now[0])
    ids = iter(f"q-{i}" for i in range(400) if not is_held_out(f"q-{i}"))  # none held out by id
    held = [policy.decide("w", False, next(ids)).held_out for _ in range(40)]
    assert held == [True, False] * 3 + [False] * 34
    now[0] = 121.0  # the window moved past them
    assert [policy.decide("w", False, next(ids)).held_out for _ in range(3)] == [True, False, True]
    by_id = next(f"q-{i}" for i in range(400) if is_held_out(f"q-{i}"))
    assert policy.decide("w", False, by_id).held_out  # the id's share always


def test_past_the_cap_workload_names_are_served_as_default_and_counted() -> None:
    served = WorkloadSet(cap=2)
    assert [served.resolve(f"w{i}") for i in range(5)] == ["w0", "w1", "default", "default", "default"]
    assert served.resolve("w1") == "w1" and served.resolve("default") == "default"  # neither counts
    assert served.overflow == 3 and served.names() == ["default", "w0", "w1"]
    assert "w0" in served and "w2" not in served and "default" in served


def test_an_allow_list_admits_nothing_else() -> None:
    served = WorkloadSet(["code", "fr"], cap=100)
    assert [served.resolve(w) for w in ("code", "fr", "math", "default")] == [
        "code",
        "fr",
        "default",
        "default",
    ]
    assert served.overflow == 1 and served.names() == ["code", "default", "fr"]
    policy = CapturePolicy(workloads=served)
    assert (
        policy.snapshot()["served"] == ["code", "default", "fr"]
        and policy.snapshot()["served_as_default"] == 1
    )


@pytest.mark.parametrize("name", ["No Spaces!", "", "-dash", "x" * 49])
def test_invalid_workload_names_are_refused_not_mapped(name: str) -> None:
    served = WorkloadSet(cap=2)
    with pytest.raises(ValueError, match="workload name"):
        served.resolve(name)
    assert served.overflow == 0 and served.names() == ["default"]
    with pytest.raises(ValueError, match="workload name"):
        WorkloadSet([name])
