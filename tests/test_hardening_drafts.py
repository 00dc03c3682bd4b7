"""Hardening of drafts and the registry (issue 30): nothing broken or tampered is ever served, and
the gate fails closed.

Each test sends the bad thing: a config field the engine relies on set wrong, a vocabulary map
that breaks exact sampling, finite weights that overflow, a version with a file its tags do not
cover, a champion or a candidate out of reach, a second gate, an alias moved behind a node's or a
gate's back, a registry that keeps failing. Registry tests run against the real MLflow and S3
servers (and Kafka for the gate's held-out records)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.models.eagle3 import DraftLoadError, DraftMismatchError, Eagle3Draft
from tide.models.loader import Target, TargetHead, load_head
from tide.producers.records import HeldOutWindow
from tide.registry.gate import Gate, GateConfig, GateLease, Verdict, backoff
from tide.registry.store import SHA_TAG, AliasMoved, ArtifactRefused, download_version
from tide.serving.draft_sync import DraftSync, SyncConfig
from tide.serving.engine import Engine, EngineConfig

from .conftest import serve_into_kafka, tiny_draft, tiny_target
from .drafts import Registrar, copy_draft, read_held_out


# -- draft files -------------------------------------------------------------------------------------
def _saved(folder: Path, target: Target, vocab: int = 100, seed: int = 32, version: str = "v1") -> Path:
    draft = tiny_draft(target, seed=seed, vocab=vocab)
    draft.cfg.version = version
    draft.save(folder)
    return folder


def _edit_config(folder: Path, **fields: object) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _edit_state(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "tide-eagle3/1"})
    return folder


def _load(target: Target, folder: Path) -> Eagle3Draft:
    return Eagle3Draft.load(
        folder, target.model.embed_tokens, target.config, target.fingerprint, torch.float32
    )


@pytest.fixture(scope="module")
def tiny() -> Target:
    return tiny_target(seed=31)


def test_a_draft_with_a_shorter_position_table_is_refused(tiny: Target, tmp_path: Path) -> None:
    # positions past it would fail inside a serving step, failing the whole batch
    folder = _edit_config(_saved(tmp_path / "d", tiny), max_position=tiny.config.max_position // 8)
    with pytest.raises(DraftMismatchError, match="max position"):
        _load(tiny, folder)


@pytest.mark.parametrize(
    "fields",
    [
        {"intermediate_size": -1},  # raised a RuntimeError from the module, not a refusal
        {"num_heads": 0},
        {"rms_eps": float("nan")},  # a NaN epsilon: every norm NaN, with finite weights
        {"rope_theta": -1.0},
        {"head_dim": "16"},
        {"aux_layer_ids": [1, 1]},
    ],
)
def test_config_fields_out_of_range_are_refused(
    tiny: Target, tmp_path: Path, fields: dict[str, object]
) -> None:
    folder = _edit_config(_saved(tmp_path / "d", tiny), **fields)
    with pytest.raises((DraftLoadError, DraftMismatchError)) as e:
        _load(tiny, folder)
    assert not isinstance(e.value, DraftLoadError) or e.value.reason == "invalid_config", e.value


def _out_of_range(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][7] = 10_000  # draft id 7 says a target id the vocabulary does not have


def _duplicated(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][8] = state["d2t"][7] - 1  # draft ids 7 and 8 both say target id 7


def _t2d_inconsistent(state: dict[str, torch.Tensor]) -> None:
    state["t2d"][200] = True  # a target id no draft id says


@pytest.mark.parametrize("edit", [_out_of_range, _duplicated, _t2d_inconsistent])
def test_a_vocabulary_map_that_breaks_exact_sampling_is_refused(
    tiny: Target, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> None:
    folder = _edit_state(_saved(tmp_path / "d", tiny), edit)
    with pytest.raises(DraftLoadError, match=r"d2t|t2d") as e:
        _load(tiny, folder)
    assert e.value.reason == "invalid_vocab"


def test_finite_weights_that_overflow_fail_the_smoke_forward(tiny: Target, tmp_path: Path) -> None:
    def huge(state: dict[str, torch.Tensor]) -> None:
        state["fc.weight"] = torch.full_like(state["fc.weight"], 3e38)  # finite, each one

    folder = _edit_state(_saved(tmp_path / "d", tiny), huge)
    with pytest.raises(DraftLoadError, match="non-finite logits") as e:
        _load(tiny, folder)
    assert e.value.reason == "smoke"
    _load(tiny, _saved(tmp_path / "good", tiny))  # a sound draft passes the same forward


# -- versions in the registry ------------------------------------------------------------------------
@pytest.fixture
def tiny_reg(registry: MlflowServer, tiny: Target) -> Registrar:
    return Registrar(registry.url, tiny.fingerprint, f"hard-{uuid.uuid4().hex[:6]}")


def test_every_file_of_a_version_must_be_covered_by_its_tag(
    tiny_reg: Registrar, tiny: Target, tmp_path: Path
) -> None:
    reg = tiny_reg
    # config.json swapped after registration, its tag removed: only the weights are still vouched for
    mv = reg.register(_saved(tmp_path / "a", tiny))
    reg.client.delete_model_version_tag(reg.name, mv.version, f"{SHA_TAG}config.json")
    with pytest.raises(ArtifactRefused, match=r"no sha256 tag for config\.json") as e:
        download_version(reg.client, reg.client.get_model_version(reg.name, mv.version), tmp_path / "cache")
    assert e.value.reason == "unverified"
    # a tag for a file the version does not have
    mv = reg.register(_saved(tmp_path / "b", tiny))
    reg.client.set_model_version_tag(reg.name, mv.version, f"{SHA_TAG}extra.bin", "0" * 64)
    with pytest.raises(ArtifactRefused, match=r"extra\.bin") as e:
        download_version(reg.client, reg.client.get_model_version(reg.name, mv.version), tmp_path / "cache")
    assert e.value.reason == "checksum"


def test_a_damaged_cache_is_downloaded_again_and_caches_keep_a_few_versions(
    tiny_reg: Registrar, tiny: Target, tmp_path: Path
) -> None:
    reg, cache = tiny_reg, tmp_path / "cache"
    folder = _saved(tmp_path / "d", tiny)
    versions = [reg.register(folder) for _ in range(4)]
    local = download_version(reg.client, versions[0], cache)
    (local / "model.safetensors").write_bytes(b"bit rot")  # the disk, not the version
    assert download_version(reg.client, versions[0], cache) == local  # fetched again, not refused
    _load(tiny, local)
    for mv in versions:
        download_version(reg.client, mv, cache, keep=2)
    kept = sorted(p.name for p in (cache / reg.name).iterdir())
    assert kept == sorted(str(mv.version) for mv in versions[-2:])


def _sync(registry: MlflowServer, target: Target, workload: str, cache: Path) -> tuple[DraftSync, Engine]:
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=32, gamma=2))
    cfg = SyncConfig(registry.url, cache, "node-h", workloads=(workload,), publish_profile=False)
    return DraftSync(cfg, engine), engine


def _serving(engine: Engine, workload: str) -> str | None:
    engine.swap_pending_drafts()  # what the engine's next step does
    return engine.draft_versions().get(workload)


def test_a_node_refuses_and_counts_bad_versions_and_keeps_its_draft(
    registry: MlflowServer, tiny_reg: Registrar, tiny: Target, tmp_path: Path
) -> None:
    reg = tiny_reg
    sync, engine = _sync(registry, tiny, reg.workload, tmp_path / "cache")
    reg.champion(reg.register(_saved(tmp_path / "good", tiny, version="good")))
    sync.poll_once()
    assert _serving(engine, reg.workload) == "good"
    untagged = reg.register(_saved(tmp_path / "u", tiny, version="untagged"))
    reg.client.delete_model_version_tag(reg.name, untagged.version, f"{SHA_TAG}config.json")
    bad = [
        (untagged, "unverified"),
        (reg.register(_edit_state(_saved(tmp_path / "dup", tiny, version="dup"), _duplicated)), "invalid_vocab"),
        (reg.register(_edit_config(_saved(tmp_path / "pos", tiny, version="pos"), max_position=16)), "foreign_target"),
    ]  # fmt: skip
    for mv, reason in bad:
        reg.champion(mv)
        sync.poll_once()
        assert sync.stats.refused[reason] == 1, (reason, sync.stats)
        assert _serving(engine, reg.workload) == "good"
    assert sync.stats.registry_errors == 0 and sync.stats.swaps == 1


def test_a_node_rolls_back_the_champion_only_where_it_read_it(
    registry: MlflowServer, tiny_reg: Registrar, tiny: Target, tmp_path: Path
) -> None:
    reg = tiny_reg
    sync, engine = _sync(registry, tiny, reg.workload, tmp_path / "cache")
    first = reg.register(_saved(tmp_path / "1", tiny, version="first"))
    judged = reg.register(_saved(tmp_path / "2", tiny, version="judged"))
    reg.client.set_registered_model_alias(reg.name, "previous", first.version)
    reg.champion(judged)
    sync.poll_once()
    f = sync.following[reg.workload]
    assert f.version == str(judged.version)
    # while the node measures, the gate promotes a newer version
    newer = reg.register(_saved(tmp_path / "3", tiny, version="newer"))
    reg.champion(newer)
    sync.live.roll_back(reg.workload, f, 1.0, 3.0, {})
    assert reg.alias("champion") == str(newer.version)  # not moved back over the gate's promotion
    assert reg.tags(judged)["rollback.champion"].startswith("left alone")
    sync.poll_once()
    assert _serving(engine, reg.workload) == "newer"  # and the node follows it
    # where the champion is still the judged version, the rollback moves it
    again = reg.register(_saved(tmp_path / "4", tiny, version="again"))
    reg.client.set_registered_model_alias(reg.name, "previous", newer.version)
    reg.champion(again)
    sync.poll_once()
    sync.live.roll_back(reg.workload, sync.following[reg.workload], 1.0, 3.0, {})
    assert reg.alias("champion") == str(newer.version)
    assert reg.tags(again)["rollback.champion"] == "moved"


# -- the gate ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def head() -> TargetHead:
    return load_head()


@pytest.fixture(scope="module")
def gate_env(
    kafka: KafkaBroker,
    registry: MlflowServer,
    target_native: Target,
    head: TargetHead,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Gate, Registrar, Path, Path]]:
    """A gate with held-out records of its workload, and two (untrained) drafts for the target."""
    workload = f"hgate-{uuid.uuid4().hex[:6]}"
    serve_into_kafka(target_native, kafka.bootstrap, workload, "code.jsonl", 3, held_out=True)
    work = tmp_path_factory.mktemp("hgate")
    a = _saved(work / "a", target_native, vocab=512, seed=1, version="a")
    b = _saved(work / "b", target_native, vocab=512, seed=2, version="b")
    # no floor and no profile: whatever the drafts score, a decision is made once the gate can
    cfg = GateConfig(registry.url, kafka.bootstrap, work / "cache", min_tau=0.0, min_speedup=0.0,
                     held_out=HeldOutWindow(3600, min_positions=32))  # fmt: skip
    gate = Gate(cfg, head)
    read_held_out(gate, workload, 3)
    try:
        yield gate, Registrar(registry.url, head.fingerprint, workload), a, b
    finally:
        gate.close()


def _decisions(gate: Gate, reg: Registrar) -> list[Verdict]:
    return [d for d in gate.run_once() if d.name == reg.name]


def _block(gate: Gate, reg: Registrar, version: str) -> Path:
    """The version's cache folder cannot be written (a file sits where it goes): an OSError, as
    from a full disk."""
    blocker = gate.cfg.cache_dir / reg.name / version
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("no space left")
    return blocker


def test_the_gate_fails_closed_when_the_champion_cannot_be_read(
    gate_env: tuple[Gate, Registrar, Path, Path],
) -> None:
    gate, reg, a, b = gate_env
    champion = reg.register(a, {"gate.decision": "promoted"})
    reg.champion(champion)
    cand = reg.register(b)
    blocker = _block(gate, reg, str(champion.version))
    assert _decisions(gate, reg) == []  # before: promoted "over no baseline"
    assert "gate.decision" not in reg.tags(cand) and reg.alias("champion") == str(champion.version)
    assert any(reg.name in f and "out of reach" in f for f in gate.failed), gate.failed
    blocker.unlink()  # the disk has room again: decided, against the champion
    [d] = _decisions(gate, reg)
    assert d.version == str(cand.version) and d.tags["gate.baseline"].endswith(f"v{champion.version}")


def test_a_candidate_out_of_reach_gets_no_verdict(gate_env: tuple[Gate, Registrar, Path, Path]) -> None:
    gate, reg, a, _ = gate_env
    cand = reg.register(copy_draft(a, a.parent / "c", "c"))
    blocker = _block(gate, reg, str(cand.version))
    assert _decisions(gate, reg) == []  # before: refused for good as "unloadable"
    assert "gate.decision" not in reg.tags(cand)
    blocker.unlink()
    [d] = _decisions(gate, reg)
    assert d.version == str(cand.version) and d.decision in ("promoted", "refused")
    assert "unloadable" not in d.reason


def test_only_one_gate_acts_per_registry(
    gate_env: tuple[Gate, Registrar, Path, Path], head: TargetHead
) -> None:
    gate, reg, a, _ = gate_env
    other = Gate(gate.cfg, head)
    try:
        read_held_out(other, reg.workload, 3)
        cand = reg.register(copy_draft(a, a.parent / "d", "d"))
        assert gate.lease.acquire()
        assert other.run_once() == [] and "gate.decision" not in reg.tags(cand)
        # the holder stops renewing (killed): once its lease has expired the other takes over
        gate.lease.seconds = 0.0
        assert gate.lease.acquire()
        assert [d.version for d in _decisions(other, reg)] == [str(cand.version)]
        assert not gate.lease.acquire()  # and the first no longer acts
        assert gate.run_once() == []
    finally:
        gate.lease.seconds = gate.cfg.lease_seconds
        other.close()
    # released on close: the first gate acts again at once
    assert gate.lease.acquire()


def test_a_lease_epoch_is_taken_by_one_gate(registry: MlflowServer) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(registry.url)
    fp = uuid.uuid4().hex * 2
    leases = [GateLease(client, fp, 60.0, owner=f"g{i}") for i in range(3)]
    assert [lease.acquire() for lease in leases] == [True, False, False]
    assert leases[0].acquire() and not leases[1].acquire()  # renewed by its holder only
    leases[0].release()
    assert leases[2].acquire() and not leases[0].acquire()
    leases[2].release()


def test_the_gate_moves_the_champion_only_where_it_read_it(
    gate_env: tuple[Gate, Registrar, Path, Path],
) -> None:
    gate, reg, a, _ = gate_env
    rm = reg.client.get_registered_model(reg.name)
    read = reg.register(copy_draft(a, a.parent / "r", "r"), {"gate.decision": "promoted"})
    reg.champion(read)  # what the gate read
    cand = reg.register(copy_draft(a, a.parent / "e", "e"), {"gate.decision": "refused"})
    moved = reg.register(copy_draft(a, a.parent / "f", "f"), {"gate.decision": "refused"})
    reg.champion(moved)  # a node's rollback or a hand, after the gate read the champion
    previous = reg.alias("previous")
    with pytest.raises(AliasMoved):
        gate._promote(rm, read, cand)
    assert reg.alias("champion") == str(moved.version) and reg.alias("previous") == previous


def test_the_gate_backs_off_while_passes_fail(head: TargetHead) -> None:
    gate = Gate(GateConfig("http://127.0.0.1:9", "", Path("/nonexistent"), max_backoff_seconds=60), head)
    outcomes = iter(["down", "down", "down", "down", "ok", "down"])

    def run_once() -> list[Verdict]:
        if next(outcomes) == "down":
            raise ConnectionError("registry away")
        return []

    class Waits(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[float] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.seen.append(float(timeout or 0))
            if len(self.seen) == 6:
                self.set()
            return self.is_set()

    stop = Waits()
    gate.run_once = run_once
    gate.run(10.0, stop)
    assert stop.seen == [20.0, 40.0, 60.0, 60.0, 10.0, 20.0]
    assert backoff(10.0, 0, 60.0) == 10.0
