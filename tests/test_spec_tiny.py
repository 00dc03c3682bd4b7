"""Speculative decoding on tiny random Llamas, where every distribution can be enumerated."""

from __future__ import annotations

import torch

from tests.conftest import tiny_draft, tiny_target, trained_tiny_draft
from tide.producers.tap import TapEvent
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams


def _next_probs(model, seqs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Distribution of the next token after each row of `seqs` (all the same length), by one forward."""
    with torch.inference_mode():
        out = model.forward_once(seqs)
        return (model.logits(out.hidden[:, -1]) / temperature).softmax(-1).double()


def exact_joint(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """The exact joint distribution (v, v, v) of the first three tokens sampled after `prompt`."""
    v = target.config.vocab_size
    p1 = _next_probs(target.model, torch.tensor([prompt]), temperature)[0]
    ones = torch.arange(v).unsqueeze(1)
    p2 = _next_probs(target.model, torch.cat([torch.tensor([prompt]).repeat(v, 1), ones], 1), temperature)
    pairs = torch.stack(torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij"), -1).view(-1, 2)
    p3 = _next_probs(
        target.model, torch.cat([torch.tensor([prompt]).repeat(v * v, 1), pairs], 1), temperature
    ).view(v, v, v)
    return p1.view(v, 1, 1) * p2.view(v, v, 1) * p3


def assert_sampled_from(outputs: list[list[int]], exact: torch.Tensor) -> torch.Tensor:
    """Chi-square of the outputs' three-token counts against `exact` (cells expected below 5
    pooled): with df degrees of freedom, mean df and sd sqrt(2 df); 5 sd is far outside noise."""
    n, v = len(outputs), exact.shape[0]
    counts = torch.zeros(v, v, v, dtype=torch.float64)
    for a, b, c in outputs:
        counts[a, b, c] += 1
    expected = exact * n
    big = expected >= 5
    chi2 = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_e, rest_o = expected[~big].sum(), counts[~big].sum()
    chi2 += (rest_o - rest_e) ** 2 / rest_e
    df = int(big.sum())
    assert chi2 < df + 5 * (2 * df) ** 0.5, (float(chi2), df)
    return counts


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    temperature = 0.8
    target = tiny_target(seed=3, scale=1.3, vocab=64)
    draft = trained_tiny_draft(target, seed=4)
    prompt = [5, 17, 33, 2, 9]
    exact = exact_joint(target, prompt, temperature)
    n = 12000
    engine = Engine(target, draft, EngineConfig(max_batch=128, max_model_len=16, gamma=2, seed=11))
    seqs = engine.generate(
        [prompt] * n, SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    )
    rates = engine.stats.rates()
    assert 0.05 < rates[0] < 0.95, rates  # both accept and reject paths ran
    assert engine.stats.drafted == 2 * engine.stats.steps  # gamma 2: two proposed per sequence-step
    counts = assert_sampled_from([s.output for s in seqs], exact)
    # and a wrong rule would be caught: the draft's own distribution differs measurably
    assert float((exact.sum((1, 2)) - counts.sum((1, 2)) / n).abs().sum()) < 0.05


def _reference_greedy(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(max_batch=1, max_model_len=64, gamma=0))
    return [
        s.output for s in engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    ]


def test_greedy_lossless_tiny_all_batch_sizes_and_gammas() -> None:
    target = tiny_target(seed=5, scale=2.0)
    draft = trained_tiny_draft(target, seed=6, vocab=128)  # a reduced draft vocabulary, as in production
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(24)
    ]
    ref = _reference_greedy(target, prompts, 20)
    for batch in (1, 4, 16):
        for gamma in range(1, 6):
            engine = Engine(target, draft, EngineConfig(max_batch=batch, max_model_len=64, gamma=gamma))
            out = [s.output for s in engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))]
            assert out == ref, (batch, gamma)
            assert engine.stats.accepted.sum() > 0  # the draft was right sometimes


def test_tap_hands_out_exactly_the_committed_positions() -> None:
    target = tiny_target(seed=7)
    draft = tiny_draft(target, seed=8)
    events: list[TapEvent] = []
    engine = Engine(
        target,
        draft,
        EngineConfig(max_batch=4, max_model_len=64, gamma=3),
        tap=lambda e: events.append(
            TapEvent(
                e.request_id,
                e.workload,
                e.first_position,
                e.tokens.clone(),
                e.aux.clone(),
                e.hidden.clone(),
                e.prefill,
                e.draft_version,
                e.final,
            )
        ),
    )
    prompts = [[1, 2, 3, 4], [9, 8, 7], [100, 50, 25, 12, 6]]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for seq in seqs:
        evs = sorted((e for e in events if e.request_id == seq.request_id), key=lambda e: e.first_position)
        assert evs[0].prefill and not any(e.prefill for e in evs[1:])
        assert evs[-1].final and not any(e.final for e in evs[:-1])
        starts = [e.first_position for e in evs]
        lens = [len(e.aux) for e in evs]
        assert all(len(e.tokens) == len(e.aux) + 1 == len(e.hidden) + 1 for e in evs)
        assert starts == [sum(lens[:i]) for i in range(len(lens))]  # contiguous, none missing, none twice
        # together: exactly the prompt and the completion, each state with the token it predicted
        tokens = torch.cat([e.tokens[:-1] for e in evs] + [evs[-1].tokens[-1:]])
        assert tokens.tolist() == seq.prompt + seq.output
        # the states equal a fresh forward over the same tokens: no extra pass was needed to get them
        ref = target.model.forward_once(tokens[:-1].unsqueeze(0), capture_aux=True)
        assert ref.aux is not None
        assert torch.allclose(torch.cat([e.aux for e in evs]), ref.aux[0], atol=1e-5)
        assert torch.allclose(torch.cat([e.hidden for e in evs]), ref.hidden[0], atol=1e-5)
        assert evs[0].aux.shape[-1] == 3 * target.config.hidden_size


def test_a_restarted_node_names_its_requests_anew() -> None:
    """Trainers take a request id they trained before for a redelivery: a node started again (or a
    second node) must not reuse the ids of the first, or its records would be skipped."""
    target = tiny_target(seed=7)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first, again = (Engine(target, None, EngineConfig(max_batch=2, max_model_len=32)) for _ in range(2))
    ids = [{s.request_id for s in e.generate([[1, 2, 3], [4, 5, 6]], params)} for e in (first, again)]
    assert len(ids[0]) == len(ids[1]) == 2 and not ids[0] & ids[1]


def test_continuous_batching_and_hot_swap_leave_outputs_unchanged() -> None:
    target = tiny_target(seed=9, scale=2.0)
    d1, d2 = tiny_draft(target, seed=10), tiny_draft(target, seed=12)
    prompts = [[i, i + 1, i + 2] for i in range(10)]
    ref = _reference_greedy(target, prompts, 16)
    engine = Engine(target, d1, EngineConfig(max_batch=4, max_model_len=64, gamma=3))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    seqs = [engine.add(p, params) for p in prompts[:3]]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 2:  # requests join while others run
            seqs += [engine.add(p, params) for p in prompts[3:]]
        if steps == 4:  # and a new draft arrives mid-flight
            engine.set_draft(d2)
    assert engine.draft is d2
    assert [s.output for s in seqs] == ref


def test_workload_drafts_in_one_batch_leave_outputs_unchanged() -> None:
    """Three workloads in one batch: two with their own drafts, one on the default draft; drafts
    swapped and removed mid-flight. Greedy outputs equal the plain decode; each draft counts its own."""
    target = tiny_target(seed=9, scale=2.0)
    good = trained_tiny_draft(target, seed=10, vocab=128)
    d_default, d_b = tiny_draft(target, seed=11), tiny_draft(target, seed=12)
    prompts = [[i, i + 1, i + 2] for i in range(12)]
    ref = _reference_greedy(target, prompts, 16)
    engine = Engine(target, d_default, EngineConfig(max_batch=6, max_model_len=64, gamma=3))
    engine.set_draft(good, "a")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    workloads = ["a", "b", "c"]
    seqs = [engine.add(p, params, workload=workloads[i % 3]) for i, p in enumerate(prompts)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            engine.set_draft(d_b, "b")
        if steps == 6:
            engine.set_draft(None, "a")  # "a" falls back to the default draft
    assert [s.output for s in seqs] == ref
    assert engine.draft_versions().keys() == {"default", "b"}
    assert engine.drafts["b"].stats.steps > 0 and engine.drafts["default"].stats.steps > 0
    total = sum(slot.stats.steps for slot in engine.drafts.values())
    assert total < engine.stats.steps  # "a"'s steps on its own draft left with it
    # sampling with two drafts in one batch: each row's q comes from its own draft
    engine.set_draft(good, "a")
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, ignore_eos=True)
    seqs = [engine.add(p, sampled, workload=workloads[i % 2]) for i, p in enumerate(prompts[:6])]
    while engine.has_work:
        engine.step()
    assert all(len(s.output) == 16 for s in seqs)
    assert engine.drafts["a"].stats.steps > 0


def test_seeded_sampling_is_reproducible() -> None:
    target = tiny_target(seed=13)
    draft = tiny_draft(target, seed=14)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = Engine(target, draft, EngineConfig(max_batch=4, max_model_len=64, gamma=3))
        seqs = engine.generate(
            [[3, 4, 5], [6, 7]], [params, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)]
        )
        runs.append(seqs[0].output)
    assert runs[0] == runs[1]
