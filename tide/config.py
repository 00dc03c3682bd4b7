"""Paths and settings every part shares."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where TIDE keeps what it builds once (converted tokenizers, the default draft): $TIDE_CACHE or ~/.cache/tide."""
    p = Path(os.environ.get("TIDE_CACHE", Path.home() / ".cache" / "tide"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def default_draft_dir(fingerprint: str, workload: str = "default") -> Path:
    return cache_dir() / "drafts" / fingerprint[:12] / workload


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}") from None
