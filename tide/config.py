"""Paths and settings every part shares."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where TIDE keeps what it builds once (converted tokenizers and GGUF targets, the default draft): $TIDE_CACHE or ~/.cache/tide."""
    p = Path(os.environ.get("TIDE_CACHE", Path.home() / ".cache" / "tide"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def file_cache_key(path: Path) -> str:
    """A cache key for what is derived from one file: its resolved path, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def default_draft_dir(fingerprint: str, workload: str = "default") -> Path:
    return cache_dir() / "drafts" / fingerprint[:12] / workload


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
DTYPE_HELP = "the target's: bfloat16, float32, or auto (bfloat16 where the CPU runs it natively)"


def native_dtype() -> torch.dtype:
    """The dtype a target serves in unless told: bf16 where oneDNN runs it natively, fp32 elsewhere.
    On an AVX2-only CPU bf16 is emulated: verifying 4 tokens took 2.6x one, against 1.2x in packed
    fp32, so speculation could not pay there in bf16."""
    from tide.models.packing import packing_available

    return torch.bfloat16 if packing_available(torch.bfloat16) else torch.float32


def parse_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return native_dtype()
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use auto or one of {sorted(DTYPES)}") from None


MMAP_THRESHOLD = 1 << 20


def give_freed_tensors_back() -> None:
    """Allocations of 1 MiB and more are mapped and unmapped on their own (glibc's M_MMAP_THRESHOLD,
    fixed). By default glibc raises that threshold to 32 MiB after the first such free; tensors under
    it then come from the heap, and long-lived ones (a trainer's examples) pin the holes that
    short-lived ones leave: over 50 steps a training loop's RSS grew 1.6 GB for 60 MB more live
    tensors, 0.7 GB with the threshold fixed (`scripts/training_rss.py DRAFT --shape-step 1
    [--mmap-threshold]`). Not glibc (musl, macOS): nothing to do."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt(-3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD


# oneDNN keeps the kernels it builds for each shape (1,024 by default), each with its own buffers:
# a trainer sees a new shape with every new example length. After 30 steps of
# `scripts/training_rss.py` RSS was 1,726 MB with the default and 1,593 MB with 16 (+140 and +97 MB
# since step 10, for 21 MB more examples), at the same step time. Serving sees few shapes and keeps
# the default.
KERNEL_CACHE_CAPACITY = 16


def bound_kernel_cache() -> None:
    """For processes that train or evaluate on examples of many lengths (trainer, gate); call it
    before their first tensor operation: oneDNN reads the setting once, when it builds a kernel."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))
