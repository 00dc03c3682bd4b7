"""Records can never poison a trainer (issue 30): decompression is bounded whatever a frame declares,
decoded content is validated with typed refusals, counted by reason and committed past, a step that is
not finite is never taken, non-finite weights are never checkpointed, the ledger and the candidate
folders are bounded, and MLflow or Kafka failing does not end the trainer."""

from __future__ import annotations

import contextlib
import io
import json
import tracemalloc
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tide.infra.kafka.broker import KafkaBroker
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target, TargetHead
from tide.names import topic_for, trainer_group
from tide.producers.consumer import RecordConsumer
from tide.producers.records import (
    CorruptRecord,
    HiddenStateRecord,
    InvalidRecord,
    NonFiniteState,
    OversizedRecord,
    RecordError,
    TargetShape,
    TokenOutOfRange,
    WrongShape,
    WrongWorkload,
    decode,
    encode,
)
from tide.producers.topics import TopicConfig, ensure_topic
from tide.registry.trainer_sink import with_backoff
from tide.trainers.checkpoint import Ledger, load_checkpoint, save_checkpoint
from tide.trainers.online import OnlineConfig, OnlineTrainer
from tide.trainers.outbox import Backoff, Candidate
from tide.trainers.ttt import Example, TrainConfig, Trainer

from .conftest import tiny_draft, tiny_target

FP = "f" * 64
D, V = 64, 256
CAP = 64 << 20


def _record(workload: str = "code", fp: str = FP, rid: str = "r", held_out: bool = False, m: int = 24,
            **over: Any) -> HiddenStateRecord:  # fmt: skip
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    fields: dict[str, Any] = dict(
        tokens=torch.randint(0, V, (m + 1,), generator=g), aux=torch.randn(m, 3 * D, generator=g),
        hidden=torch.randn(m, D, generator=g), prefill=torch.arange(m) < 4, target_fingerprint=fp,
        draft_version="v1", workload=workload, request_id=rid, chunk=0, first_position=0, last=True,
        held_out=held_out,
    )  # fmt: skip
    fields.update(over)
    return HiddenStateRecord(**fields)


def _frame(size: int, declare: bool) -> bytes:
    """A zstd frame of `size` zero bytes (a few KB), its size in the header or not."""
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(level=3).stream_writer(out, size=size if declare else -1, closefd=False)
    zeros = bytes(1 << 20)
    for _ in range(size >> 20):
        writer.write(zeros)
    writer.flush(zstandard.FLUSH_FRAME)
    return out.getvalue()


