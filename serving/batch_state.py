"""The running batch: one row (slot) per running sequence in one static KV cache.

Running sequences occupy the slots [0, B) in order, so every forward reads one contiguous slice;
a finishing sequence's slot is refilled by moving the last one into it (`compact`). Per slot the
state holds the token ids (one past the committed length: the next input), the aux states of every
committed position (the draft's input, kept so a new draft can rebuild its cache), the committed
length, and how far the draft's cache has caught up. Rejected draft tokens are rolled back by
moving the length back: cache entries past it are never attended to and are overwritten next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tide.models.eagle3 import DraftKV
from tide.models.llama import LlamaModel
from tide.serving.sequence import Sequence


class BatchState:
    def __init__(self, model: LlamaModel, max_batch: int, max_model_len: int, max_gamma: int):
        # room past the longest sequence for gamma+1 verified tokens and one scratch position
        self.capacity = max_model_len + max_gamma + 2
        self.scratch = self.capacity - 1
        self.max_batch = max_batch
        d = model.cfg.hidden_size
        self.cache = model.new_cache(max_batch, self.capacity)
        self.tokens = torch.zeros(max_batch, self.capacity + 1, dtype=torch.long)
        self.aux = torch.zeros(max_batch, self.capacity, 3 * d, dtype=model.dtype)
        self.lengths = torch.zeros(max_batch, dtype=torch.long)  # tokens in the target's cache
        self.draft_lengths = torch.zeros(max_batch, dtype=torch.long)  # positions in the draft's cache
        self.running: list[Sequence] = []

    @property
    def full(self) -> bool:
        return len(self.running) >= self.max_batch

    def admit(self, seq: Sequence) -> int:
        """The next free slot, now the sequence's."""
        seq.slot = len(self.running)
        self.running.append(seq)
        return seq.slot

    def commit_prompt(self, slot: int, prompt: torch.Tensor, aux: torch.Tensor, first: int) -> None:
        n = len(prompt)
        self.tokens[slot, :n] = prompt
        self.tokens[slot, n] = first
        self.aux[slot, :n] = aux
        self.lengths[slot] = n
        self.draft_lengths[slot] = 0

    def compact(
        self, released: Callable[[Sequence], None], draft_cache: Callable[[Sequence], DraftKV | None]
    ) -> None:
        """Free the slots of finished sequences (`released` is told of each first), keeping the
        running ones contiguous. `draft_cache`: the cache of the draft serving a sequence, if any."""
        for slot in sorted((s.slot for s in self.running if s.finished), reverse=True):
            released(self.running[slot])
            last = len(self.running) - 1
            if slot != last:
                self._move(last, slot, draft_cache(self.running[last]))
                self.running[slot] = self.running[last]
                self.running[slot].slot = slot
            self.running.pop()

    def _move(self, src: int, dst: int, draft_cache: DraftKV | None) -> None:
        n = int(self.lengths[src]) + 1
        self.cache.move_slot(src, dst, n)
        if draft_cache is not None:  # only the moving sequence's own draft holds anything of it
            m = int(self.draft_lengths[src])
            draft_cache.k[dst, :, :m] = draft_cache.k[src, :, :m]
            draft_cache.v[dst, :, :m] = draft_cache.v[src, :, :m]
        self.tokens[dst, : n + 1] = self.tokens[src, : n + 1]
        self.aux[dst, :n] = self.aux[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.draft_lengths[dst] = self.draft_lengths[src]
