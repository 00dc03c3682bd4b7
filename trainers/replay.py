"""The replay buffer: earlier requests a trainer trains on again, so the draft does not forget.

It is most of what a trainer's memory grows by (a request's states are n × 4d values), so it keeps
them as the records carry them on the wire, in a record codec of `producers/records.py` (by default
the one nodes publish with), rebuilt for the steps that sample them. The error is that codec's plus
bf16 rounding: records sent in the same codec are coded again after their bf16 rounding, and lose
little more.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from tide.producers.records import CODECS, DEFAULT_CODEC, decode_tensor, encode_tensor
from tide.trainers.ttt import Example


@dataclass
class Kept:
    bare: Example  # tokens and positions; its states empty, (n, 0)
    states: dict[str, torch.Tensor]  # aux and hidden, encoded


class ReplayBuffer:
    def __init__(self, size: int, examples: Iterable[Example] = (), codec: str = DEFAULT_CODEC):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
        self.size, self.codec = size, codec
        self._kept: list[Kept] = []
        self.extend(examples)

    def __len__(self) -> int:
        return len(self._kept)

    def pack(self, e: Example) -> Kept:
        """An example as the buffer keeps it; `.bare` holds its tokens without the states."""
        empty = e.aux.new_empty(len(e.tokens), 0)
        states = {**encode_tensor("aux", e.aux, self.codec), **encode_tensor("hidden", e.hidden, self.codec)}
        return Kept(replace(e, aux=empty, hidden=empty), states)

    def extend(self, examples: Iterable[Example]) -> None:
        """Keep these as the newest; the oldest beyond `size` go."""
        self.add([self.pack(e) for e in examples])

    def add(self, kept: list[Kept]) -> None:
        self._kept = (self._kept + kept)[-self.size :]

    def bare(self) -> list[Example]:
        """Every example without its states, oldest first: what vocabulary selection reads (the same
        objects as `pack` returned)."""
        return [k.bare for k in self._kept]

    def sample(self, k: int, newest: int | None = None) -> list[Example]:
        """k at random (from the newest `newest`, if given), states rebuilt."""
        pool = self._kept[-newest:] if newest else self._kept
        return [self._unpack(x) for x in random.sample(pool, min(k, len(pool)))]

    def batch(self, n: int, recent: int) -> list[Example]:
        """n examples from the newest `recent` and n from all of them."""
        return self.sample(n, recent) + self.sample(n)

    def examples(self) -> list[Example]:
        """All of them, states rebuilt, oldest first (a checkpoint keeps them)."""
        return [self._unpack(k) for k in self._kept]

    def _unpack(self, k: Kept) -> Example:
        aux, hidden = (
            decode_tensor(k.states, "aux", self.codec),
            decode_tensor(k.states, "hidden", self.codec),
        )
        return replace(k.bare, aux=aux, hidden=hidden)