def _declares_a_tebibyte() -> bytes:
    """A frame header saying 1 TiB (single segment, 8-byte size) and one raw 5-byte block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0b11100000]) + (1 << 40).to_bytes(8, "little") + (5 << 3 | 1).to_bytes(3, "little") + b"hello"  # fmt: skip


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    with contextlib.suppress(RecordError):
        fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


# -- decompression --------------------------------------------------------------------------------
def test_a_frame_declaring_more_than_the_cap_is_refused_before_decompressing() -> None:
    bomb = _frame(256 << 20, declare=True)
    assert len(bomb) < 16_000  # the 8 KB that declares 256 MiB
    with pytest.raises(OversizedRecord):
        decode(bomb, FP)
    assert _peak_bytes(lambda: decode(bomb, FP)) < 4 << 20  # it was 256 MiB
    with pytest.raises(OversizedRecord):  # this one raised MemoryError: it took the trainer down
        decode(_declares_a_tebibyte(), FP)


def test_a_frame_that_does_not_say_its_size_is_cut_off_at_the_cap() -> None:
    silent = _frame(CAP + (2 << 20), declare=False)
    with pytest.raises(OversizedRecord):
        decode(silent, FP)
    assert _peak_bytes(lambda: decode(silent, FP)) < CAP + (8 << 20)
    ok = _record()
    assert decode(encode(ok, "bf16"), FP).request_id == ok.request_id  # a record of ours still decodes


# -- content --------------------------------------------------------------------------------------
def _inf(m: int = 24) -> torch.Tensor:
    aux = torch.randn(m, 3 * D)
    aux[3, 5] = float("inf")
    return aux


def _nan(m: int = 24) -> torch.Tensor:
    hidden = torch.randn(m, D)
    hidden[0, 0] = float("nan")
    return hidden


BAD: dict[str, tuple[type[RecordError], dict[str, Any], str]] = {
    "wider states": (
        WrongShape,
        dict(aux=torch.randn(24, 3 * 2 * D), hidden=torch.randn(24, 2 * D)),
        "shape",
    ),
    "aux not 3d": (WrongShape, dict(aux=torch.randn(24, 2 * D)), "shape"),
    "aux of 3 dims": (WrongShape, dict(aux=torch.randn(24, 3, D)), "shape"),
    "token past the vocabulary": (TokenOutOfRange, dict(tokens=torch.full((25,), V)), "token_range"),
    "negative token": (TokenOutOfRange, dict(tokens=-torch.ones(25, dtype=torch.long)), "token_range"),
    "inf in aux": (NonFiniteState, dict(aux=_inf()), "non_finite"),
    "nan in hidden": (NonFiniteState, dict(hidden=_nan()), "non_finite"),
    "another workload": (WrongWorkload, dict(workload="chat"), "workload"),
    "negative chunk": (InvalidRecord, dict(chunk=-1), "invalid"),
    "created at inf": (InvalidRecord, dict(created_at=float("inf")), "invalid"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_decoded_content_is_validated_with_a_typed_refusal(case: str) -> None:
    error, over, reason = BAD[case]
    blob = encode(_record(**over), "bf16")  # bf16 stores the values as they are, inf and NaN included
    with pytest.raises(error) as refused:
        decode(blob, FP, TargetShape(D, V), "code")
    assert refused.value.reason == reason


def test_a_zero_dimensional_state_is_corrupt_not_a_crash() -> None:
    blob = encode(_record(), "bf16", zstd=False)
    header_len = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8 : 8 + header_len])["__metadata__"]
    tensors = st_load(blob) | {"aux": torch.tensor(1.0, dtype=torch.bfloat16)}
    with pytest.raises(CorruptRecord):  # len() of a 0-d tensor raised TypeError, which nothing caught
        decode(st_save(tensors, metadata=meta), FP)


# -- steps and checkpoints ------------------------------------------------------------------------
def _tiny() -> tuple[Target, TargetHead]:
    target = tiny_target()
    model = target.model
    embed = torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.detach().float(), freeze=True)
    head = TargetHead(
        target.config, embed, model.lm_head.weight.detach().float(), target.fingerprint, Path("/x")
    )
    return target, head


def _example(aux: torch.Tensor | None = None) -> Example:
    r = _record(aux=aux) if aux is not None else _record()
    return Example.make(r.tokens[:24], r.aux, r.hidden, None, 4)


def test_a_step_with_a_non_finite_loss_is_skipped_and_counted() -> None:
    target, head = _tiny()
    draft = tiny_draft(target)
    trainer = Trainer(draft, head.lm_head, TrainConfig(ttt_steps=2, autocast=False))
    trainer.step([_example()])
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    trainer.step([_example(_inf())])  # an inf state (a record the checks let through would do this)
    assert trainer.skipped == 1 and trainer.steps == 1
    after = draft.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # every weight finite and untouched
    trainer.step([_example()])
    assert trainer.steps == 2 and all(bool(torch.isfinite(v).all()) for v in draft.state_dict().values())


def test_non_finite_weights_are_never_checkpointed(tmp_path: Path) -> None:
    target, head = _tiny()
    draft = tiny_draft(target)
    trainer = Trainer(draft, head.lm_head, TrainConfig(autocast=False))
    with torch.no_grad():
        draft.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        save_checkpoint(tmp_path, Ledger(), draft, trainer.opt, [], [])
    assert load_checkpoint(tmp_path) is None


def test_the_ledger_remembers_the_newest_keys_only() -> None:
    ledger = Ledger()
    for i in range(10):
        ledger.trained.add(f"r{i}:0")
        ledger.records += 1
    ledger.trim(4)
    assert list(ledger.trained) == ["r6:0", "r7:0", "r8:0", "r9:0"] and ledger.forgotten == 6
    assert ledger.records == len(ledger.trained) + ledger.forgotten
    again = Ledger.from_json(ledger.to_json())
    assert list(again.trained) == list(ledger.trained) and again.trained == {"r6:0", "r7:0", "r8:0", "r9:0"}
    again.trained.add("r10:0")
    again.trim(4)
    assert "r6:0" not in again.trained and again.forgotten == 7


def test_backoff_doubles_up_to_its_cap_and_a_call_is_tried_until_it_succeeds() -> None:
    b = Backoff(1.0, 5.0)
    assert [b.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0] and not b.due()
    b.succeeded()
    assert b.due() and b.failed() == 1.0
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("MLflow is away")
        return "run-1"

    assert with_backoff("start", flaky, 60, Backoff(0.01, 0.02)) == "run-1" and len(calls) == 3

    def away() -> str:
        raise ConnectionError("MLflow is away")

    with pytest.raises(ConnectionError):  # away for longer than it waits: the error, not a hang
        with_backoff("start", away, 0.05, Backoff(0.01, 0.02))


# -- against the broker ---------------------------------------------------------------------------
def _produce(bootstrap: str, workload: str, values: list[tuple[str, bytes]]) -> None:
    ensure_topic(AdminClient({"bootstrap.servers": bootstrap}), workload, TopicConfig(partitions=1))
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 2 << 20})
    for key, value in values:
        producer.produce(topic_for(workload), key=key, value=value)
    assert producer.flush(30) == 0


def _poison(workload: str, fp: str) -> list[tuple[str, bytes]]:
    return [
        ("garbage", b"\x00\x01 not a record"),
        ("bomb", _frame(256 << 20, declare=True)),
        ("tebibyte", _declares_a_tebibyte()),
        ("inf", encode(_record(workload, fp, "inf", aux=_inf()), "bf16")),
        ("token", encode(_record(workload, fp, "token", tokens=torch.full((25,), V + 7)))),
        ("wide", encode(_record(workload, fp, "wide", aux=torch.randn(24, 6 * D), hidden=torch.randn(24, 2 * D)))),
        ("elsewhere", encode(_record(workload + "-other", fp, "elsewhere"))),
        ("foreign", encode(_record(workload, "0" * 64, "foreign"))),
    ]  # fmt: skip


def test_the_consumer_counts_poison_by_reason_and_reads_past_it(kafka: KafkaBroker) -> None:
    workload = f"poison-{uuid.uuid4().hex[:6]}"
    good = [(f"ok{i}", encode(_record(workload, FP, f"ok{i}"))) for i in range(2)]
    _produce(kafka.bootstrap, workload, [good[0], *_poison(workload, FP), good[1]])
    consumer = RecordConsumer(kafka.bootstrap, [workload], f"c-{workload}", FP, shape=TargetShape(D, V))
    got: list[str] = []
    for _ in range(60):
        got += [c.record.request_id for c in consumer.poll(64, 1.0)]
        if consumer.positions.get(f"{topic_for(workload)}:0") == 10:
            break
    consumer.close()
    assert got == ["ok0", "ok1"]
    assert dict(consumer.stats.refused) == {"corrupt": 1, "oversized": 2, "non_finite": 1, "token_range": 1,
                                            "shape": 1, "workload": 1, "foreign": 1}  # fmt: skip
    assert consumer.stats.skipped == 8 and consumer.stats.foreign == 1 and consumer.stats.corrupt == 7


def _committed(bootstrap: str, group: str, topic: str) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return int(c.committed([TopicPartition(topic, 0)], timeout=10)[0].offset)
    finally:
        c.close()


def test_the_trainer_skips_poison_commits_past_it_and_rides_out_failing_services(
    kafka: KafkaBroker, tmp_path: Path
) -> None:
    target, head = _tiny()
    start = tmp_path / "start"
    tiny_draft(target).save(start)
    workload = f"trainer-{uuid.uuid4().hex[:6]}"
    fp = head.fingerprint
    good = [(f"ok{i}", encode(_record(workload, fp, f"ok{i}", held_out=i % 4 == 0, m=48))) for i in range(16)]
    # the poison comes last: nothing good after it moves the committed offset past it
    _produce(kafka.bootstrap, workload, [*good, *_poison(workload, fp)])
    end = len(good) + len(_poison(workload, fp))

    published: list[Candidate] = []
    failures = {"publish": 2, "commit": 2}

    def publish(c: Candidate) -> None:  # MLflow away for the first two calls
        if failures["publish"] > 0:
            failures["publish"] -= 1
            raise ConnectionError("MLflow is away")
        published.append(c)

    cfg = OnlineConfig(kafka.bootstrap, workload, tmp_path / "state", checkpoint_every=2, eval_every=2,
                       publish_every=2, vocab_warmup_positions=64, replay_when_idle=False, keep_candidates=2, poll_records=2,
                       backoff_first_s=0.01, backoff_cap_s=0.02, train=TrainConfig(ttt_steps=2, autocast=False))  # fmt: skip
    trainer = OnlineTrainer(cfg, head, start, publish)
    commit = trainer.consumer.commit_offsets

    def flaky_commit(offsets: dict[str, int]) -> None:  # the broker away for the first two commits
        if failures["commit"] > 0:
            failures["commit"] -= 1
            raise KafkaException(KafkaError(KafkaError._WAIT_COORD, "Waiting for coordinator"))
        commit(offsets)

    trainer.consumer.commit_offsets = flaky_commit
    with torch.no_grad():  # weights gone bad (which skipped steps should prevent): never checkpointed
        trainer.draft.lm_head.weight[0, 0] = float("nan")
    ledger = trainer.run(idle_seconds=3)
    trainer.close()

    assert ledger.records == len(good) and ledger.skipped == 8  # the foreign one too
    assert ledger.refused["oversized"] == 2 and ledger.refused["non_finite"] == 1
    # the steps on those weights were skipped, then they were put back to the start draft's
    assert ledger.nonfinite_steps >= 1 and ledger.reverts == 1
    assert ledger.outages == 4 and failures == {"publish": 0, "commit": 0}
    assert published and ledger.candidates >= 3
    assert len(list((tmp_path / "state" / "candidates").iterdir())) == 2  # retention
    # the checkpoint resumes (its weights are finite) and the offset committed is past the poison
    ckpt = load_checkpoint(tmp_path / "state" / "checkpoints")
    assert ckpt is not None and ckpt.ledger.offsets == {f"{topic_for(workload)}:0": end}
    Eagle3Draft.load(ckpt.draft_dir, head.embed, head.config, head.fingerprint, torch.float32)
    assert _committed(kafka.bootstrap, trainer_group(workload), topic_for(workload)) == end
