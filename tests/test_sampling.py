"""The acceptance/residual rule, exactly; sampling helpers."""

from __future__ import annotations

import torch

from tide.serving.sampling import (
    BatchSampling,
    SamplingParams,
    probs_from_logits,
    residual,
    sample,
    top_k_top_p,
    verify,
)


def _random_dist(v: int, g: torch.Generator, peak: float = 3.0) -> torch.Tensor:
    return (torch.randn(v, generator=g, dtype=torch.float64) * peak).softmax(-1)


def test_accept_then_residual_reproduces_p_exactly() -> None:
    """P(out = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y q(y) min(1, p(y)/q(y))) r(x) = p(x), for given p and q.

    The acceptance probability is read off `verify` itself by sweeping its uniform over a fine grid.
    """
    g = torch.Generator().manual_seed(0)
    v = 7
    for trial in range(20):
        p = _random_dist(v, g)
        q = _random_dist(v, g) if trial % 4 else p.clone()  # p == q: everything accepted
        grid = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
        accept = torch.zeros(v, dtype=torch.float64)
        for x in range(v):
            d = torch.full((len(grid), 1), x)
            out = verify(
                p.expand(len(grid), 2, v).clone(),
                q.expand(len(grid), 1, v).clone(),
                d,
                grid.unsqueeze(1),
                grid,
            )
            accept[x] = (out.accepted == 1).double().mean()
        expected_accept = torch.minimum(torch.ones(v, dtype=torch.float64), p / q)
        assert torch.allclose(accept, expected_accept, atol=1 / 4000 + 1e-12)
        r = residual(p.unsqueeze(0), q.unsqueeze(0))[0]
        total = q * expected_accept + (1 - (q * expected_accept).sum()) * r
        assert torch.allclose(total, p, atol=1e-12), (total - p).abs().max()


def test_rejected_token_comes_from_the_residual() -> None:
    g = torch.Generator().manual_seed(1)
    p, q = _random_dist(5, g), _random_dist(5, g)
    r = residual(p.unsqueeze(0), q.unsqueeze(0))[0]
    # force a rejection (u just below 1 rejects whenever p(d) < q(d)), sweep the final uniform
    d = int(torch.argmax(q / p))
    grid = (torch.arange(20000, dtype=torch.float64) + 0.5) / 20000
    out = verify(
        p.expand(len(grid), 2, 5).clone(),
        q.expand(len(grid), 1, 5).clone(),
        torch.full((len(grid), 1), d),
        torch.full((len(grid), 1), 0.999999),
        grid,
    )
    assert (out.accepted == 0).all()
    freq = torch.bincount(out.tokens[:, 0], minlength=5).double() / len(grid)
    assert torch.allclose(freq, r, atol=1e-4)
    assert freq[d] == 0


def test_bonus_token_after_all_accepted() -> None:
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    out = verify(p, q, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]), torch.tensor([0.3]))
    assert out.accepted.tolist() == [2]
    assert out.tokens.tolist() == [[1, 2, 0]]


def test_greedy_rows_are_one_hot_and_sample_exactly() -> None:
    logits = torch.randn(3, 2, 50)
    s = BatchSampling.of([SamplingParams(), SamplingParams(temperature=0.7), SamplingParams()])
    probs = probs_from_logits(logits, s)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 50).float())
    assert torch.allclose(probs[1].sum(-1), torch.ones(2))
    for u in (0.0, 0.3, 0.999999):
        assert torch.equal(sample(probs[0], torch.full((2,), u)), logits[0].argmax(-1))


def test_top_k_top_p() -> None:
    p = torch.tensor([[[0.5, 0.2, 0.15, 0.1, 0.05]]])
    k2 = top_k_top_p(p, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.allclose(k2, torch.tensor([[[0.5, 0.2, 0, 0, 0]]]) / 0.7)
    p08 = top_k_top_p(p, torch.tensor([0]), torch.tensor([0.8]))
    assert torch.allclose(p08, torch.tensor([[[0.5, 0.2, 0.15, 0, 0]]]) / 0.85)


def test_bad_sampling_params_are_refused() -> None:
    import pytest

    for bad in (
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(top_k=-2),
        SamplingParams(max_tokens=0),
    ):
        with pytest.raises(ValueError):
            bad.validate()
