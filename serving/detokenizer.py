"""Incremental detokenization: the text of a growing token list, released in whole characters only.

A multi-byte character (é, ß, 中, 🙂) can span several byte-level tokens; decoding a prefix that
ends inside it yields U+FFFD. Text is released only once the window decodes without a trailing
U+FFFD, so a stream never carries a broken character. Decoding a short window that starts a few
tokens back (vLLM's prefix/read offsets) keeps the work per token constant, and starting inside the
prompt keeps tokenizers that treat a leading space specially (SentencePiece) consistent.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: Decoder, prompt: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt[-_PROMPT_CONTEXT:])
        self.prefix = 0  # window start: its text was already released
        self.read = len(self.ids)  # tokens up to here are released
        self.text = ""  # released text

    def push(self, token: int) -> str:
        """Add one token; return the text it completes ('' while a character is still incomplete)."""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: release what is left, even an incomplete character."""
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        delta = after[len(before) :] if len(after) > len(before) else ""
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
