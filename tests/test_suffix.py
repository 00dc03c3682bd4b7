"""The suffix proposer: what the index finds and proposes, and that drafting from it (alone or beside
the learned draft) leaves greedy output identical and the sampled distribution the target's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_draft, tiny_target, trained_tiny_draft
from tide.serving.controller import ControllerConfig, build_controller
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.suffix import SuffixConfig, SuffixIndex, SuffixProposer, longest_matches

from .test_spec_tiny import _reference_greedy, assert_sampled_from, exact_joint


def test_the_longest_match_wins_and_no_match_crosses_two_streams() -> None:
    index = SuffixIndex(32)
    index.add([1, 2, 3, 4])
    index.add([9, 2, 3, 7])
    n, ends = longest_matches(index.buf, torch.tensor([5, 1, 2, 3]), 8)
    assert n == 3 and index.buf[ends + 1].tolist() == [4]  # [1 2 3] beats [2 3], which ends twice
    n, ends = longest_matches(index.buf, torch.tensor([4, 9]), 8)  # 4 ends one stream, 9 starts the next
    assert n == 1
    assert longest_matches(index.buf, torch.tensor([42]), 8)[0] == 0


def test_the_ring_forgets_the_oldest_streams_first() -> None:
    index = SuffixIndex(10)
    index.add([1, 2, 3])
    index.add([4, 5, 6])
    index.add([7, 8, 9])  # no room after the second: written from the start, over the first
    assert longest_matches(index.buf, torch.tensor([1, 2]), 8)[0] == 0
    assert longest_matches(index.buf, torch.tensor([4, 5]), 8)[0] == 2
    index.add(list(range(100, 130)))  # longer than the ring: its newest tokens are kept
    assert longest_matches(index.buf, torch.tensor([127, 128]), 8)[0] == 2


def test_proposals_follow_the_majority_and_grow_with_what_was_accepted() -> None:
    sp = SuffixProposer(SuffixConfig(step_cost=0.1))
    for tail in ([7, 8, 9, 10], [7, 8, 9, 10], [7, 8, 5, 6]):
        sp.remember("w", [1, 2, 3, *tail])
    context = torch.tensor([0, 1, 2, 3])
    p = sp.propose("w", context, 8)
    assert p is not None and p.tokens[:2] == [7, 8]  # all three agree on 7 8, then two of three on 9
    first = len(p.tokens)
    assert p.reach == sorted(p.reach, reverse=True) and p.reach[-1] >= 0.1
    assert sp.propose("other", context, 8) is None  # each workload its own index
    assert sp.propose("w", torch.tensor([0, 1, 2, 3]), 0) is None
    for _ in range(50):  # every token accepted: the class's rates rise, proposals run longer
        sp.observe("w", p, len(p.tokens))
    assert len(sp.propose("w", context, 8).tokens) > first  # type: ignore[union-attr]
    # the sequence's own context counts too: a repeat within one request is found at once
    own = torch.tensor([40, 41, 42, 43, 44, 40, 41])
    q = SuffixProposer(SuffixConfig()).propose("x", own, 3)
    assert q is not None and q.tokens[0] == 42


def test_the_step_times_decide_how_far_a_proposal_goes() -> None:
    sp = SuffixProposer(SuffixConfig())
    for tail in ([7, 8, 9, 10], [7, 8, 9, 10], [7, 8, 5, 6]):
        sp.remember("w", [1, 2, 3, *tail])
    context = torch.tensor([0, 1, 2, 3])
    free = sp.propose("w", context, 4, cost=[1.0] * 5)  # verifying more costs nothing: follow the vote out
    assert free is not None and free.tokens == [7, 8, 9, 10]
    assert free.speedup == pytest.approx(1.0 + sum(free.reach))
    dear = [1.0 + k * 2.0 for k in range(5)]  # each token costs twice a step: none is worth it
    assert sp.propose("w", context, 4, cost=dear) is None
    usual = sp.propose("w", context, 4)  # by default each token costs `step_cost` of a step
    assert usual is not None and usual.speedup > 1.0
    gains = [(1.0 + sum(usual.reach[:k])) / (1.0 + 0.1 * k) for k in range(len(usual.reach) + 1)]
    assert usual.speedup == pytest.approx(max(gains))


def test_greedy_with_the_index_is_token_identical_at_every_batch_size() -> None:
    target = tiny_target(seed=5, scale=2.0)
    draft = trained_tiny_draft(target, seed=6, vocab=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(8)]
    prompts = prompts + prompts  # the second time round, the index holds the first answers
    ref = _reference_greedy(target, prompts, 20)
    # the controller's step times decide how far proposals go and which source wins a row
    for proposer, adaptive in (("suffix", False), ("hybrid", False), ("hybrid", True)):
        for batch in (1, 4):
            cfg = EngineConfig(max_batch=batch, max_model_len=64, gamma=3, proposer=proposer)
            own = draft if proposer == "hybrid" else None
            c = (
                build_controller(target.model, own, ControllerConfig(max_gamma=3), batch, (batch,), 32)
                if adaptive
                else None
            )
            engine = Engine(target, own, cfg, controller=c)
            out = [s.output for s in engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))]
            assert out == ref, (proposer, adaptive, batch)
            assert engine.suffix is not None
            assert sum(s.accepted_tokens for s in engine.suffix.stats.values()) > 0, (
                proposer,
                adaptive,
                batch,
            )


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_sampling_with_the_index_keeps_the_target_distribution(proposer: str) -> None:
    """As `test_speculative_sampling_keeps_the_target_distribution`, with proposals from the index:
    one-hot proposals, accepted with probability p, rejected to the residual."""
    temperature = 0.8
    target = tiny_target(seed=3, scale=1.3, vocab=64)
    # an untrained draft: the index is expected to beat it wherever it has a proposal, and the draft
    # serves the rows where it has none, so both kinds of rows share verify passes
    draft = tiny_draft(target, seed=4) if proposer == "hybrid" else None
    prompt = [5, 17, 33, 2, 9]
    exact = exact_joint(target, prompt, temperature)
    n = 4000
    cfg = EngineConfig(max_batch=64, max_model_len=16, gamma=2, seed=11, proposer=proposer,
                       suffix=SuffixConfig(tokens=2048))  # fmt: skip
    engine = Engine(target, draft, cfg)
    seqs = engine.generate(
        [prompt] * n, SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    )
    assert engine.suffix is not None
    (stats,) = engine.suffix.stats.values()
    assert stats.chosen > 0 and 0 < stats.accepted_tokens < stats.proposed_tokens  # both paths ran
    assert proposer == "suffix" or engine.stats.steps > 0

    assert_sampled_from([s.output for s in seqs], exact)


def test_metrics_count_each_workloads_suffix_proposals() -> None:
    from tide.serving.metrics import ServingMetrics

    target = tiny_target(seed=5, scale=2.0)
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=64, gamma=3, proposer="suffix"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for workload in ("a", "a", "b"):  # "a" the second time repeats what its index holds
        engine.add(prompt, SamplingParams(max_tokens=16, ignore_eos=True), workload=workload)
        while engine.has_work:
            engine.step()
    text = ServingMetrics(engine).render().decode()
    stats = engine.suffix.stats if engine.suffix is not None else {}
    accepted = stats["a"].accepted_tokens
    assert accepted > 0
    assert f'tide_suffix_accepted_tokens_total{{workload="a"}} {float(accepted)}' in text
    assert 'tide_suffix_proposed_tokens_total{workload="a"}' in text


def test_an_index_that_raises_costs_its_step_the_proposals_only(monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target(seed=5, scale=2.0)
    prompts = [[7, 7, 8, 9], [1, 2, 3, 1, 2]]
    ref = _reference_greedy(target, prompts, 12)
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=64, gamma=3, proposer="suffix"))
    assert engine.suffix is not None

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the index")

    monkeypatch.setattr(engine.suffix, "propose", broken)
    out = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [s.output for s in out] == ref and all(s.finish_reason == "length" for s in out)


def test_a_flooding_feed_is_counted_and_dropped_never_blocks() -> None:
    """A feed faster than the engine, or naming more workloads than a node keeps indexes for, is
    dropped and counted; what this node served itself is never indexed twice."""
    proposer = SuffixProposer(SuffixConfig(inbox=4, max_workloads=2))
    proposer.remember("a", [1, 2, 3], "own")
    for i in range(6):  # two past the inbox: dropped at once, on the feed's thread
        proposer.feed(f"w{i % 3}", "own" if i == 0 else f"r{i}", [1, 2, 3, 4])
    assert proposer.dropped_inbox_full == 2
    proposer.take_fed()  # "own" skipped; w1 opens the second index, w2 and w0 would be a third
    assert set(proposer.indexes) == {"a", "w1"}
    assert proposer.fed == 1 and proposer.dropped_workloads_full == 2 and proposer.fed_dropped == 4
