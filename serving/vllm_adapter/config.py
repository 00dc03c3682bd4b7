"""What the parts of the vLLM adapter share: its virtualenv, its settings, its processes' environment."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tide.producers.records import DEFAULT_CODEC

VENV_DIR = ".venv-vllm"
WORKER_EXTENSION = "tide.serving.vllm_adapter.worker.TideWorker"  # vLLM's worker_extension_cls
NODE_ENV = "TIDE_VLLM_NODE"  # the `VllmConfig` (JSON) of the node vLLM's OpenAI server runs
# vLLM's CPU build runs with Intel's OpenMP (its wheel pins intel-openmp); torch in that virtualenv
# loads GNU OpenMP first unless this library is preloaded
IOMP_LIBRARY = "lib/libiomp5.so"


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: $TIDE_VLLM_PYTHON, else `.venv-vllm` in the checkout."""
    named = os.environ.get("TIDE_VLLM_PYTHON")
    if named:
        return Path(named)
    checkout = Path(__file__).resolve().parents[2]
    return checkout / VENV_DIR / "bin" / "python"


class VllmUnavailable(RuntimeError):
    """vLLM's virtualenv is missing or its engine would not start."""


@dataclass
class TapConfig:
    bootstrap: str
    fingerprint: str  # the target's, as every record names it
    capture: str = "*=on"  # capture rules, as `tide serve --capture` takes them
    codec: str = DEFAULT_CODEC
    workloads: str = ""  # the workload names served, as `--workloads` takes them (others: `default`)
    max_workloads: int = 16  # without `workloads`: names past this many are `default`
    chunk_positions: int = 128  # positions per Kafka record at most


@dataclass
class FollowConfig:
    """A vLLM node follows one workload's champion (vLLM runs one drafter)."""

    tracking_uri: str
    node: str  # this node's name in tags
    fingerprint: str  # the target's
    cache_dir: str  # downloaded versions
    workload: str = "default"
    poll_seconds: float = 10.0
    rollback_tolerance: float = 0.25
    rollback_min_steps: int = 1000


@dataclass
class VllmConfig:
    model_dir: Path  # the target as an HF folder
    draft_dir: Path | None = None  # a speculators-format draft: EAGLE-3 speculation on
    gamma: int = 3
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 1
    threads: int = 1
    kv_cache_gib: int = 1
    tap: TapConfig | None = None  # capture into Kafka (needs a draft: EAGLE-3 computes the aux states)
    follow: FollowConfig | None = None  # follow the registry (needs a draft: one is swapped for another)
    draft_version: str = ""  # the TIDE version of `draft_dir`'s draft

    @classmethod
    def from_json(cls, text: str) -> VllmConfig:
        d = json.loads(text)
        d["model_dir"] = Path(d["model_dir"])
        d["draft_dir"] = Path(d["draft_dir"]) if d["draft_dir"] else None
        d["tap"] = TapConfig(**d["tap"]) if d["tap"] else None
        d["follow"] = FollowConfig(**d["follow"]) if d["follow"] else None
        return cls(**d)


def environment(cfg: VllmConfig) -> tuple[Path, dict[str, str]]:
    """vLLM's interpreter and the environment its processes need."""
    python = vllm_python()
    if not python.exists():
        raise VllmUnavailable(f"no vLLM virtualenv at {python.parent.parent}: run `make vllm`")
    if cfg.tap is not None and cfg.draft_dir is None:
        raise ValueError("vLLM computes the states a tap captures only with an EAGLE-3 draft")
    if cfg.follow is not None and cfg.draft_dir is None:
        raise ValueError("a vLLM node swaps drafts into the drafter it starts with: give it a draft")
    env = dict(os.environ)
    iomp = python.parent.parent / IOMP_LIBRARY
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    cores = sorted(os.sched_getaffinity(0))[: cfg.threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env[NODE_ENV] = json.dumps(asdict(cfg), default=str)
    return python, env
