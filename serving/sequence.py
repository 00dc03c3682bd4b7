"""A request as the engine runs it, and how a burst of new tokens ends it (EOS, length, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tide.serving.detokenizer import Detokenizer
from tide.serving.sampling import SamplingParams


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    workload: str = "default"
    capture: bool = True
    held_out: bool = False  # its captured states only ever evaluate drafts
    output: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    steps: int = 0  # target forward passes spent on this sequence after prefill
    detok: Detokenizer | None = None  # text is tracked for stop strings and for callers that ask
    text: str = ""  # released text of the output, cut before a stop string

    @property
    def holdback(self) -> int:
        """Trailing characters a stop string might still claim: not safe to stream yet."""
        return max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def streamable_text(self) -> str:
        if self.finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], eos: set[int]) -> list[int]:
        """Append a burst of tokens, cut exactly where a stop condition fires; returns those kept."""
        p = self.params
        kept: list[int] = []
        for t in tokens:
            if t in eos and not p.ignore_eos:
                self.finish_reason = "stop"
                break
            kept.append(t)
            self.output.append(t)
            if self.detok is not None:
                delta = self.detok.push(t)
                self.text = self.detok.text
                if p.stop and delta and self._hit_stop(len(delta)):
                    self.finish_reason = "stop"
                    return kept
            if len(self.output) >= p.max_tokens:
                self.finish_reason = "length"
                break
        if self.finished and self.detok is not None:
            self.detok.flush()
            self.text = self.detok.text
        return kept

    def _hit_stop(self, new_chars: int) -> bool:
        """Cut the text before the first stop string that ends in the newly released text."""
        start = max(0, len(self.text) - new_chars - self.holdback)
        hits = [i for i in (self.text.find(stop, start) for stop in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    accepted: int | None = None  # draft tokens the verify pass accepted (None: prefill)
