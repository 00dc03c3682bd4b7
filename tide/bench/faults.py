"""`tide bench faults`: the whole stack under steady load while a schedule breaks its parts.

`tide up`'s stack (Kafka, S3, MLflow, a trainer per workload, the gate, a serving node) serves a few
well-formed clients (mixed workloads, half of them streaming) and one hostile client, while the
schedule restarts the broker, MLflow and S3, SIGKILLs a trainer and the gate, writes poison and
foreign records into a topic, and makes a tampered and a NaN version champion by hand. The stack
revives what dies, as `tide up` does. The report says what every client got, whether any record
was lost or trained twice, every change of champion and its cause, whether a refused version was
ever served, latency with and without faults, and each process's memory after warm-up and at the end.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import zstandard
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from tide.bench import cpu_description
from tide.prompts import WORKLOADS, Prompt, load_prompts
from tide.registry.tags import VersionTags, source_tags

log = logging.getLogger("tide.bench")
INJECTED_TAG = "faults.injected"  # marks the versions the bench made champion by hand


@dataclass
class FaultsBenchConfig:
    minutes: float = 10.0
    clients: int = 3  # well-formed clients, each with one request in flight
    workloads: dict[str, Path] = field(
        default_factory=lambda: {
            "default": WORKLOADS / "chat_en.jsonl",
            "code": WORKLOADS / "code.jsonl",
        }
    )
    max_tokens: int = 48
    hostile_every: float = 3.0  # seconds between hostile requests
    warmup_seconds: float = 60.0  # before the first fault; RSS is read at its end
    fault_window: float = 30.0  # a request started this long after a fault counts as "with faults"
    draft: Path | None = None  # the starting draft (default: the default draft)
    model: str | None = None
    work_dir: Path | None = None  # default: a temporary folder, removed afterwards
    seed: int = 0


@dataclass
class Call:
    start: float  # seconds since the load started
    seconds: float
    status: str  # HTTP status, "stream_error" or "transport"
    hostile: bool
    kind: str  # the hostile request's kind, or the workload


@dataclass
class Fault:
    name: str
    start: float
    end: float
    detail: str = ""


# -- hostile requests ---------------------------------------------------------------------------------
def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hostile_requests() -> list[tuple[str, Callable[[int], tuple[dict[str, str], bytes]]]]:
    """(kind, i -> (headers, body)): each of the hostile findings of issue 30, and their neighbours."""
    chat = {"model": "tide", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}

    def body(**kw: Any) -> Callable[[int], tuple[dict[str, str], bytes]]:
        return lambda i: ({}, json.dumps({**chat, **kw}).encode())

    return [
        ("top_k_2^63", body(top_k=2**63)),
        ("nested_json", lambda i: ({}, _nested(100_000))),
        ("workload_name", lambda i: ({"X-Tide-Workload": f"hostile-{i}"}, json.dumps(chat).encode())),
        ("bad_json", lambda i: ({}, b'{"model": "tide", "messages": [')),
        ("huge_max_tokens", body(max_tokens=10**12)),
        ("huge_seed", body(seed=2**80)),
        ("negative_temperature", body(temperature=-1)),
        ("nan_top_p", lambda i: ({}, json.dumps({**chat, "top_p": float("nan")}).encode())),
        ("many_stops", body(stop=["x"] * 100)),
        (
            "prompt_ids_out_of_range",
            lambda i: ({}, json.dumps({"model": "tide", "prompt": [10**9]}).encode()),
        ),
        ("not_an_object", lambda i: ({}, b"[1, 2, 3]")),
        ("oversized_body", lambda i: ({}, json.dumps({**chat, "pad": "x" * (2 << 20)}).encode())),
    ]


# -- the load ------------------------------------------------------------------------------------------
class Load:
    """Well-formed clients in threads, one request in flight each, and a hostile client."""

    def __init__(self, endpoint: str, cfg: FaultsBenchConfig):
        self.endpoint = endpoint
        self.cfg = cfg
        self.prompts: dict[str, list[Prompt]] = {w: load_prompts(p) for w, p in cfg.workloads.items()}
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(cfg.clients)
        ]
        self.threads.append(threading.Thread(target=self._hostile, name="hostile", daemon=True))

    def start(self) -> None:
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _record(self, call: Call) -> None:
        with self.lock:
            self.calls.append(call)

    def _client(self, i: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + i)
        workloads = sorted(self.prompts)
        with httpx.Client(base_url=self.endpoint, timeout=300) as http:
            n = 0
            while not self.stop.is_set():
                w = workloads[(i + n) % len(workloads)]
                prompt = rng.choice(self.prompts[w])
                stream = n % 2 == 1
                body = {"model": "tide", "messages": prompt.messages, "max_tokens": self.cfg.max_tokens,
                        "temperature": 0.0 if n % 3 else 0.8, "stream": stream}  # fmt: skip
                start = time.monotonic()
                status = self._send(http, {"X-Tide-Workload": w}, json.dumps(body).encode(), stream)
                self._record(Call(start - self.t0, time.monotonic() - start, status, False, w))
                if status != "200":
                    time.sleep(0.5)  # a client backs off; a 429 says so
                n += 1

    def _hostile(self) -> None:
        kinds = hostile_requests()
        with httpx.Client(base_url=self.endpoint, timeout=120) as http:
            i = 0
            while not self.stop.wait(self.cfg.hostile_every):
                kind, make = kinds[i % len(kinds)]
                headers, body = make(i)
                start = time.monotonic()
                status = self._send(http, headers, body, stream=False)
                self._record(Call(start - self.t0, time.monotonic() - start, status, True, kind))
                i += 1

    @staticmethod
    def _send(http: httpx.Client, headers: dict[str, str], body: bytes, stream: bool) -> str:
        headers = {"Content-Type": "application/json", **headers}
        try:
            if not stream:
                return str(http.post("/v1/chat/completions", content=body, headers=headers).status_code)
            with http.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    return str(r.status_code)
                done = False
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"error"' in line[:12]:
                        return "stream_error"
                    done = done or line == "data: [DONE]"
                return "200" if done else "stream_cut"
        except httpx.HTTPError:
            return "transport"


# -- watching the node and the registry ----------------------------------------------------------------
class Watcher:
    """Polls the node's /health (which drafts it serves) and every workload's champion."""

    def __init__(self, endpoint: str, registry: str, names: dict[str, str], t0: float):
        self.endpoint, self.registry, self.names, self.t0 = endpoint, registry, names, t0
        self.served: dict[str, float] = {}  # draft version -> first seen
        self.champions: list[dict[str, Any]] = []
        self.health: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="watcher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(self.registry)
        last: dict[str, str | None] = {}
        tick = 0
        while not self.stop.wait(1.0):
            now = time.monotonic() - self.t0
            try:
                h = httpx.get(f"{self.endpoint}/health", timeout=5).json()
                self.health[str(h.get("status"))] += 1
                for v in (h.get("drafts") or {}).values():
                    self.served.setdefault(str(v), now)
            except (httpx.HTTPError, ValueError):
                self.health["unreachable"] += 1
            tick += 1
            if tick % 2:
                continue
            for w, name in self.names.items():
                try:
                    mv = client.get_model_version_by_alias(name, "champion")
                except Exception:  # registry away or no champion yet: try again
                    continue
                if last.get(w) != mv.version:
                    self.champions.append({"t": round(now, 1), "workload": w, "version": mv.version,
                                           "from": last.get(w), "cause": _cause(mv.tags or {})})  # fmt: skip
                    last[w] = mv.version


def _cause(tags: dict[str, str]) -> str:
    if INJECTED_TAG in tags:
        return f"by hand: {tags[INJECTED_TAG]}"
    read = VersionTags.from_tags(tags)
    if read.recall is not None:
        return f"gate recall: {read.recall.reason}".strip()
    if read.rollback is not None:
        return "node rollback"
    if read.verdict is not None and read.verdict.decision == "promoted":
        return f"gate: {read.verdict.reason or 'promoted'}"
    return read.source or "registered"


# -- the faults ----------------------------------------------------------------------------------------
def _poison_records(bootstrap: str, workload: str, fingerprint: str, d: int, vocab: int) -> str:
    """Garbage, a decompression bomb, records with inf states, out-of-range tokens, wrong widths,
    another target's fingerprint and another workload's name, written straight into the topic."""
    from confluent_kafka import Producer

    from tide.names import topic_for
    from tide.producers.records import HiddenStateRecord, encode

    def record(**over: Any) -> HiddenStateRecord:
        m = 8
        base: dict[str, Any] = dict(
            tokens=torch.randint(0, vocab, (m + 1,)), aux=torch.randn(m, 3 * d), hidden=torch.randn(m, d),
            prefill=torch.zeros(m, dtype=torch.bool), target_fingerprint=fingerprint, draft_version="faults",
            workload=workload, request_id=f"poison{random.getrandbits(40):x}", chunk=0, first_position=0,
            last=True,
        )  # fmt: skip
        base.update(over)
        return HiddenStateRecord(**base)

    inf_aux = torch.randn(8, 3 * d)
    inf_aux[3, 5] = float("inf")
    wide = 3 * (d + 64)
    bad = {
        "garbage": os.urandom(4096),
        "zstd_bomb": zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20)),
        "inf_state": encode(record(aux=inf_aux), codec="bf16"),
        "token_out_of_range": encode(record(tokens=torch.full((9,), vocab + 7))),
        "wrong_width": encode(record(aux=torch.randn(8, wide), hidden=torch.randn(8, d + 64))),
        "foreign_target": encode(record(target_fingerprint="f" * 64)),
        "other_workload": encode(record(workload=f"{workload}-other")),
    }
    p = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 8 << 20})
    for name, value in bad.items():
        p.produce(topic_for(workload), key=f"poison-{name}".encode(), value=value)
    p.flush(30)
    return ", ".join(bad)


def _bad_version(stack: Any, fingerprint: str, workload: str, kind: str, draft_dir: Path) -> str:
    """Register a copy of the starting draft that must be refused, and make it champion by hand:
    `nan` (a NaN weight, checksums right) or `tampered` (weights changed in the store after tagging)."""
    from mlflow import MlflowClient

    from tide.registry.store import register_folder
    from tide.stack import as_account

    client = MlflowClient(stack.registry)
    tmp = Path(tempfile.mkdtemp(prefix=f"faults-{kind}-"))
    try:
        folder = tmp / "draft"
        shutil.copytree(draft_dir, folder)
        marker = f"faults-{kind}-{int(time.time())}"
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["version"] = marker
        cfg_path.write_text(json.dumps(cfg, indent=2))
        weights = folder / "model.safetensors"
        if kind == "nan":
            tensors = load_file(weights)
            name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
            tensors[name].view(-1)[0] = float("nan")
            save_file(tensors, weights, metadata={"format": "pt"})
        with as_account(stack.role_env.get("trainer", {})):  # who can write drafts: an operator, a trainer
            mv = register_folder(
                client,
                fingerprint,
                workload,
                folder,
                {INJECTED_TAG: kind, **source_tags("tide bench faults")},
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if kind == "tampered":  # the stored weights change after their checksum was tagged
        stored = [
            p
            for p in Path(stack.cfg.data_dir, "s3").rglob("model.safetensors")
            if mv.run_id and mv.run_id in str(p)
        ]
        if not stored:
            raise RuntimeError(f"could not find version {mv.version}'s weights in the S3 store")
        blob = bytearray(stored[0].read_bytes())
        for i in range(len(blob) - 64, len(blob) - 32):
            blob[i] ^= 0x5A
        stored[0].write_bytes(bytes(blob))
    client.set_registered_model_alias(mv.name, "champion", mv.version)
    return f"{mv.name} v{mv.version} ({marker})"


def _kill(stack: Any, name: str) -> str:
    part = next(p for p in stack.parts if p.name == name)
    os.killpg(part.proc.pid, signal.SIGKILL)
    return f"pid {part.proc.pid}"


# -- memory --------------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float | None:
    """Resident memory of a process and its descendants (a part's session), in MB."""
    total, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            if p == pid:
                return None
            continue
        todo += [int(c) for c in children]
    return total / 1024


def _pids(stack: Any) -> dict[str, int]:
    """Each part's and service's current process (a revived one has a new pid)."""
    out = {p.name: p.proc.pid for p in stack.parts}
    for s in stack.services:
        if s.process is not None:
            out[type(s).__name__] = s.process.pid
    return out


@dataclass
class MemoryWatch:
    """Each process's RSS once it has run `warmup` seconds, against its RSS at the end. A process
    revived by the stack is a new one: it is measured from its own warm-up, not its predecessor's."""

    warmup: float
    first_seen: dict[int, float] = field(default_factory=dict)
    warm: dict[int, float | None] = field(default_factory=dict)  # by pid

    def tick(self, stack: Any, now: float) -> None:
        for pid in _pids(stack).values():
            seen = self.first_seen.setdefault(pid, now)
            if pid not in self.warm and now - seen >= self.warmup:
                self.warm[pid] = _rss_mb(pid)

    def report(self, stack: Any) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, pid in _pids(stack).items():
            warm, end = self.warm.get(pid), _rss_mb(pid)
            growth = round(end / warm - 1, 3) if warm and end else None
            out[name] = {"pid": pid, "after_warmup": warm, "end": end, "growth": growth,
                         "since": round(self.first_seen.get(pid, 0.0), 1)}  # fmt: skip
        return out


# -- the records' accounting -------------------------------------------------------------------------
def _topic_keys(
    bootstrap: str, workload: str, fingerprint: str, shape: Any
) -> tuple[Counter[str], dict[str, str], int]:
    """Every usable record of the workload's topic by (request, chunk), where each first is
    ("topic:partition@offset"), and how many were not usable."""
    from confluent_kafka import Consumer, TopicPartition

    from tide.names import topic_for
    from tide.producers.assembler import record_key
    from tide.producers.records import RecordError, decode

    topic = topic_for(workload)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-audit-{time.time_ns()}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "fetch.message.max.bytes": 8 << 20})  # fmt: skip
    keys: Counter[str] = Counter()
    where: dict[str, str] = {}
    refused = 0
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        tps = [TopicPartition(topic, p) for p in meta.partitions]
        ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
        c.assign(tps)
        left = {p for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + 120
        while left and time.monotonic() < deadline:
            for m in c.consume(500, 2.0):
                part, offset = m.partition(), m.offset()
                if m.error() is not None or part is None or offset is None:
                    continue
                if offset + 1 >= ends[part]:
                    left.discard(part)
                try:
                    key = record_key(decode(m.value() or b"", fingerprint, shape, workload))
                    keys[key] += 1
                    where.setdefault(key, f"{topic}:{part}@{offset}")
                except (RecordError, ValueError):
                    refused += 1
    finally:
        c.close()
    return keys, where, refused


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "n": 0}
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"p50": round(1000 * statistics.median(xs), 1), "p99": round(1000 * q[98], 1), "n": len(xs)}


