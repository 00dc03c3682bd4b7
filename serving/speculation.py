"""Propose and verify: chain drafting over the running rows, one chain per draft, and the accept
rule that keeps the target's distribution exact (greedy: the longest prefix equal to the target's
argmax; sampled: `sampling.verify`, the speculative-sampling rule)."""

from __future__ import annotations

import torch

from tide.models.llama import Batch
from tide.serving.batch_state import BatchState
from tide.serving.drafts import DraftSet, DraftSlot
from tide.serving.sampling import BatchSampling, SamplingParams, Verdict, probs_from_logits, sample, verify
from tide.serving.suffix import SuffixProposal

Proposal = tuple[torch.Tensor, torch.Tensor | None]  # (B, n) target ids; q (B, n, V) when sampling


class Speculator:
    def __init__(self, state: BatchState, drafts: DraftSet, vocab_size: int):
        self.state, self.drafts, self.vocab_size = state, drafts, vocab_size

    def catch_up(self, slot: int, key: str) -> None:
        """Bring one sequence's draft cache up to its last committed position but one (a draft that
        raises leaves it where it was: the next proposal catches up from there)."""
        st, ds = self.state, self.drafts[key]
        start, end = int(st.draft_lengths[slot]), int(st.lengths[slot]) - 1
        if end <= start:
            return
        pos = torch.arange(start, end).unsqueeze(0)
        batch = Batch.make(slot, pos, None, st.capacity)
        try:
            hidden = ds.draft.fc(st.aux[slot, start:end].unsqueeze(0))
            ds.draft(hidden, st.tokens[slot, start + 1 : end + 1].unsqueeze(0), batch, ds.cache)
        except Exception as e:
            self.drafts.failed(key, e)
            return
        st.draft_lengths[slot] = end

    def propose(
        self,
        groups: dict[str, list[int]],
        lo: int,
        bsz: int,
        gamma: int,
        params: list[SamplingParams],
        u: torch.Tensor | None,
        stop_below: float = 0.0,
    ) -> Proposal | None:
        """Chain-draft up to gamma tokens per sequence of the slots [lo, lo + bsz), one chain per
        draft. With one draft, the chain stops early where the draft's own confidence in it falls
        below `stop_below` in every row. None: a draft raised, and the step goes without speculation."""
        key = ""
        try:
            if len(groups) == 1:  # the common case: contiguous slots, no gathers
                (key,) = groups
                slots = None if lo == 0 else torch.arange(lo, lo + bsz)
                out = self._chain(self.drafts[key], slots, bsz, gamma, params, u, stop_below)
                self.drafts.proposed(key)
                return out
            tokens = torch.empty(bsz, gamma, dtype=torch.long)
            q = None if u is None else torch.zeros(bsz, gamma, self.vocab_size)
            for key, idx in groups.items():
                rows = torch.tensor(idx)
                sub_u = None if u is None else u[rows]
                t, sub_q = self._chain(
                    self.drafts[key], rows + lo, len(idx), gamma, [params[i] for i in idx], sub_u
                )
                tokens[rows] = t
                if q is not None and sub_q is not None:
                    q[rows] = sub_q
                self.drafts.proposed(key)
            return tokens, q
        except Exception as e:
            self.drafts.failed(key, e)
            return None

    def _chain(
        self,
        ds: DraftSlot,
        slots: torch.Tensor | None,
        bsz: int,
        gamma: int,
        params: list[SamplingParams],
        u: torch.Tensor | None,
        stop_below: float = 0.0,
    ) -> Proposal:
        """One draft's chain over the running rows `slots` (None: rows [0, bsz)). Past its first
        token the chain ends where, in every row, the draft's own probability of the chain so far
        falls below `stop_below` (EAGLE-2's confidence): such a tail is rarely accepted, and each
        token of it widens the verify."""
        st, draft = self.state, ds.draft
        rows = torch.arange(bsz) if slots is None else slots
        lengths, dlen = st.lengths[rows], st.draft_lengths[rows]
        # catch up: step-0 inputs for the positions the target committed since the last step
        span = int((lengths - dlen).max())
        pos = dlen.unsqueeze(1) + torch.arange(span)
        valid = pos < lengths.unsqueeze(1)
        # padding rows sit at the sequence's last position (keeps the attended span short) and write to scratch
        pos = torch.where(valid, pos, (lengths - 1).unsqueeze(1))
        hidden = draft.fc(st.aux[rows.unsqueeze(1), pos])
        batch = Batch.make(0, pos, valid, st.capacity, slots)
        pick = lengths - 1 - dlen  # each row's last committed position: the next token's context
        out, logits = draft.step(hidden, st.tokens[rows.unsqueeze(1), pos + 1], batch, ds.cache, pick)
        last = out[torch.arange(bsz), pick].unsqueeze(1)
        st.draft_lengths[rows] = lengths
        tokens = torch.empty(bsz, gamma, dtype=torch.long)
        qs: list[torch.Tensor] = []
        s = BatchSampling.of(params) if u is not None else None
        sure = torch.ones(bsz)  # the draft's probability of its chain so far, per row
        first = torch.zeros(bsz, dtype=torch.long)
        for i in range(gamma):  # logits (B, Vd): the draft's next token, from `last`
            if u is None or s is None:
                d = logits.argmax(-1)
                if stop_below:
                    sure = sure * logits.softmax(-1).amax(-1)
                    if i and bool((sure < stop_below).all()):
                        return self._checked(tokens[:, :i]), None
            else:
                q = probs_from_logits(
                    logits.unsqueeze(1), BatchSampling(s.temperature, s.top_p, s.top_k, False)
                )[:, 0]
                d = sample(q, u[:, i])
                if stop_below:
                    sure = sure * q.gather(1, d.unsqueeze(1))[:, 0]
                    if i and bool((sure < stop_below).all()):
                        return self._checked(tokens[:, :i]), torch.stack(qs, 1)
                full = torch.zeros(bsz, self.vocab_size)
                qs.append(full.index_copy_(1, ds.ids, q))
            drafted = ds.ids[d].unsqueeze(1)  # (B, 1)
            tokens[:, i] = drafted[:, 0]
            if i + 1 < gamma:
                p = (lengths + i).unsqueeze(1)
                batch = Batch.make(0, p, None, st.capacity, slots)
                last, logits = draft.step(last, drafted, batch, ds.cache, first)
        return self._checked(tokens), (torch.stack(qs, 1) if qs else None)

    def _checked(self, tokens: torch.Tensor) -> torch.Tensor:
        """A draft's tokens must be the target's (a bad vocabulary map would fail the verify pass)."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError("the draft proposed token ids outside the target's vocabulary")
        return tokens


def with_suffix(
    proposal: Proposal, picks: list[SuffixProposal | None], vocab_size: int, sampling: bool
) -> Proposal:
    """The rows in `picks` draft from the suffix index instead; every row is padded to the widest.
    An index proposes deterministically, so its q is one-hot: speculative sampling stays exact, and
    a padding token is only a proposal that is rarely accepted (greedy: only if it is the target's)."""
    drafted, q = proposal
    width = max([drafted.shape[1]] + [len(p.tokens) for p in picks if p is not None])
    tokens = torch.zeros(len(picks), width, dtype=torch.long)
    tokens[:, : drafted.shape[1]] = drafted
    for i, p in enumerate(picks):
        if p is not None:
            tokens[i] = 0
            tokens[i, : len(p.tokens)] = torch.tensor(p.tokens)
    if not sampling:
        return tokens, None
    full = torch.zeros(len(picks), width, vocab_size)
    full.scatter_(2, tokens.unsqueeze(2), 1.0)
    if q is not None:
        drafting = torch.tensor([p is None for p in picks])
        full[drafting, : q.shape[1]] = q[drafting]
    return tokens, full


def accept(
    logits: torch.Tensor,
    drafted: torch.Tensor,
    q: torch.Tensor | None,
    s: BatchSampling,
    u: torch.Tensor | None,
    gamma: int,
) -> Verdict:
    """Accepted drafts per row and the tokens to commit (accepted drafts, then a correction or bonus)."""
    if u is None:  # all greedy: accept while the draft equals the target's argmax
        best = logits.argmax(-1)
        accepted = (drafted == best[:, :gamma]).long().cumprod(-1).sum(-1)
        tokens = torch.cat([drafted, best[:, -1:]], 1)
        tokens[torch.arange(len(tokens)), accepted] = best.gather(1, accepted.unsqueeze(1)).squeeze(1)
        return Verdict(accepted, tokens)
    p = probs_from_logits(logits, s)
    if q is None:
        q = torch.zeros_like(p[:, :gamma])
    return verify(p, q, drafted, u[:, gamma : 2 * gamma], u[:, 2 * gamma])
