"""The tap: what a serving engine hands the data path for every position it commits.

This is the seam between an engine and capture. An engine (this project's, or another one
plugged in) calls a `TapCallback` with `TapEvent`s; the publisher turns them into records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TapEvent:
    """Hidden states of committed positions whose next token the request kept.

    Positions [first_position, first_position + m): `aux` and `hidden` hold m states and `tokens` the
    m + 1 tokens at positions first_position ... first_position + m, so the state at position p comes
    with the token it predicted. Consecutive events of a request overlap by that one token, and
    together they carry exactly the prompt and the completion the client received.
    """

    request_id: str
    workload: str
    first_position: int
    tokens: torch.Tensor  # (m + 1,) token ids
    aux: torch.Tensor  # (m, 3d) residual stream before the aux layers
    hidden: torch.Tensor  # (m, d) final normed hidden state (predicts the next token)
    prefill: bool
    draft_version: str
    final: bool = False  # the request's last event
    held_out: bool = False  # the request's records only ever evaluate drafts


TapCallback = Callable[[TapEvent], None]