# -- the run -------------------------------------------------------------------------------------------
def run_faults_bench(cfg: FaultsBenchConfig) -> dict[str, Any]:
    from tide.config import default_draft_dir
    from tide.models.loader import load_head
    from tide.names import model_name
    from tide.producers.records import TargetShape
    from tide.stack import Stack, StackConfig

    work = cfg.work_dir or Path(tempfile.mkdtemp(prefix="tide-bench-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    head = load_head(cfg.model)
    fp, d, vocab = head.fingerprint, head.config.hidden_size, head.config.vocab_size
    workloads = list(cfg.workloads)
    stack = Stack(StackConfig(work, port=_free(), mlflow_port=_free(), workloads=workloads, s3=True,
                              draft=cfg.draft, model=cfg.model))  # fmt: skip
    faults: list[Fault] = []
    try:
        for step in tqdm(stack.steps(), desc="starting the stack", unit="part"):
            stack.start_step(step)
        draft_dir = cfg.draft or default_draft_dir(fp)
        s3 = next(s for s in stack.services if type(s).__name__ == "S3Server")
        w0 = workloads[0]
        schedule: list[tuple[str, Callable[[], str]]] = [
            ("poison records", lambda: _poison_records(stack.bootstrap, w0, fp, d, vocab)),
            ("broker restart", lambda: (stack.kafka.restart(), "")[1]),  # type: ignore[union-attr]
            (f"SIGKILL trainer:{w0}", lambda: _kill(stack, f"trainer:{w0}")),
            ("tampered champion", lambda: _bad_version(stack, fp, w0, "tampered", draft_dir)),
            ("MLflow restart", lambda: (stack.mlflow.restart(), "")[1]),  # type: ignore[union-attr]
            ("SIGKILL gate", lambda: _kill(stack, "gate")),
            ("NaN champion", lambda: _bad_version(stack, fp, workloads[-1], "nan", draft_dir)),
            ("S3 restart", lambda: (s3.restart(), "")[1]),
            ("foreign records", lambda: _poison_records(stack.bootstrap, workloads[-1], fp, d, vocab)),
        ]
        total = cfg.minutes * 60
        span = total - cfg.warmup_seconds - 60  # the last minute runs without new faults
        at = [cfg.warmup_seconds + span * i / len(schedule) for i in range(len(schedule))]
        load = Load(stack.endpoint, cfg)
        watcher = Watcher(stack.endpoint, stack.registry, {w: model_name(fp, w) for w in workloads}, load.t0)
        load.start()
        watcher.t0 = load.t0
        watcher.start()
        memory = MemoryWatch(cfg.warmup_seconds)
        with tqdm(total=round(total), desc="load under faults", unit="s") as bar:
            while (now := time.monotonic() - load.t0) < total:
                stack.revive()  # what `tide up` does: a part that died starts again
                memory.tick(stack, now)
                if at and now >= at[0]:
                    at.pop(0)
                    name, inject = schedule.pop(0)
                    bar.set_postfix_str(name)
                    start = time.monotonic() - load.t0
                    try:
                        detail = inject()
                    except Exception as e:  # a fault that could not be injected is reported, not fatal
                        log.exception("fault %s", name)
                        detail = f"not injected: {type(e).__name__}: {e}"
                    faults.append(Fault(name, start, time.monotonic() - load.t0, detail))
                bar.n = round(min(now, total))
                bar.refresh()
                time.sleep(0.5)
        rss = memory.report(stack)
        load.join()
        watcher.join()
        records = _audit_records(stack, workloads, fp, TargetShape(d, vocab))
    finally:
        stack.stop()
        if cfg.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return _report(cfg, load.calls, faults, watcher, records, rss)


def _free() -> int:
    from tide.infra.process import free_port

    return free_port()


def _audit_records(stack: Any, workloads: list[str], fp: str, shape: Any) -> dict[str, Any]:
    """After the load: let each trainer catch up and checkpoint, then hold its ledger against its topic."""
    from tide.infra.process import stop_groups

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the trainers read what is left (their lag falls to 0)
        stack.revive()
        lags = [_lag(stack.bootstrap, w) for w in workloads]
        if all(lag == 0 for lag in lags):
            break
        time.sleep(5)
    for p in list(stack.parts):  # a trainer stopped by SIGTERM checkpoints what it has read
        if p.name.startswith("trainer:"):
            stop_groups([p.proc], 120)
            stack.parts.remove(p)
    return count_records(stack.bootstrap, {w: stack.trainer_state_dir(w) for w in workloads}, fp, shape)


def count_records(bootstrap: str, state_dirs: dict[str, Path], fp: str, shape: Any) -> dict[str, Any]:
    """Each workload's topic against its trainer's checkpointed ledger (trainers stopped)."""
    from tide.trainers.checkpoint import Ledger, checkpoints_dir, load_ledger

    out: dict[str, Any] = {"published": 0, "trained": 0, "lost": 0, "unread": 0, "trained_twice": 0,
                           "delivered_twice": 0, "refused_in_topic": 0, "by_workload": {}}  # fmt: skip
    for w, state_dir in state_dirs.items():
        keys, where, refused = _topic_keys(bootstrap, w, fp, shape)
        ledger = load_ledger(checkpoints_dir(state_dir)) or Ledger()
        trained = set(ledger.trained)
        # past the checkpoint's offsets: not lost, its trainer reads it when it runs again
        unread = {
            k for k in set(keys) - trained if _offset(where[k]) >= ledger.offsets.get(_partition(where[k]), 0)
        }
        row = {
            "published": len(keys),
            "trained": len(trained & set(keys)),
            "lost": len(set(keys) - trained - unread),  # the checkpoint went past it and never trained it
            "unread": len(unread),
            # the ledger counts a record each time it is trained, and holds its key once (or forgets
            # the oldest keys past its retention)
            "trained_twice": ledger.records - len(trained) - ledger.forgotten,
            "forgotten": ledger.forgotten,
            "delivered_twice": sum(n - 1 for n in keys.values()),
            "refused_in_topic": refused,
            "skipped_by_trainer": ledger.skipped,
        }
        out["by_workload"][w] = row
        for k in (
            "published",
            "trained",
            "lost",
            "unread",
            "trained_twice",
            "delivered_twice",
            "refused_in_topic",
        ):
            out[k] += row[k]
    return out


def _partition(where: str) -> str:
    return where.rpartition("@")[0]


def _offset(where: str) -> int:
    return int(where.rpartition("@")[2])


def _lag(bootstrap: str, workload: str) -> int | None:
    from tide.names import topic_for, trainer_group
    from tide.stack import _lag as group_lag

    try:
        return group_lag(bootstrap, trainer_group(workload), topic_for(workload))
    except Exception:
        return None


def _report(
    cfg: FaultsBenchConfig, calls: list[Call], faults: list[Fault], watcher: Watcher, records: dict[str, Any],
    rss: dict[str, dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    def near_fault(c: Call) -> bool:
        return any(f.start <= c.start <= f.end + cfg.fault_window for f in faults)

    ok = [c for c in calls if not c.hostile and c.status == "200"]
    well = Counter(c.status for c in calls if not c.hostile)
    hostile = Counter(c.status for c in calls if c.hostile)
    hostile_by_kind: dict[str, Counter[str]] = {}
    for c in calls:
        if c.hostile:
            hostile_by_kind.setdefault(c.kind, Counter())[c.status] += 1
    injected = [v for v in watcher.served if v.startswith("faults-")]
    return {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k != "workloads"
        }
        | {"workloads": {w: str(p) for w, p in cfg.workloads.items()}},
        "cpu": cpu_description(),
        "requests": {
            "well_formed": dict(well),
            "hostile": dict(hostile),
            "hostile_by_kind": {k: dict(v) for k, v in hostile_by_kind.items()},
        },
        "well_formed_failed": sum(n for s, n in well.items() if s not in ("200", "429")),
        "hostile_5xx": sum(n for s, n in hostile.items() if s.startswith("5") or not s.isdigit()),
        "records": records,
        "faults": [asdict(f) for f in faults],
        "champions": watcher.champions,
        "served_versions": sorted(watcher.served),
        "served_refused_versions": injected,
        "health": dict(watcher.health),
        "latency_ms": {
            "with_faults": _percentiles([c.seconds for c in ok if near_fault(c)]),
            "without_faults": _percentiles([c.seconds for c in ok if not near_fault(c)]),
        },
        "rss_mb": rss,
        "timeline": [asdict(c) for c in calls],
    }


def plot_faults_report(report: dict[str, Any], path: Path) -> None:
    """Load (requests per 10 s by outcome), latency of well-formed requests, and when each fault struck."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = report["timeline"]
    end = max((c["start"] for c in calls), default=0.0) + 10
    bins = [10.0 * i for i in range(int(end // 10) + 1)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    series = {
        "well-formed 200": lambda c: not c["hostile"] and c["status"] == "200",
        "well-formed 429": lambda c: not c["hostile"] and c["status"] == "429",
        "well-formed failed": lambda c: not c["hostile"] and c["status"] not in ("200", "429"),
        "hostile, answered 4xx": lambda c: c["hostile"] and c["status"].startswith("4"),
        "hostile, 200 (unknown workload names: served as default)": lambda c: (
            c["hostile"] and c["status"] == "200"
        ),
        "hostile, other": lambda c: c["hostile"] and c["status"][0] not in "24",
    }
    for label, keep in series.items():
        xs = [c["start"] for c in calls if keep(c)]
        if xs:
            counts = [sum(1 for x in xs if b <= x < b + 10) / 10 for b in bins]
            ax1.step(bins, counts, where="post", label=label)
    ax1.set_ylabel("requests/s (10 s bins)")
    ax1.legend(loc="upper right", fontsize=8)
    ok = [c for c in calls if not c["hostile"] and c["status"] == "200"]
    ax2.scatter([c["start"] for c in ok], [1000 * c["seconds"] for c in ok], s=4, alpha=0.6)
    ax2.set_yscale("log")
    ax2.set_ylabel("latency of well-formed requests (ms)")
    ax2.set_xlabel("seconds since the load started")
    for f in report["faults"]:
        for ax in (ax1, ax2):
            ax.axvspan(f["start"], max(f["end"], f["start"] + 2), color="red", alpha=0.15)
        ax1.annotate(f["name"], (f["start"], ax1.get_ylim()[1]), rotation=90, fontsize=7, va="top")
    lat = report["latency_ms"]
    fig.suptitle(
        f"tide bench faults: {report['well_formed_failed']} well-formed failed, "
        f"p99 {lat['with_faults']['p99']} ms with faults / {lat['without_faults']['p99']} ms without"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
