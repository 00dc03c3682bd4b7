"""Records as training examples, and the windows kept over them: the newest positions, the held-out
window drafts are judged on, and how much of it is new since a moment."""

from __future__ import annotations

import torch

from tide.producers.records import HeldOutWindow, HiddenStateRecord
from tide.trainers.ttt import Example


def example_of(r: HiddenStateRecord, lm_head: torch.Tensor | None) -> Example | None:
    """A record as an example (lm_head: for evaluation); positions predicting prompt tokens are not learned."""
    m = r.num_positions
    if m < 2:
        return None
    k = int(r.prefill.sum())
    learn_from = k - 1 if k < m else m  # the last prompt position predicts the first completion token
    return Example.make(r.tokens[:m], r.aux, r.hidden, lm_head, max(0, learn_from), r.created_at)


def completion_positions(examples: list[Example]) -> int:
    """Positions an evaluation counts: those predicting completion tokens."""
    return sum(max(0, len(e.tokens) - e.learn_from) for e in examples)


def keep_recent(
    examples: list[Example], positions: int, newer_than: float | None = None, floor: int = 0
) -> list[Example]:
    """The newest examples holding at most `positions` learnable (completion) positions, the ones an
    evaluation counts (always the newest example). With `newer_than`, examples captured before it are
    dropped too, unless the newer ones hold fewer than `floor` positions: then the newest older ones
    fill up to `floor` (a quiet workload keeps something to measure on)."""
    total, i = 0, len(examples)
    while i > 0:
        ex = examples[i - 1]
        n = len(ex.tokens) - ex.learn_from
        if i < len(examples) and (
            total + n > positions
            or (newer_than is not None and ex.created_at < newer_than and total >= floor)
        ):
            break
        total += n
        i -= 1
    return examples[i:]


def in_window(examples: list[Example], window: HeldOutWindow, now: float) -> list[Example]:
    """The held-out examples drafts are judged on at `now` (`HeldOutWindow`)."""
    return keep_recent(examples, window.max_positions, now - window.seconds, window.min_positions)


def turned_over(held_out: list[Example], since: float, share: float) -> bool:
    """Were at least `share` of these examples' completion positions captured after `since`?"""
    newer = completion_positions([e for e in held_out if e.created_at > since])
    return newer > 0 and newer >= share * completion_positions(held_out)
