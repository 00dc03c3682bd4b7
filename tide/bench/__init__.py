"""tide/bench: benchmarks that compare systems side by side in one run."""

from __future__ import annotations

from pathlib import Path


def cpu_description() -> str:
    """The CPU a benchmark ran on, as its reports state it (CPUs differ between machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    for line in info.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + (" (AVX512-BF16)" if "avx512_bf16" in info else "")
    return "unknown"
