"""A workload's records from its topic, as whole requests, each trained once. The ledger records
every offset read (past refused messages too: poison is skipped once, not after every restart) and
the keys trained, so a record delivered again is recognised; held-out requests are kept apart."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient

from tide.models.loader import TargetHead
from tide.producers.assembler import RequestAssembler, record_key
from tide.producers.consumer import RecordConsumer
from tide.producers.records import TargetShape
from tide.producers.topics import TrafficMeter
from tide.trainers.checkpoint import Ledger
from tide.trainers.examples import example_of
from tide.trainers.ttt import Example


class WorkloadTaken(RuntimeError):
    """Another trainer is already training this workload's draft."""


def claim_workload(bootstrap: str, group: str, wait_s: float = 30.0) -> None:
    """Refuse to start while the workload's consumer group has a live member: two trainers splitting
    one workload's partitions would train two diverging copies of its draft. A member that died
    (SIGKILL) stays listed until its session times out, so a restart waits for that first."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result(timeout=15)
        except Exception:  # an unknown group is a free one
            return
        if not desc.members:
            return
        if time.monotonic() > deadline:
            raise WorkloadTaken(f"consumer group {group} already has {len(desc.members)} live member(s)")
        time.sleep(1.0)


@dataclass
class Read:
    train: list[Example]
    held_out: list[Example]  # with their labels: they only evaluate


class RecordReader:
    def __init__(
        self, bootstrap: str, workload: str, group: str, head: TargetHead, ledger: Ledger,
        poll_records: int, ledger_keys: int,
    ):  # fmt: skip
        self.head, self.ledger = head, ledger
        self.poll_records, self.ledger_keys = poll_records, ledger_keys
        shape = TargetShape(head.config.hidden_size, head.config.vocab_size)
        self.consumer = RecordConsumer(bootstrap, [workload], group, head.fingerprint, shape=shape)
        self.requests = RequestAssembler()  # the draft learns each request whole, as it serves it
        self.traffic = TrafficMeter()  # the topic's rate, for its size

    def read(self, batch_size: int, timeout: float) -> Read | None:
        """New examples from the next polls, until `batch_size` are read for training or a poll comes
        back empty (None: nothing came at all)."""
        got = self._poll(timeout)
        while got is not None and len(got.train) < batch_size:
            more = self._poll(0.0)
            if more is None:
                break
            got = Read(got.train + more.train, got.held_out + more.held_out)
        return got

    def _poll(self, timeout: float) -> Read | None:
        consumed = self.consumer.poll(self.poll_records, timeout)
        stats, ledger = self.consumer.stats, self.ledger
        ledger.skipped, ledger.refused = stats.skipped, dict(stats.refused)
        for where, position in self.consumer.positions.items():
            ledger.offsets[where] = max(ledger.offsets.get(where, 0), position)
        requests = self.requests.flush()
        if not consumed and not requests:
            return None
        for c in consumed:
            where = f"{c.topic}:{c.partition}"
            ledger.offsets[where] = max(ledger.offsets.get(where, 0), c.offset + 1)
            ledger.first_offsets.setdefault(where, c.offset)
            key = record_key(c.record)
            if key in ledger.trained:
                ledger.redeliveries += 1
                continue
            ledger.trained.add(key)
            ledger.records += 1
            self.traffic.add(c.record.created_at, c.size)
            requests += self.requests.add(c.record, where, c.offset)
        ledger.trim(self.ledger_keys)
        out = Read([], [])
        for r in requests:
            ex = example_of(r, self.head.lm_head if r.held_out else None)
            if ex is not None:
                (out.held_out if r.held_out else out.train).append(ex)
        return out

    def close(self) -> None:
        self.consumer.close()
