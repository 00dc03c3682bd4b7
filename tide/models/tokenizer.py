"""The target's tokenizer and chat template, through `transformers` (GGUF vocabularies converted once, cached)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tide.config import cache_dir, file_cache_key


class Tokenizer:
    def __init__(self, hf: Any):
        self.hf = hf

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        if path.is_dir():
            return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        cached = cache_dir() / "tokenizers" / file_cache_key(path)
        if (cached / "tokenizer.json").exists():
            return cls(AutoTokenizer.from_pretrained(str(cached), local_files_only=True))
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        cached.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(cached))
        return cls(hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def vocab(self) -> dict[str, int]:
        return dict(self.hf.get_vocab())

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat template applied to messages, ending with the assistant's turn opener."""
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(i) for i in out]
