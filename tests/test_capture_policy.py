"""Capture rules per workload: from the command line, changed at run time, the client's opt-out wins."""

from __future__ import annotations

import pytest

from tide.serving.capture import CapturePolicy, CaptureRule, parse_rules


def test_rules_from_the_command_line() -> None:
    policy = CapturePolicy(parse_rules("code=on, chat_fr=0.25, *=off"), seed=1)
    assert policy.rule("code") == CaptureRule(True, 1.0)
    assert policy.rule("unknown") == CaptureRule(False, 1.0)
    share = sum(policy.decide("chat_fr", opted_out=False) for _ in range(2000)) / 2000
    assert 0.2 < share < 0.3
    assert not any(policy.decide("code", opted_out=True) for _ in range(50))
    assert not any(policy.decide("unknown", opted_out=False) for _ in range(50))
    policy.set("unknown", CaptureRule(True, 1.0))
    assert all(policy.decide("unknown", opted_out=False) for _ in range(50))


@pytest.mark.parametrize("spec", ["code", "code=maybe", "code=1.5", "Bad Name=on"])
def test_bad_rules_say_why(spec: str) -> None:
    with pytest.raises(ValueError, match=r"capture rule|fraction|workload name"):
        parse_rules(spec)


def test_auto_rules_follow_the_advisor() -> None:
    policy = CapturePolicy(parse_rules("code=auto,*=off"))
    assert policy.rule("code").auto
    assert policy.decide("code", False)  # no advisor yet: capture
    needs = {"code": False}
    policy.advisor = lambda w: needs[w]
    assert not policy.decide("code", False) and not policy.active("code")
    needs["code"] = True
    assert policy.decide("code", False) and policy.active("code")
    assert not policy.decide("code", True)  # the client's opt-out still wins
    assert not policy.active("other")
