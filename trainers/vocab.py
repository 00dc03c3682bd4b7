"""The draft vocabulary follows the workload's tokens. It is fitted once the first
`warmup` positions are read (unless the start draft's covers them), refitted to the newest traffic
when that moves off it, and grown to everything read since the move while that covers the newest
positions better. Each refit starts a new optimiser (`on_refit`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import TargetHead
from tide.trainers.examples import completion_positions, keep_recent
from tide.trainers.ttt import Example, select_vocab

log = logging.getLogger("tide.trainers")


def coverage(examples: list[Example], covered: torch.Tensor) -> float:
    """The share of these completion tokens that `covered` (a bool per target id: the draft
    vocabulary) can say; 1.0 for none."""
    tokens = torch.cat([ex.tokens[ex.learn_from :] for ex in examples] or [torch.zeros(0, dtype=torch.long)])
    return float(covered[tokens].float().mean()) if len(tokens) else 1.0


def newest_uncovered(
    examples: list[Example], covered: torch.Tensor, below: float, min_positions: int
) -> list[Example]:
    """The newest examples whose completions `covered` (a bool per target id) says less than `below`
    of, back to the first one it covers: the traffic that moved the vocabulary off. The window the
    trainer watches is only partly new when its coverage drops, and a vocabulary fitted to all of
    it is half the old workload's (on the shift benchmark a second refit was needed 6 minutes
    later). Too few such positions to fit to: all of `examples`."""
    i = len(examples)
    while i > 0:
        ex = examples[i - 1 : i]
        if completion_positions(ex) and coverage(ex, covered) >= below:
            break
        i -= 1
    return examples[i:] if completion_positions(examples[i:]) >= min_positions else examples


def refit_vocab(draft: Eagle3Draft, ids: torch.Tensor, lm_head: torch.Tensor) -> None:
    """New draft vocabulary: rows the draft already had are kept, new rows start from the target's head."""
    old = {int(t): i for i, t in enumerate(draft.target_ids().tolist())}
    with torch.no_grad():
        fresh = lm_head[ids].to(draft.lm_head.weight.dtype).clone()
        for row, t in enumerate(ids.tolist()):
            if t in old:
                fresh[row] = draft.lm_head.weight[old[t]]
        draft.lm_head.weight.copy_(fresh)
    draft.set_vocab(ids)


def grown_vocab(
    earlier: list[Example], newest: list[Example], covered: torch.Tensor, fitted: int, vocab_size: int,
    fill: list[Example] | None, gain: float,
) -> torch.Tensor | None:  # fmt: skip
    """A draft vocabulary fitted to `earlier + newest` (one traffic, oldest first) if one fitted to
    `earlier` alone covers `newest` at least `gain` better than `covered` (the draft's, a bool per
    target id, fitted to `fitted` completion positions of this traffic) does: judged on positions
    the trial fit never saw. Else None; also until the traffic read has doubled since that fit, as
    coverage grows with the log of what a fit saw (on the shift benchmark's French about 2 points a
    doubling) and judging every window refitted (and reset the optimiser) every two minutes."""
    if not completion_positions(earlier) or not completion_positions(newest):
        return None
    if completion_positions(earlier + newest) < 2 * fitted:
        return None
    size, keep = int(covered.sum()), covered.nonzero().flatten()
    trial = torch.zeros_like(covered)
    trial[select_vocab(earlier, size, vocab_size, fill, keep)] = True
    if coverage(newest, trial) < coverage(newest, covered) + gain:
        return None
    return select_vocab(earlier + newest, size, vocab_size, fill, keep)


class VocabFollower:
    def __init__(
        self, head: TargetHead, warmup: int, refit_coverage: float, grow_gain: float, fitted: bool,
        on_refit: Callable[[], None],
    ):  # fmt: skip
        self.head, self.on_refit = head, on_refit
        self.warmup, self.refit_coverage, self.grow_gain = warmup, refit_coverage, grow_gain
        self.fitted = fitted  # the first fit is done (or a checkpoint's vocabulary is kept)
        self.waiting: list[Example] = []  # read before the first fit
        self.recent: list[Example] = []  # the last fresh examples, bare: the vocabulary's coverage
        self.refits = 0
        self.since_refit = 0  # positions read since the vocabulary was last refitted or judged
        # the traffic the vocabulary follows was captured since; None: the vocabulary is the start
        # draft's, fitted offline to all of its training data, which growing would only churn
        self.moved_at: float | None = None
        self.fitted_positions = 0  # completion positions of that traffic the vocabulary was fitted to

    def admit(self, fresh: list[Example], draft: Eagle3Draft, force: bool = False) -> list[Example]:
        """The examples ready to train on: none until the first fit has `warmup` positions (or `force`)."""
        if self.fitted:
            return fresh
        self.waiting += fresh
        warm = sum(len(e.aux) for e in self.waiting) >= self.warmup
        if not self.waiting or not (warm or force):
            return []
        if coverage(self.waiting, draft.t2d) < self.refit_coverage:
            self._refit(draft, self.waiting)
            self.moved_at = min(e.created_at for e in self.waiting)
        self.fitted = True
        ready, self.waiting = self.waiting, []
        return ready

    def follow(self, bare: list[Example], draft: Eagle3Draft, replay: list[Example]) -> None:
        """Newly trained examples (bare: tokens alone) against the vocabulary; `replay`: the replay
        buffer's, bare, that a refit fills up from."""
        self.recent = keep_recent(self.recent + bare, self.warmup)
        self.since_refit += sum(len(ex.tokens) for ex in bare)
        if self._stale(draft):
            moved = newest_uncovered(self.recent, draft.t2d, self.refit_coverage, self.warmup // 4)
            self._refit(draft, moved, replay)
            self.moved_at = min(e.created_at for e in moved)
        elif self.since_refit >= self.warmup:
            self._grow(draft, replay)

    def _stale(self, draft: Eagle3Draft) -> bool:
        """Has the traffic moved off the draft vocabulary (a shift the trainer sees in the tokens)?"""
        if completion_positions(self.recent) < self.warmup // 2 or self.since_refit < self.warmup:
            return False
        return coverage(self.recent, draft.t2d) < self.refit_coverage

    def _grow(self, draft: Eagle3Draft, replay: list[Example]) -> None:
        """Refit to everything read since the traffic moved (the newest window included) if that
        covers the newest window better (`grown_vocab`); judged again `warmup` positions later.
        Never while the vocabulary is the start draft's (nor after a resume: when the traffic moved
        is not checkpointed)."""
        self.since_refit = 0
        if self.moved_at is None:
            return
        newest = {id(e) for e in self.recent}
        earlier = [e for e in replay if e.created_at >= self.moved_at and id(e) not in newest]
        ids = grown_vocab(earlier, self.recent, draft.t2d, self.fitted_positions,
                          self.head.config.vocab_size, replay, self.grow_gain)  # fmt: skip
        if ids is not None:
            self._refit(draft, earlier + self.recent, replay, ids)

    def _refit(
        self, draft: Eagle3Draft, examples: list[Example], fill: list[Example] | None = None,
        ids: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        if ids is None:
            size, vocab = draft.cfg.draft_vocab_size, self.head.config.vocab_size
            ids = select_vocab(examples, size, vocab, fill, draft.target_ids())
        refit_vocab(draft, ids, self.head.lm_head)
        self.fitted_positions = completion_positions(examples)
        self.refits += 1
        self.since_refit = 0
        self.on_refit()
        log.info("draft vocabulary refitted to the last %d examples (refit %d)", len(examples), self.refits)
