"""Shared fixtures: the default model (fp32 and bf16), a quickly trained draft, tiny random models."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tide.config import native_dtype
from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.infra.process import free_port, wait_http_ok
from tide.infra.s3.server import S3Server
from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.llama import LlamaConfig, LlamaModel
from tide.models.loader import Target, load_target
from tide.producers.consumer import RecordConsumer
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import is_held_out
from tide.prompts import load_prompts
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.stack import as_account

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "workloads"
# a test that takes one of these is in the slow tier: it loads the default model or starts a real
# service (`pytest -m "not slow"` runs the rest in a few minutes; `make test` runs everything)
SLOW_FIXTURES = {"target_fp32", "target_native", "trained_draft_dir", "kafka", "s3", "registry"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _tide_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # converted tokenizers may be shared with the user's cache; drafts trained by tests are not
    os.environ.setdefault("TIDE_CACHE", str(tmp_path_factory.mktemp("tide-cache")))


@pytest.fixture(scope="session")
def target_fp32() -> Target:
    return load_target(dtype=torch.float32)


@pytest.fixture(scope="session")
def target_native(target_fp32: Target) -> Target:
    """The default model in the dtype `tide serve` picks here: bf16 where the CPU runs it natively."""
    return target_fp32 if native_dtype() == torch.float32 else load_target(dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def trained_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft trained by the real `tide draft train` command on a few code prompts (about three minutes)."""
    from typer.testing import CliRunner

    from tide.cli import app

    out = tmp_path_factory.mktemp("draft") / "code"
    res = CliRunner().invoke(
        app,
        [
            "draft",
            "train",
            "--prompts",
            str(WORKLOADS / "code.jsonl"),
            "--part",
            "train",
            "--limit",
            "48",
            "--out",
            str(out),
            "--budget-minutes",
            "10",
            "--max-steps",
            # a fixed amount of training: the draft's quality must not depend on the machine's load (on
            # 16 code test prompts, tau at gamma 4: 1.63 after 125 steps, 140 s; 1.70 after 200, 223 s)
            "130",
            "--max-new-tokens",
            "96",
            "--draft-vocab",
            "4096",
            # the dense target the lossless and loop tests serve (and the figures above were measured on)
            "--weights",
            "bf16",
        ],
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (out / "model.safetensors").exists()
    return out


def tiny_config(vocab: int = 256, layers: int = 2, **kw: Any) -> LlamaConfig:
    base: dict[str, object] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position=256,
        tie_embeddings=False,
        eos_token_ids=(),
    )
    base.update(kw)
    return LlamaConfig(**base)  # type: ignore[arg-type]


def tiny_target(seed: int = 0, scale: float = 1.0, **kw: Any) -> Target:
    """A random Llama small enough to enumerate its distributions."""
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08 * scale)
        model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.3 * scale)
    return Target(model.eval(), None, f"tiny-{seed}", Path("/nonexistent"))


def trained_tiny_draft(
    target: Target, seed: int = 1, vocab: int | None = None, steps: int = 150
) -> Eagle3Draft:
    """A tiny draft trained with the real training step on the tiny target's own sampled outputs."""
    from tide.bootstrap import Recorder
    from tide.serving.engine import Engine, EngineConfig
    from tide.serving.sampling import SamplingParams
    from tide.trainers.ttt import TrainConfig, Trainer

    rec = Recorder()
    engine = Engine(target, None, EngineConfig(max_batch=32, max_model_len=64, gamma=0, seed=seed), tap=rec)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.config.vocab_size, (4,), generator=g).tolist() for _ in range(96)]
    seqs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    lm_head = target.model.lm_head.weight.detach()
    examples = [rec.example(s.request_id, lm_head) for s in seqs]
    draft = tiny_draft(target, vocab, seed)
    trainer = Trainer(
        draft, lm_head, TrainConfig(ttt_steps=3, batch_size=16, lr=3e-3, autocast=False, seed=seed)
    )
    for i in range(steps):
        trainer.step([examples[(i * 16 + j) % len(examples)] for j in range(16)])
    return draft.eval()


