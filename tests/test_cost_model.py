"""The cost model's arithmetic: tau from per-depth acceptance, and the speedup it implies."""

from __future__ import annotations

import pytest

from tide.registry.profile import StepProfile, expected_tokens


def test_expected_tokens_multiplies_acceptance_along_the_chain() -> None:
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == pytest.approx(2.0)
    assert expected_tokens([0.8, 0.6], 1) == pytest.approx(1.8)  # only the first gamma depths count


def test_speedup_matches_the_papers_formula_with_one_alpha() -> None:
    a, gamma = 0.7, 3
    profile = StepProfile(1, {1: 0.010, 4: 0.012}, draft_step=0.001)
    c, beta = 0.1, 1.2
    paper = (1 - a ** (gamma + 1)) / ((1 - a) * (c * gamma + beta))
    assert profile.speedup([a] * gamma, gamma) == pytest.approx(paper)
    assert profile.speedup([a] * gamma, 0) == 1.0


def test_measured_drafting_and_overhead_enter_the_prediction() -> None:
    profile = StepProfile(1, {1: 0.010, 3: 0.011}, draft_step=0.001, overhead=0.002, draft_total=0.004)
    # tau 1.75 over (drafting 4 ms + verify 11 ms + 2 ms) / (decode 10 ms + 2 ms)
    assert profile.speedup([0.5, 0.5], 2) == pytest.approx(1.75 * 0.012 / 0.017)


def test_a_chain_of_draft_steps_costs_the_first_then_the_cheaper_next_ones() -> None:
    profile = StepProfile(1, {1: 0.010, 4: 0.012}, draft_step=0.0011, draft_next=0.0007)
    assert profile.drafting(0) == 0.0
    assert profile.drafting(3) == pytest.approx(0.0011 + 2 * 0.0007)
    assert profile.speedup([0.5] * 3, 3) == pytest.approx(1.875 * 0.010 / (0.012 + 0.0025))
    # published for the gate and read back; an older node's profile has no draft_next
    assert StepProfile.from_json(profile.to_json("node")).drafting(3) == pytest.approx(0.0025)
    old = StepProfile(1, {1: 0.010, 4: 0.012}, draft_step=0.0011)
    assert StepProfile.from_json(old.to_json("node")).drafting(3) == pytest.approx(0.0033)
