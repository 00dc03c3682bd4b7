"""vLLM (its CPU build, in `.venv-vllm`) serving the default target and TIDE's drafts.

The draft TIDE trains must be the same draft inside vLLM: exported to the speculators format, it is
accepted as often there as in TIDE's engine, and speculation leaves vLLM's greedy output unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from confluent_kafka.admin import AdminClient
from safetensors.torch import load_file, save_file

from tide.infra.kafka.broker import KafkaBroker
from tide.models.hf_folder import write_hf_folder
from tide.models.loader import Target, read_target
from tide.names import topic_for
from tide.producers.assembler import join
from tide.producers.consumer import RecordConsumer
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import HiddenStateRecord
from tide.prompts import load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.vllm_adapter.config import TapConfig, VllmConfig, VllmUnavailable
from tide.serving.vllm_adapter.process import VllmProcess
from tide.trainers.export import export_speculators

from .conftest import WORKLOADS
from .drafts import noisy_draft

GAMMA = 3
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompts(target_fp32: Target) -> list[list[int]]:
    return [p.token_ids(target_fp32.tok) for p in split(load_prompts(WORKLOADS / "code.jsonl"), "test")[:6]]


@pytest.fixture(scope="module")
def vllm_folders(
    target_fp32: Target, trained_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The target as an HF folder and the trained draft exported for vLLM."""
    work = tmp_path_factory.mktemp("vllm")
    folder = work / "target"
    assert write_hf_folder(None, folder) == (folder, target_fp32.fingerprint)
    draft = export_speculators(
        trained_draft_dir, work / "draft", verifier_name_or_path=str(folder), speculative_tokens=GAMMA
    )
    return folder, draft


@pytest.fixture(scope="module")
def vllm_pair(vllm_folders: tuple[Path, Path]) -> Iterator[tuple[VllmProcess, VllmProcess]]:
    """vLLM in fp32 without speculation and with the trained draft (exported as speculators)."""
    folder, draft = vllm_folders
    cfg = VllmConfig(folder, None, GAMMA, "float32", 1024, 1, torch.get_num_threads())
    with VllmProcess(cfg) as plain, VllmProcess(dataclasses.replace(cfg, draft_dir=draft)) as spec:
        yield plain, spec


