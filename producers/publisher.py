"""Publishes the engine's tapped hidden states to Kafka without ever holding up a request.

The engine calls the publisher (its tap) on its own thread. The call appends the states to the
request's pending chunk and, once a chunk is full or the request ends, encodes it right there: the
tensor work is about a millisecond per 128 positions on the engine's thread, where it does not fight
the engine's own OpenMP threads for the cores (on a second thread it slowed both several-fold).
The encoded bytes go on a bounded queue; a worker thread hands them to librdkafka, whose own
bounded buffer drops (BufferError, counted) rather than blocks. A workload's first record starts the
creation of its topic on another thread and waits, with the workload's next ones, until it is done:
creating a topic takes the broker a while (or the broker is away), and other workloads' records keep
flowing meanwhile. Delivery reports arrive on a polling thread. Messages are keyed by request id, so
one request's chunks land in one partition, in order.

A request the engine ends from outside (its client left, its step failed) is published as far as it
got at once (the engine taps its end); one that falls silent otherwise is, after `idle_flush_s`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from tide.names import topic_for
from tide.producers.records import CODECS, DEFAULT_CODEC, HiddenStateRecord, encode
from tide.producers.tap import TapEvent
from tide.producers.topics import TopicConfig, ensure_topic

log = logging.getLogger("tide.producers")


@dataclass
class PublisherConfig:
    bootstrap: str
    codec: str = DEFAULT_CODEC
    chunk_positions: int = 128
    queue_records: int = 256  # encoded records waiting for the worker
    buffer_kbytes: int = 64 * 1024  # librdkafka's in-memory buffer
    delivery_timeout_ms: int = 30_000  # a record not delivered by then is counted as failed
    idle_flush_s: float = 30.0  # a request silent this long (its client left) is flushed as it is
    topic_retry_s: float = 5.0  # after a topic could not be created, its records are dropped this long
    topics: TopicConfig = field(default_factory=TopicConfig)


@dataclass
class PublisherStats:
    records_published: int = 0
    bytes_published: int = 0
    records_dropped: int = 0  # a queue or buffer was full, or the topic unavailable: never sent
    records_failed: int = 0  # sent, but the broker did not acknowledge in time


@dataclass
class _Outgoing:
    workload: str
    key: bytes
    value: bytes


@dataclass
class _TopicReady:
    """A topic creation finished (error: why it failed)."""

    workload: str
    error: str | None


@dataclass
class _Pending:
    """A request's positions not yet published, as the steps delivered them: one concatenation per
    chunk published, not one per step."""

    workload: str
    draft_version: str
    first_position: int
    tokens: list[torch.Tensor]  # the first part holds one token more than positions: the next input
    aux: list[torch.Tensor]
    hidden: list[torch.Tensor]
    prefill: list[torch.Tensor]
    held_out: bool = False
    positions: int = 0
    chunk: int = 0
    touched: float = field(default_factory=time.monotonic)


class RecordPublisher:
    def __init__(self, cfg: PublisherConfig, target_fingerprint: str):
        if cfg.codec not in CODECS:
            raise ValueError(f"unknown codec {cfg.codec!r}; choose one of {', '.join(CODECS)}")
        self.cfg = cfg
        self.fingerprint = target_fingerprint
        self.stats = PublisherStats()
        self._stats_lock = threading.Lock()
        self.producer = Producer(
            {
                "bootstrap.servers": cfg.bootstrap,
                "enable.idempotence": True,
                "linger.ms": 20,
                "queue.buffering.max.kbytes": cfg.buffer_kbytes,
                "message.max.bytes": cfg.topics.max_message_bytes,
                "message.timeout.ms": cfg.delivery_timeout_ms,
                "compression.type": "none",  # records are zstd-compressed already where it pays
                "logger": log,  # librdkafka's complaints go through logging, not raw stderr
            }
        )
        self.admin = AdminClient({"bootstrap.servers": cfg.bootstrap, "logger": log})  # type: ignore[dict-item]
        # the worker's own: topics known to exist, records waiting for theirs, failed creations
        self._topics: set[str] = set()
        self._parked: dict[str, list[_Outgoing]] = {}  # a workload here has its topic being created
        self._retry_at: dict[str, float] = {}  # workload -> when its topic's creation may be tried again
        self._creator = ThreadPoolExecutor(2, thread_name_prefix="topic-create")
        self._out: queue.Queue[_Outgoing | _TopicReady | None] = queue.Queue(cfg.queue_records)
        self._pending: dict[str, _Pending] = {}
        self._pending_lock = threading.Lock()  # the engine's thread, and the worker's idle flush
        self._stopped = threading.Event()
        self._worker = threading.Thread(target=self._work, name="record-publisher", daemon=True)
        self._poller = threading.Thread(target=self._poll, name="kafka-poll", daemon=True)
        self._worker.start()
        self._poller.start()

    @property
    def pending_requests(self) -> frozenset[str]:
        """Requests whose states are held here, waiting for more positions or their end."""
        with self._pending_lock:
            return frozenset(self._pending)

    # -- the engine's side: accumulate, encode full chunks, enqueue ------------------------------
    def __call__(self, ev: TapEvent) -> None:
        try:
            with self._pending_lock:
                self._add(ev)
        except Exception:  # capture must never break serving
            log.exception("could not capture a tap event")

    def _add(self, ev: TapEvent) -> None:
        n = len(ev.aux)
        if n == 0:  # the request ended on a token it does not keep (EOS): publish what it has
            p = self._pending.pop(ev.request_id, None)
            if ev.final and p is not None and p.positions:
                self._send(ev.request_id, p, p.positions, last=True)
            return
        flags = torch.full((n,), ev.prefill, dtype=torch.bool)
        # the engine's tensors are slices of its step outputs, which it never writes again
        aux, hidden = ev.aux.to(torch.bfloat16), ev.hidden.to(torch.bfloat16)
        p = self._pending.get(ev.request_id)
        if p is None:
            p = _Pending(
                ev.workload, ev.draft_version, ev.first_position, [ev.tokens], [aux], [hidden], [flags],
                held_out=ev.held_out,
            )  # fmt: skip
            self._pending[ev.request_id] = p
        else:
            p.tokens.append(ev.tokens[1:])  # events overlap by one token
            p.aux.append(aux)
            p.hidden.append(hidden)
            p.prefill.append(flags)
            p.draft_version = ev.draft_version
            p.touched = time.monotonic()
        p.positions += n
        c = self.cfg.chunk_positions
        while p.positions >= c and not (ev.final and p.positions == c):
            self._send(ev.request_id, p, c, last=False)
        if ev.final:
            self._send(ev.request_id, p, p.positions, last=True)
            del self._pending[ev.request_id]

    def _send(self, request_id: str, p: _Pending, n: int, last: bool) -> None:
        tokens, aux, hidden, prefill = (torch.cat(x) for x in (p.tokens, p.aux, p.hidden, p.prefill))
        record = HiddenStateRecord(
            tokens=tokens[: n + 1],
            aux=aux[:n],
            hidden=hidden[:n],
            prefill=prefill[:n],
            target_fingerprint=self.fingerprint,
            draft_version=p.draft_version,
            workload=p.workload,
            request_id=request_id,
            chunk=p.chunk,
            first_position=p.first_position,
            last=last,
            held_out=p.held_out,
        )
        p.tokens, p.aux, p.hidden, p.prefill = [tokens[n:]], [aux[n:]], [hidden[n:]], [prefill[n:]]
        p.positions -= n
        p.chunk += 1
        p.first_position += n
        try:
            self._out.put_nowait(_Outgoing(p.workload, request_id.encode(), encode(record, self.cfg.codec)))
        except queue.Full:
            self._count(records_dropped=1)

    # -- worker: topics and librdkafka -------------------------------------------------------------
    def _work(self) -> None:
        next_idle_check = time.monotonic() + 1.0
        while True:
            if time.monotonic() >= next_idle_check:  # on the clock: steady traffic never lets `get` time out
                next_idle_check = time.monotonic() + 1.0
                try:
                    self._flush_idle()
                except Exception:
                    log.exception("could not flush silent requests")
            try:
                item = self._out.get(timeout=1.0)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                self._handle(item)
            except Exception:  # a bug here must not take capture down for everyone
                log.exception("could not publish a record")
            finally:
                self._out.task_done()

    def _flush_idle(self) -> None:
        """A request that went silent (its client left mid-way) is published as far as it got."""
        now = time.monotonic()
        with self._pending_lock:
            for rid, p in list(self._pending.items()):
                if now - p.touched > self.cfg.idle_flush_s:
                    if p.positions:
                        self._send(rid, p, p.positions, last=True)
                    del self._pending[rid]

    def _handle(self, item: _Outgoing | _TopicReady) -> None:
        if isinstance(item, _TopicReady):
            self._topic_ready(item)
            return
        topic = topic_for(item.workload)
        if topic in self._topics:
            self._produce(topic, item)
        elif item.workload in self._parked:  # behind the records already waiting for the topic
            self._park(item)
        elif time.monotonic() < self._retry_at.get(item.workload, 0.0):
            self._count(records_dropped=1)  # the broker was away a moment ago: do not ask per record
        else:
            self._parked[item.workload] = []
            self._park(item)
            self._creator.submit(self._create_topic, item.workload)

    def _park(self, item: _Outgoing) -> None:
        if sum(len(v) for v in self._parked.values()) >= self.cfg.queue_records:
            self._count(records_dropped=1)
        else:
            self._parked[item.workload].append(item)

    def _create_topic(self, workload: str) -> None:
        """On a creator thread: the worker hears the outcome through its queue, in order."""
        error = None
        try:
            ensure_topic(self.admin, workload, self.cfg.topics, timeout=5.0)
        except KafkaException as e:
            error = str(e.args[0])
        except Exception as e:  # whatever it was, the worker must hear of it, or its records wait forever
            error = repr(e)
        self._out.put(_TopicReady(workload, error))

    def _topic_ready(self, ready: _TopicReady) -> None:
        parked = self._parked.pop(ready.workload, [])
        topic = topic_for(ready.workload)
        if ready.error is not None:
            log.warning("topic %s unavailable (%s); dropping its records for now", topic, ready.error)
            self._retry_at[ready.workload] = time.monotonic() + self.cfg.topic_retry_s
            self._count(records_dropped=len(parked))
            return
        self._retry_at.pop(ready.workload, None)
        self._topics.add(topic)
        for item in parked:
            self._produce(topic, item)

    def _produce(self, topic: str, item: _Outgoing) -> None:
        try:
            self.producer.produce(
                topic,
                key=item.key,
                value=item.value,
                on_delivery=functools.partial(self._delivered, len(item.value)),
            )
        except BufferError:
            self._count(records_dropped=1)
        except KafkaException:
            log.warning("record refused by the client library")
            self._count(records_dropped=1)

    def _delivered(self, size: int, err: object, _msg: object) -> None:
        if err is None:
            self._count(records_published=1, bytes_published=size)
        else:
            self._count(records_failed=1)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _poll(self) -> None:
        while not self._stopped.is_set():
            self.producer.poll(0.1)

    # -- lifecycle ----------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> int:
        """Wait until queued events are handled (topics being created included) and librdkafka has
        delivered; returns messages unsent."""
        deadline = time.monotonic() + timeout
        while (self._out.unfinished_tasks or self._parked) and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(self.producer.flush(max(0.0, deadline - time.monotonic())))

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._out.put(None)
        self._worker.join(timeout)
        self._creator.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        self._poller.join(timeout)
