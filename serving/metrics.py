"""Prometheus metrics of a serving node, each app with its own registry.

Engine state (queue depth, running requests, gamma, draft version, acceptance by depth) is read
at scrape time by a collector, so the engine's hot path does no metrics work for it.

Every per-workload label is a name of the capture policy's `WorkloadSet` (counters count the rest as
`default`, gauges leave them out), so no client can grow the label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tide.producers.publisher import PublisherStats, RecordPublisher
from tide.serving.capture import DEFAULT_WORKLOAD, CapturePolicy, WorkloadSet
from tide.serving.controller import Controller
from tide.serving.draft_sync import DraftSync
from tide.serving.engine import Engine
from tide.serving.sequence import StepOutput

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


def _served(workloads: WorkloadSet | None, name: str) -> bool:
    return workloads is None or name in workloads


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, capture: CapturePolicy | None):
        self.engine = engine
        self.capture = capture
        self.workloads = capture.workloads if capture is not None else None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.engine
        yield GaugeMetricFamily("tide_queue_depth", "Requests waiting for a slot", value=len(e.waiting))
        yield GaugeMetricFamily("tide_running_requests", "Requests holding a slot", value=len(e.running))
        yield GaugeMetricFamily("tide_gamma", "Draft tokens proposed per step (0: off)", value=e.gamma)
        draft = GaugeMetricFamily(
            "tide_draft_info", "The drafts in use, by workload (value 1)", labels=["workload", "version"]
        )
        per_step = GaugeMetricFamily(
            "tide_draft_tokens_per_step",
            "Tokens per sequence step on each draft since it was swapped in",
            labels=["workload", "version"],
        )
        steps = GaugeMetricFamily(
            "tide_draft_steps",
            "Sequence steps on each draft since it was swapped in",
            labels=["workload", "version"],
        )
        for workload, slot in list(e.drafts.items()):
            if not _served(self.workloads, workload):
                continue
            draft.add_metric([workload, slot.version], 1)
            per_step.add_metric([workload, slot.version], slot.stats.mean_accept_length)
            steps.add_metric([workload, slot.version], slot.stats.steps)
        yield draft
        yield per_step
        yield steps
        rate = GaugeMetricFamily(
            "tide_accept_rate", "Acceptance rate at each draft depth since start", labels=["depth"]
        )
        for depth, r in enumerate(e.stats.rates(), start=1):
            rate.add_metric([str(depth)], r)
        yield rate
        if e.suffix is not None:
            yield from _suffix_metrics(e, self.workloads)
        if e.controller is not None:
            yield from _controller_metrics(e.controller, self.capture)
        if self.workloads is not None:
            yield GaugeMetricFamily(
                "tide_workloads", "Workload names this node serves", value=len(self.workloads.names())
            )
            yield CounterMetricFamily(
                "tide_workloads_overflow",
                "Requests served as `default`: their workload was outside the allow-list or the cap",
                value=self.workloads.overflow,
            )


def _suffix_metrics(e: Engine, workloads: WorkloadSet | None) -> Iterator[CounterMetricFamily]:
    """What each workload's suffix index proposed and what of it was accepted (the draft's own
    steps and tokens are `tide_draft_steps` and `tide_draft_tokens_per_step`)."""
    assert e.suffix is not None
    families = [
        (CounterMetricFamily("tide_suffix_chosen_steps", "Sequence steps drafted from the suffix index",
                             labels=["workload"]), "chosen"),
        (CounterMetricFamily("tide_suffix_proposed_tokens", "Tokens the suffix index proposed",
                             labels=["workload"]), "proposed_tokens"),
        (CounterMetricFamily("tide_suffix_accepted_tokens", "Suffix index tokens the target accepted",
                             labels=["workload"]), "accepted_tokens"),
    ]  # fmt: skip
    for workload, stats in list(e.suffix.stats.items()):
        if _served(workloads, workload):
            for family, field in families:
                family.add_metric([workload], getattr(stats, field))
    for family, _ in families:
        yield family
    yield CounterMetricFamily("tide_suffix_fed_requests", "Other nodes' requests indexed from the topics",
                              value=e.suffix.fed)  # fmt: skip
    yield CounterMetricFamily("tide_suffix_fed_dropped", "Requests from the topics not indexed (inbox full, "
                              "too many workloads)", value=e.suffix.fed_dropped)  # fmt: skip


def _controller_metrics(c: Controller, capture: CapturePolicy | None) -> Iterator[GaugeMetricFamily]:
    speedup = GaugeMetricFamily(
        "tide_speedup", "Speedup over no speculation: the last step's prediction, the measured average",
        labels=["kind"],
    )  # fmt: skip
    speedup.add_metric(["predicted"], c.last.predicted_speedup)
    speedup.add_metric(["measured"], c.measured_speedup)
    yield speedup
    rate = GaugeMetricFamily(
        "tide_workload_accept_rate", "Acceptance by draft depth, the controller's estimate",
        labels=["workload", "depth"],
    )  # fmt: skip
    gamma = GaugeMetricFamily(
        "tide_workload_gamma", "The gamma that pays best for the workload alone", labels=["workload"]
    )
    on = GaugeMetricFamily(
        "tide_workload_speculation", "1 where speculation pays for the workload", labels=["workload"]
    )
    captured = GaugeMetricFamily(
        "tide_workload_capture", "1 where the workload is being captured", labels=["workload"]
    )
    shifted = GaugeMetricFamily(
        "tide_workload_shifted", "1 where the last change found in acceptance was a fall", labels=["workload"]
    )
    for w, snap in c.snapshot().items():
        if capture is not None and w not in capture.workloads:
            continue
        for depth, a in enumerate(cast(list[float], snap["alpha"]), start=1):
            rate.add_metric([w, str(depth)], a)
        gamma.add_metric([w], float(cast(int, snap["gamma"])))
        on.add_metric([w], float(bool(snap["speculation"])))
        shifted.add_metric([w], float(bool(snap["shifted"])))
        if capture is not None:
            captured.add_metric([w], float(capture.active(w)))
    yield rate
    yield gamma
    yield on
    yield shifted
    yield captured


class CaptureCollector(Collector):
    """The tap's counters: a publisher's stats and how many requests it holds states of."""

    def __init__(self, read: Callable[[], tuple[PublisherStats, int]]):
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s, pending = self.read()
        for name, doc, value in (
            ("tide_capture_records_published", "Records the broker acknowledged", s.records_published),
            ("tide_capture_bytes_published", "Bytes of acknowledged records", s.bytes_published),
            (
                "tide_capture_records_dropped",
                "Records dropped: buffer full or broker away",
                s.records_dropped,
            ),
            ("tide_capture_records_failed", "Records the broker never acknowledged", s.records_failed),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "tide_capture_pending_requests",
            "Requests whose captured states wait for more positions or their end",
            value=pending,
        )


class SyncCollector(Collector):
    """What the registry follower did: swaps, rollbacks, refusals, errors, the versions followed."""

    def __init__(self, sync: DraftSync, workloads: WorkloadSet | None):
        self.sync = sync
        self.workloads = workloads

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.sync.stats
        yield CounterMetricFamily("tide_draft_swaps", "Registry versions swapped in", value=s.swaps)
        yield CounterMetricFamily(
            "tide_draft_rollbacks",
            "Versions rolled back for falling short live",
            value=self.sync.live.rollbacks,
        )
        yield CounterMetricFamily(
            "tide_registry_errors", "Registry polls or downloads that failed", value=s.registry_errors
        )
        refused = CounterMetricFamily(
            "tide_draft_refused", "Registry versions refused (checksum, weights, target)", labels=["reason"]
        )
        for reason, n in sorted(s.refused.items()):
            refused.add_metric([reason], n)
        yield refused
        following = GaugeMetricFamily(
            "tide_registry_version", "The registry version each workload's draft came from",
            labels=["workload", "model", "version"],
        )  # fmt: skip
        for workload, f in list(self.sync.following.items()):
            if not _served(self.workloads, workload):
                continue
            following.add_metric([workload, f.name, f.version], 1)
        yield following


class ServingMetrics:
    def __init__(
        self,
        engine: Engine,
        publisher: RecordPublisher | None = None,
        sync: DraftSync | None = None,
        capture: CapturePolicy | None = None,
    ):
        self.registry = CollectorRegistry()
        self.workloads = capture.workloads if capture is not None else None
        r = self.registry
        self.requests = Counter("tide_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram(
            "tide_request_latency_seconds",
            "Request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tide_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("tide_prompt_tokens", "Prompt tokens", ["workload"], registry=r)
        self.generated = Counter("tide_generated_tokens", "Generated tokens", ["workload"], registry=r)
        self.accepted_length = Histogram(
            "tide_tokens_per_step",
            "Tokens a sequence gains per target step (accepted drafts + 1)",
            buckets=tuple(range(1, engine.cfg.max_gamma + 2)),
            registry=r,
        )
        self.batch_size = Histogram(
            "tide_batch_size",
            "Running sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.aborted = Counter("tide_client_disconnects", "Requests whose client went away", registry=r)
        self.rejected = Counter("tide_rejected_requests", "Requests refused", ["reason"], registry=r)
        r.register(_EngineCollector(engine, capture))
        if publisher is not None:
            r.register(CaptureCollector(lambda: (publisher.stats, len(publisher.pending_requests))))
        if sync is not None:
            r.register(SyncCollector(sync, self.workloads))

    def workload(self, name: str) -> str:
        """A workload's label: its name if served here, else `default`."""
        return name if _served(self.workloads, name) else DEFAULT_WORKLOAD

    def observe_step(self, outputs: list[StepOutput]) -> None:
        decoded = 0
        for out in outputs:
            self.generated.labels(self.workload(out.seq.workload)).inc(len(out.new_tokens))
            if out.accepted is not None:
                self.accepted_length.observe(out.accepted + 1)
                decoded += 1
        if decoded:
            self.batch_size.observe(decoded)

    def render(self) -> bytes:
        return generate_latest(self.registry)