def test_the_hf_folder_is_the_same_target(target_fp32: Target, tmp_path: Path) -> None:
    """Written from the GGUF and read back: the same fingerprint, so records name the same target."""
    assert write_hf_folder(None, tmp_path / "t") == (tmp_path / "t", target_fp32.fingerprint)
    assert read_target(tmp_path / "t")[4] == target_fp32.fingerprint
    assert json.loads((tmp_path / "t" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_vllm_greedy_is_unchanged_by_speculation(
    vllm_pair: tuple[VllmProcess, VllmProcess], prompts: list[list[int]]
) -> None:
    plain, spec = vllm_pair
    a = plain.generate(prompts, NEW_TOKENS)
    b = spec.generate(prompts, NEW_TOKENS)
    assert b.drafts > 0 and b.draft_tokens == GAMMA * b.drafts  # it did speculate
    assert a.outputs == b.outputs


def test_the_draft_is_accepted_alike_in_vllm_and_tide(
    vllm_pair: tuple[VllmProcess, VllmProcess],
    prompts: list[list[int]],
    target_fp32: Target,
    trained_draft_dir: Path,
) -> None:
    """One draft, two engines, the same prompts in fp32: the same tokens per step within 5%."""
    _, spec = vllm_pair
    run = spec.generate(prompts, NEW_TOKENS)
    vllm_length = 1.0 + sum(run.accepted_by_position) / run.drafts
    engine = Engine(target_fp32, None, EngineConfig(max_batch=1, max_model_len=1024, gamma=GAMMA))
    engine.load_draft(trained_draft_dir)
    engine.swap_pending_drafts()
    seqs = [engine.generate([p], SamplingParams(max_tokens=NEW_TOKENS))[0] for p in prompts]
    assert [s.output for s in seqs] == run.outputs  # the same target, greedy, in both engines
    tide_length = engine.stats.mean_accept_length
    assert tide_length > 1.3, tide_length  # the draft is worth comparing
    assert abs(vllm_length / tide_length - 1.0) < 0.05, (vllm_length, tide_length)


def test_a_draft_swapped_into_vllm_serves_at_once_and_a_broken_one_is_refused(
    vllm_pair: tuple[VllmProcess, VllmProcess],
    vllm_folders: tuple[Path, Path],
    prompts: list[list[int]],
    trained_draft_dir: Path,
    tmp_path: Path,
) -> None:
    """Live swaps without a restart: a worse draft serves at once (its acceptance falls, greedy output
    stays vLLM's own), one whose weights do not fit is refused and the draft before it serves on,
    and the first draft swapped back accepts as it did."""
    plain, spec = vllm_pair
    folder, trained = vllm_folders
    expected = plain.generate(prompts, NEW_TOKENS).outputs

    def tokens_per_step() -> float:
        run = spec.generate(prompts, NEW_TOKENS)
        assert run.outputs == expected
        return 1.0 + sum(run.accepted_by_position) / run.drafts

    before = tokens_per_step()
    noisy = export_speculators(noisy_draft(trained_draft_dir, tmp_path / "noisy", 1.0), tmp_path / "noisy-v",
                               verifier_name_or_path=str(folder), speculative_tokens=GAMMA)  # fmt: skip
    spec.swap_draft(noisy)
    worse = tokens_per_step()
    assert worse < before - 0.2, (before, worse)
    broken = tmp_path / "broken"
    shutil.copytree(noisy, broken)
    state = load_file(str(broken / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()  # loads after other tensors
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(RuntimeError, match="vLLM failed"):
        spec.swap_draft(broken)
    assert tokens_per_step() == pytest.approx(worse, rel=0.02)  # the noisy draft, whole, serves on
    spec.swap_draft(trained)
    assert tokens_per_step() == pytest.approx(before, rel=0.02)


def test_a_bad_request_is_answered_and_vllm_serves_on(
    vllm_pair: tuple[VllmProcess, VllmProcess], prompts: list[list[int]]
) -> None:
    plain, _ = vllm_pair
    with pytest.raises(RuntimeError, match="vLLM failed"):
        plain.generate([[10**9]], 4)  # no such token
    assert plain.generate(prompts[:1], 4).tokens == 4


def test_a_missing_vllm_virtualenv_says_how_to_make_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TIDE_VLLM_PYTHON", str(tmp_path / "none" / "bin" / "python"))
    with pytest.raises(VllmUnavailable, match="make vllm"):
        VllmProcess(VllmConfig(tmp_path))


# -- the records a vLLM node publishes ------------------------------------------------------------------
def _requests(bootstrap: str, workload: str, fingerprint: str, records: int) -> list[HiddenStateRecord]:
    """The workload's topic read back, each request's records joined in chunk order."""
    reader = RecordConsumer(bootstrap, [workload], f"check-{uuid.uuid4().hex[:6]}", fingerprint)
    got: dict[str, list[HiddenStateRecord]] = {}
    idle = time.monotonic()
    while sum(map(len, got.values())) < records and time.monotonic() - idle < 15:
        for c in reader.poll(64, 1.0):
            got.setdefault(c.record.request_id, []).append(c.record)
            idle = time.monotonic()
    reader.close()
    assert sum(map(len, got.values())) == records
    return [join(sorted(rs, key=lambda r: r.chunk)) for rs in got.values()]


def test_vllm_records_match_tide_records(
    kafka: KafkaBroker,
    vllm_folders: tuple[Path, Path],
    target_fp32: Target,
    trained_draft_dir: Path,
    prompts: list[list[int]],
) -> None:
    """The same prompts served by vLLM and by TIDE's engine, both capturing (fp32, records in bf16):
    the same tokens, and states that agree within bf16 rounding and the engines' kernels."""
    fp = target_fp32.fingerprint
    folder, draft = vllm_folders
    tap = TapConfig(kafka.bootstrap, fp, capture="*=on", codec="bf16")
    cfg = VllmConfig(folder, draft, GAMMA, "float32", 1024, 1, torch.get_num_threads(), tap=tap)
    with VllmProcess(cfg) as node:
        served = node.generate(prompts, NEW_TOKENS, workload="vllm-contract")
        node.generate(prompts[:1], NEW_TOKENS, workload="vllm-optout", capture=False)
        counters = node.flush_tap()
    assert counters["failures"] == 0 and counters["records_dropped"] == counters["records_failed"] == 0

    publisher = RecordPublisher(PublisherConfig(kafka.bootstrap, "bf16"), fp)
    engine = Engine(
        target_fp32, None, EngineConfig(max_batch=1, max_model_len=1024, gamma=GAMMA), tap=publisher
    )
    engine.load_draft(trained_draft_dir)
    engine.swap_pending_drafts()
    for p in prompts:
        engine.add(p, SamplingParams(max_tokens=NEW_TOKENS), workload="tide-contract")
        while engine.has_work:
            engine.step()
    publisher.close()

    theirs = _requests(kafka.bootstrap, "vllm-contract", fp, counters["records_published"])
    ours = _requests(kafka.bootstrap, "tide-contract", fp, publisher.stats.records_published)
    assert len(theirs) == len(ours) == len(prompts)
    for prompt, output in zip(prompts, served.outputs, strict=True):
        v, t = (next(r for r in rs if r.tokens[: len(prompt)].tolist() == prompt) for rs in (theirs, ours))
        # exactly the prompt and the completion the client received, in both
        assert v.tokens.tolist() == t.tokens.tolist() == prompt + output
        assert v.prefill.tolist() == t.prefill.tolist() and v.first_position == t.first_position == 0
        for a, b in ((v.aux, t.aux), (v.hidden, t.hidden)):
            a, b = a.float(), b.float()
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
            assert cos.min() > 0.999 and rel.max() < 0.03, (cos.min(), rel.max())
    # the request that opted out was never captured: its workload's topic was never even made
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert topic_for("vllm-optout") not in topics and topic_for("vllm-contract") in topics
