"""The replay buffer: earlier requests a trainer trains on again, so the draft does not forget.

It is most of what a trainer's memory grows by (a request's states are n × 4d values), so it keeps
them as the records carry them on the wire: int8 codes with one bf16 scale per 64 values (the
`int8-g64` codec of `producers/records.py`), about half their bf16 size, rebuilt for the steps that
sample them. The error is that codec's (half a step of each group's largest value) plus bf16
rounding: records sent int8-g64 are coded again after their bf16 rounding, and lose little more.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from tide.producers.records import decode_tensor, encode_tensor
from tide.trainers.ttt import Example

CODEC = "int8-g64"


@dataclass
class Kept:
    bare: Example  # tokens and positions; its states empty, (n, 0)
    states: dict[str, torch.Tensor]  # aux and hidden, encoded


class ReplayBuffer:
    def __init__(self, size: int, examples: Iterable[Example] = ()):
        self.size = size
        self._kept: list[Kept] = []
        self.extend(examples)

    def __len__(self) -> int:
        return len(self._kept)

    def extend(self, examples: Iterable[Example]) -> None:
        """Keep these as the newest; the oldest beyond `size` go."""
        self.add([pack(e) for e in examples])

    def add(self, kept: list[Kept]) -> None:
        self._kept = (self._kept + kept)[-self.size :]

    def bare(self) -> list[Example]:
        """Every example without its states, oldest first: what vocabulary selection reads (the same
        objects as `pack` returned)."""
        return [k.bare for k in self._kept]

    def sample(self, k: int, newest: int | None = None) -> list[Example]:
        """k at random (from the newest `newest`, if given), states rebuilt."""
        pool = self._kept[-newest:] if newest else self._kept
        return [_unpack(x) for x in random.sample(pool, min(k, len(pool)))]

    def batch(self, n: int, recent: int) -> list[Example]:
        """n examples from the newest `recent` and n from all of them."""
        return self.sample(n, recent) + self.sample(n)

    def examples(self) -> list[Example]:
        """All of them, states rebuilt, oldest first (a checkpoint keeps them)."""
        return [_unpack(k) for k in self._kept]


def pack(e: Example) -> Kept:
    """An example as the buffer keeps it; `.bare` holds its tokens without the states."""
    empty = e.aux.new_empty(len(e.tokens), 0)
    states = {**encode_tensor("aux", e.aux, CODEC), **encode_tensor("hidden", e.hidden, CODEC)}
    return Kept(replace(e, aux=empty, hidden=empty), states)


def _unpack(k: Kept) -> Example:
    return replace(
        k.bare, aux=decode_tensor(k.states, "aux", CODEC), hidden=decode_tensor(k.states, "hidden", CODEC)
    )
