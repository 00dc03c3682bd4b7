"""Prompt files: JSONL with one `{"messages": [...]}` or `{"prompt": "..."}` per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tide.models.tokenizer import Tokenizer

# the prompt files shipped with the project (`workloads/`), which the CLI and benchmarks default to
WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"


class PromptFileError(ValueError):
    pass


@dataclass
class Prompt:
    messages: list[dict[str, str]] | None = None
    text: str | None = None

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        if self.messages is not None:
            return tokenizer.chat_prompt(self.messages)
        return tokenizer.encode(self.text or "")


def load_prompts(path: str | Path) -> list[Prompt]:
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{n}: not JSON: {e}") from e
            if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                msgs = obj["messages"]
                if not all(
                    isinstance(m, dict)
                    and isinstance(m.get("content"), str)
                    and isinstance(m.get("role"), str)
                    for m in msgs
                ):
                    raise PromptFileError(f"{path}:{n}: each message needs string 'role' and 'content'")
                out.append(Prompt(messages=[{"role": m["role"], "content": m["content"]} for m in msgs]))
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                out.append(Prompt(text=obj["prompt"]))
            else:
                raise PromptFileError(f'{path}:{n}: expected {{"messages": [...]}} or {{"prompt": "..."}}')
    if not out:
        raise PromptFileError(f"{path}: no prompts")
    return out


def split(prompts: list[Prompt], part: str) -> list[Prompt]:
    """The shipped workloads' convention: the first 80% for training, the last 20% held out."""
    cut = int(len(prompts) * 0.8)
    if part == "train":
        return prompts[:cut]
    if part == "test":
        return prompts[cut:]
    if part == "all":
        return prompts
    raise ValueError(f"part must be train, test or all, not {part!r}")