def tiny_draft(target: Target, vocab: int | None = None, seed: int = 1) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = target.config
    dcfg = DraftConfig.for_target(cfg, target.fingerprint, vocab or cfg.vocab_size)
    draft = Eagle3Draft(dcfg, target.model.embed_tokens)
    draft.set_vocab(torch.arange(dcfg.draft_vocab_size))
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        # start close to the target's own head so that some drafts are accepted and some are not
        draft.lm_head.weight.copy_(target.model.lm_head.weight[draft.target_ids()])
    return draft.eval()


@contextmanager
def tide_process(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`tide ARGS` as a separate process, as users run it (environment: ours, plus `env`)."""
    tide = Path(sys.executable).parent / "tide"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(tide), *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield proc
    finally:  # `tide up` stops its parts (30 s together), then its services
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def serve_process(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`tide serve ARGS`; yields its base URL once healthy. These nodes are tested for what they do,
    not how fast: they skip compiling their layers (15 s a start with warm kernels; the stack tests
    serve as `make up` does, compiled)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    compiled = [] if "--compile" in args or "--engine" in args else ["--no-compile"]
    with tide_process(["serve", "--port", str(port), *compiled, *args], log, env) as proc:
        wait_http_ok(f"{url}/health", proc, 300, "server", lambda: log.read_text()[-3000:], AssertionError)
        yield url


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A real single-node Kafka broker (KRaft) from the Maven Central jars, for the whole session."""
    with KafkaBroker(tmp_path_factory.mktemp("kafka")) as broker:
        yield broker


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server (versitygw, built from the Go module proxy) for the whole session."""
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def registry(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real MLflow registry whose artifacts live in the S3 server; clients reach S3 through boto3,
    so the S3 settings are put into this process's environment (child processes inherit them)."""
    with (
        as_account(s3.env),
        MlflowServer(tmp_path_factory.mktemp("registry"), s3=s3, bucket="tide-drafts") as server,
    ):
        yield server


def serve_into_kafka(
    target: Target,
    bootstrap: str,
    workload: str,
    prompt_file: str,
    n: int,
    held_out: bool = False,
    batch: str = "",
    start: int = 0,
) -> set[str]:
    """The target answers n prompts (from the `start`-th) with capture on; returns the (request id,
    chunk) keys in the topic. With `held_out`, every request is one the trainers only ever evaluate
    on. A later call for the same workload names another `batch`: its request ids are new."""
    publisher = RecordPublisher(
        PublisherConfig(bootstrap, "int8-g64", chunk_positions=48), target.fingerprint
    )
    engine = Engine(target, None, EngineConfig(max_batch=8, max_model_len=512, gamma=0), tap=publisher)
    prompts = [
        p.token_ids(target.tok)[-200:] for p in load_prompts(WORKLOADS / prompt_file)[start : start + n]
    ]
    prefix = f"{workload}-{batch}"  # a later batch's ids start with it, the first batch's do not
    ids = (f"{prefix}{i}" for i in itertools.count())
    for p in prompts:
        # held out by the node's say-so in the record, whatever the id says
        rid = next(i for i in ids if not is_held_out(i)) if held_out else next(ids)
        engine.add(p, SamplingParams(max_tokens=64), rid, workload=workload, held_out=held_out or None)
    while engine.has_work:
        engine.step()
    publisher.close()
    assert publisher.stats.records_dropped == publisher.stats.records_failed == 0
    reader = RecordConsumer(bootstrap, [workload], f"check-{uuid.uuid4().hex[:6]}", target.fingerprint)
    keys: set[str] = set()
    idle = time.monotonic()
    # until every published record is read back (or nothing more comes for 10 s: the assert says how many)
    while len(keys) < publisher.stats.records_published and time.monotonic() - idle < 10:
        for c in reader.poll(64, 1.0):
            if not batch or c.record.request_id.startswith(prefix):  # this call's requests
                keys.add(f"{c.record.request_id}:{c.record.chunk}")
            idle = time.monotonic()
    reader.close()
    assert len(keys) == publisher.stats.records_published
    return keys
