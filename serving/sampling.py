"""Sampling and the speculative acceptance rule, as batched tensor operations.

Greedy rows are treated as sampling from a one-hot distribution, so one code path serves greedy
and sampled requests in the same batch: with one-hot p the acceptance rule accepts exactly the
draft tokens equal to the argmax, and the residual is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT64_MAX = 2**63 - 1
# torch.Generator.manual_seed takes any int64 or uint64
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """ValueError for settings a batch cannot sample with (NaN fails every comparison)."""
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be in [0, {INT64_MAX}], got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")


@dataclass
class BatchSampling:
    """Per-row sampling settings of a batch, as tensors."""

    temperature: torch.Tensor  # (B,) float, 0 for greedy rows
    top_p: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,) long, 0 = off
    filtered: bool  # any row with top-k/top-p

    @classmethod
    def of(cls, params: list[SamplingParams]) -> BatchSampling:
        return cls(
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


def probs_from_logits(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits (B, T, V) -> probabilities (B, T, V): temperature, top-k, top-p; one-hot for greedy rows."""
    greedy = (s.temperature == 0).view(-1, 1, 1)
    onehot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if bool(greedy.all()):
        return onehot
    temp = torch.where(s.temperature > 0, s.temperature, 1.0).view(-1, 1, 1)
    probs = (logits / temp).softmax(-1)
    if s.filtered:
        probs = top_k_top_p(probs, s.top_k, s.top_p)
    return torch.where(greedy, onehot, probs)


def top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1]).view(1, 1, -1)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).view(-1, 1, 1)
    # keep a token while the mass before it is below top_p (the first token is always kept)
    before = sorted_p.cumsum(-1) - sorted_p
    keep = (rank < k) & (before < top_p.view(-1, 1, 1))
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (..., V), u (...) uniform in [0, 1) -> indices (...).

    With one-hot probs this returns the argmax for every u, which keeps greedy rows exact.
    """
    cdf = probs.cumsum(-1)
    x = (u * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); where p == q (nothing left) fall back to p."""
    r = (p - q).clamp_(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


@dataclass
class Verdict:
    accepted: torch.Tensor  # (B,) number of draft tokens accepted, 0..gamma
    tokens: torch.Tensor  # (B, gamma + 1): accepted drafts then the correction/bonus token at [accepted]


def verify(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor, u_final: torch.Tensor
) -> Verdict:
    """Speculative sampling (Leviathan et al.; Chen et al.) for a batch.

    p (B, g+1, V): target probabilities at each verified position; q (B, g, V): the draft
    distributions the draft tokens (B, g) were sampled from; u_accept (B, g), u_final (B,) uniforms.
    Draft token i is accepted with probability min(1, p/q); at the first rejection the output is
    sampled from norm(max(0, p - q)); if all are accepted, the bonus token comes from p[g].
    """
    gamma = draft.shape[1]
    p_d = p[:, :gamma].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    ok = u_accept * q_d < p_d
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(p.shape[0])
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], 1)  # q at the bonus position is 0: residual = p
    final_dist = residual(p[rows, accepted], q_pad[rows, accepted])
    final = sample(final_dist, u_final)
    tokens = torch.cat([draft, torch.zeros(draft.shape[0], 1, dtype=draft.dtype)], 1)
    tokens[rows, accepted] = final
    return Verdict(accepted, tokens)
