"""`tide up` on a machine without a draft: the node answers at once, without speculation, and the
first draft arrives through the loop (the stack's draft job trains and registers it, the node swaps
it in from the registry, the trainers start from it)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from tide.config import cache_dir
from tide.infra.process import free_port
from tide.names import MODEL_PREFIX
from tide.registry.tags import VersionTags

from .conftest import tide_process

# what the machine builds or fetches once, shared with the fresh cache; drafts and state are not
SHARED = ("kafka", "versitygw", "tools", "targets", "tokenizers", "compiled")


def _fresh_cache(tmp_path: Path) -> Path:
    fresh = tmp_path / "cache"
    fresh.mkdir()
    for name in SHARED:
        (cache_dir() / name).mkdir(parents=True, exist_ok=True)
        (fresh / name).symlink_to(cache_dir() / name)
    return fresh


def _health(url: str) -> dict[str, object] | None:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


@pytest.mark.slow
def test_tide_up_serves_at_once_and_its_first_draft_comes_through_the_registry(tmp_path: Path) -> None:
    port, ui_port, log = free_port(), free_port(), tmp_path / "up.log"
    url = f"http://127.0.0.1:{port}"
    # the draft job trains for 1.5 minutes: long enough that the node must answer before it ends
    args = ["up", "--data", str(tmp_path / "stack"), "--port", str(port), "--mlflow-port", str(ui_port),
            "--draft-args", "--budget-minutes 1.5", "--serve-args", "--max-batch 2 --registry-poll 2",
            "--gate-args", "--poll-seconds 5"]  # fmt: skip
    env = {"TIDE_CACHE": str(_fresh_cache(tmp_path)), "OMP_NUM_THREADS": "1"}
    with tide_process(args, log, env) as proc:
        start = time.monotonic()
        while (health := _health(url)) is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < start + 600, "no answer in 600 s:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        answered = time.monotonic() - start
        assert health["draft"] == "none"  # answering before any draft exists
        body = {"model": "tide", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        while (health := _health(url)) is None or health["draft"] == "none":
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < start + 900, "no draft in 900 s:\n" + log.read_text()[-3000:]
            time.sleep(2)
        swapped = time.monotonic() - start
        while "trainer:default started" not in log.read_text():
            assert time.monotonic() < start + 960, log.read_text()[-3000:]
            time.sleep(1)
        client = MlflowClient(f"http://127.0.0.1:{ui_port}")
        (default,) = client.search_registered_models(f"name LIKE '{MODEL_PREFIX}%-default'")
        champion = client.get_model_version_by_alias(default.name, "champion")
        assert VersionTags.from_tags(champion.tags).source == "the default draft"
        print(f"answered after {answered:.0f} s; the first draft served after {swapped:.0f} s")
