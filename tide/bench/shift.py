"""`tide bench shift`: a workload shift served by no speculation, a static draft and TIDE, side by side.

The schedule's workloads come one after another, all under the workload label `default`, so TIDE
must notice each shift from acceptance alone. Three engines share the target's weights and the
serving threads. They take turns in short time slots, each serving the same request sequence from
its own cursor, so a noisy neighbour slows all three alike. TIDE runs the whole loop: its
controller picks gamma at every step, `auto` capture publishes hidden states to a real Kafka broker,
and a `tide train` process and a `tide gate` process (pinned to the last core: this machine's
stand-in for a training GPU) train and promote drafts through a real MLflow registry. TIDE's
engine follows the `default` champion. The static draft (gamma fixed) was trained on the first
workload only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from tide.config import native_dtype
from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.infra.process import stop_groups
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target, load_target
from tide.producers.publisher import PublisherConfig
from tide.producers.records import DEFAULT_CODEC, is_held_out
from tide.prompts import load_prompts, split
from tide.registry.store import CHAMPION, register_folder
from tide.registry.tags import VersionTags
from tide.serving.capture import CaptureDecision, CapturePolicy, CaptureRule
from tide.serving.controller import ControllerConfig
from tide.serving.draft_sync import SyncConfig
from tide.serving.engine import Engine, EngineConfig
from tide.serving.node import NodeConfig, ServingNode
from tide.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

WORKLOAD = "default"
AGAIN = "-again"  # in the id of a request whose prompt came before
log = logging.getLogger("tide.bench")


@dataclass
class ShiftBenchConfig:
    schedule: list[Path]
    static_draft: Path
    phase_seconds: float = 600.0
    slot_seconds: float = 4.0  # each system serves this long in turn
    window_seconds: float = 30.0
    max_batch: int = 1
    max_new_tokens: int = 96
    static_gamma: int = 3
    model: str | None = None
    dtype: torch.dtype = field(default_factory=native_dtype)  # the target's
    weights: str = "auto"  # the target's linears (`tide.models.weights`)
    compile: bool = True
    # broker, registry and trainer state, kept for the replay scripts; default: a temporary folder,
    # removed after the run (an hour's captured hidden states run to gigabytes)
    work_dir: Path | None = None
    end_seconds: float = 120.0  # "by the end of a phase": its last this many seconds
    engine: str = "tide"  # or "vllm": the three systems are vLLM servers (`tide.bench.shift_vllm`)
    proposer: str = "draft"  # TIDE's node: suffix or hybrid also drafts from the workload's recent text


@dataclass
class Slot:
    start: float  # seconds since the run started
    seconds: float
    tokens: int
    steps: int  # sequence-steps with speculation
    emitted: int  # tokens those steps produced
    decoded: int  # sequence-steps in all, with speculation or without
    drafted: int  # draft tokens those steps proposed
    suffix_steps: int = 0  # sequence-steps drafted from the suffix index instead (--proposer)


def request_id(workload: str, i: int, n: int) -> str:
    """The i-th request of a workload of n prompts. A prompt that comes again keeps its first
    request's held-out status: greedy decoding repeats its text, so a prompt the trainers learnt
    from must never evaluate a draft, nor the other way round."""
    first = f"{workload}-{i % n}"
    if i < n:
        return first
    want = is_held_out(first)
    return next(rid for j in itertools.count() if is_held_out(rid := f"{first}{AGAIN}{i // n}.{j}") == want)


@dataclass
class Track:
    """One system's part of the run: where it is in each workload's prompts, and what it served."""

    name: str
    cursor: dict[str, int] = field(default_factory=dict)  # next request of each workload
    started: Counter[int] = field(default_factory=Counter)  # requests started in each phase
    slots: list[Slot] = field(default_factory=list)

    def next_request(self, phase: int, workload: str, prompts: list[list[int]]) -> tuple[str, list[int]]:
        """A workload that comes back goes on through its prompts where it stopped."""
        i = self.cursor.get(workload, 0)
        self.cursor[workload] = i + 1
        self.started[phase] += 1
        return request_id(workload, i, len(prompts)), prompts[i % len(prompts)]


@dataclass(kw_only=True)
class System(Track):
    engine: Engine
    capture: CapturePolicy | None = None

    def serve(
        self, phase: int, workload: str, prompts: list[list[int]], t0: float, seconds: float,
        params: SamplingParams,
    ) -> None:  # fmt: skip
        e = self.engine
        start = time.perf_counter()
        steps0, emitted0, drafted0 = e.stats.steps, e.stats.emitted, e.stats.drafted
        suffix0 = _suffix_steps(e)
        tokens = decoded = 0
        while time.perf_counter() - start < seconds:
            while len(e.running) + len(e.waiting) < e.cfg.max_batch:
                rid, prompt = self.next_request(phase, workload, prompts)
                d = (
                    self.capture.decide(WORKLOAD, False, rid, prompt)
                    if self.capture
                    else CaptureDecision(False)
                )
                e.add(prompt, params, rid, workload=WORKLOAD, capture=d.capture, held_out=d.held_out)
            outputs = e.step()
            tokens += sum(len(o.new_tokens) for o in outputs)
            decoded += sum(1 for o in outputs if o.accepted is not None)  # None: a prefill
        self.slots.append(Slot(start - t0, time.perf_counter() - start, tokens,
                               e.stats.steps - steps0, e.stats.emitted - emitted0, decoded,
                               e.stats.drafted - drafted0, _suffix_steps(e) - suffix0))  # fmt: skip


def _suffix_steps(e: Engine) -> int:
    return e.suffix.chosen if e.suffix is not None else 0


def _tokens_per_s(slots: list[Slot]) -> float:
    seconds = sum(s.seconds for s in slots)
    return sum(s.tokens for s in slots) / seconds if seconds else 0.0


def _tau(slots: list[Slot]) -> float | None:
    steps = sum(s.steps for s in slots)
    return sum(s.emitted for s in slots) / steps if steps else None


def _gamma(slots: list[Slot]) -> float | None:
    """Mean gamma of the steps that drafted: with tau, whether drafting was deep for what it got."""
    steps = sum(s.steps for s in slots)
    return sum(s.drafted for s in slots) / steps if steps else None


def _drafted(slots: list[Slot]) -> float | None:
    """The share of sequence-steps that drafted (τ alone cannot tell speculation from its checks)."""
    decoded = sum(s.decoded for s in slots)
    return sum(s.steps for s in slots) / decoded if decoded else None


def _suffix_share(slots: list[Slot]) -> float | None:
    """The share of sequence-steps that drafted from the suffix index (`_drafted` counts the draft's)."""
    decoded = sum(s.decoded for s in slots)
    return sum(s.suffix_steps for s in slots) / decoded if decoded else None


def _pin(cores: set[int]) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


@dataclass
class Setting:
    """What a run starts from: its services and cores, the target, each phase's prompts."""

    cfg: ShiftBenchConfig
    target: Target
    phases: list[list[list[int]]]
    work: Path
    kafka: KafkaBroker
    mlflow: MlflowServer
    serving_cores: set[int]
    training_cores: set[int]

    @property
    def max_model_len(self) -> int:
        return max(len(p) for ph in self.phases for p in ph) + self.cfg.max_new_tokens + 16

    def register_static(self, client: MlflowClient) -> ModelVersion:
        """The static draft, registered as the `default` workload's champion: the draft to beat."""
        start = register_folder(client, self.target.fingerprint, WORKLOAD, self.cfg.static_draft,
                                {"bench": "static draft"})  # fmt: skip
        client.set_registered_model_alias(start.name, CHAMPION, start.version)
        return start


def run_shift_bench(cfg: ShiftBenchConfig) -> dict[str, Any]:
    if cfg.work_dir is None:
        with tempfile.TemporaryDirectory(prefix="tide-shift-") as tmp:
            return _serve_shift(cfg, Path(tmp))
    return _serve_shift(cfg, cfg.work_dir)


def _serve_shift(cfg: ShiftBenchConfig, work: Path) -> dict[str, Any]:
    ncpu = os.cpu_count() or 1
    serving_cores = set(range(max(1, ncpu - 1)))
    training_cores = {ncpu - 1}
    # the broker and the registry live on the training side (they inherit the affinity they start
    # with): what they do for TIDE's capture must not land on the cores the three systems share
    _pin(training_cores)
    with KafkaBroker(work / "kafka") as kafka, MlflowServer(work / "mlflow") as mlflow:
        _pin(serving_cores)
        torch.set_num_threads(len(serving_cores))
        target = load_target(cfg.model, cfg.dtype, weights=cfg.weights, compile=cfg.compile)
        # the static draft learnt the first workload's training prompts: that workload serves its test
        # prompts; the others serve all of theirs (no draft here has seen them)
        phases = [
            [p.token_ids(target.tok)[-256:]
             for p in split(load_prompts(path), "test" if path == cfg.schedule[0] else "all") or load_prompts(path)]
            for path in cfg.schedule
        ]  # fmt: skip
        setting = Setting(cfg, target, phases, work, kafka, mlflow, serving_cores, training_cores)
        if cfg.engine == "vllm":
            from tide.bench.shift_vllm import run_vllm  # it builds on this module

            return run_vllm(setting)
        return _run(setting)


def spawn_tide(args: list[str], log: Path, cores: set[int]) -> subprocess.Popen[bytes]:
    """A `tide` command in its own session, pinned to `cores`, one thread per core, logging to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    with log.open("wb") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "tide"), *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=lambda: _pin(cores))  # fmt: skip


def start_learning(
    setting: Setting, gate_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """`tide train` and `tide gate` on the `default` workload, on the training core."""
    work, cores = setting.work, setting.training_cores
    kafka, mlflow = setting.kafka.bootstrap, setting.mlflow.url
    trainer = spawn_tide(["train", "--kafka", kafka, "--workload", WORKLOAD, "--mlflow", mlflow,
                          "--state-dir", str(work / "trainer"), "--eval-every", "50", "--checkpoint-every", "40",
                          "--vocab-warmup", "1024"], work / "trainer.log", cores)  # fmt: skip
    gate = spawn_tide(["gate", "--mlflow", mlflow, "--kafka", kafka, "--poll-seconds", "5",
                       "--min-positions", "256", *gate_args], work / "gate.log", cores)  # fmt: skip
    return trainer, gate


def _draft(target: Target, folder: Path) -> Eagle3Draft:
    m = target.model
    return Eagle3Draft.load(folder, m.embed_tokens, target.config, target.fingerprint, m.dtype)


def _run(setting: Setting) -> dict[str, Any]:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    cfg, target, phases, work, kafka, mlflow = (setting.cfg, setting.target, setting.phases, setting.work,
                                                setting.kafka, setting.mlflow)  # fmt: skip
    serving_cores, training_cores = setting.serving_cores, setting.training_cores
    client = MlflowClient(mlflow.url)
    start = setting.register_static(client)
    length = setting.max_model_len

    def engine_cfg(gamma: int, max_gamma: int = 8, proposer: str = "draft") -> EngineConfig:
        return EngineConfig(max_batch=cfg.max_batch, max_model_len=length, gamma=gamma, max_gamma=max_gamma,
                            proposer=proposer)  # fmt: skip

    nospec = System("nospec", engine=Engine(target, None, engine_cfg(0)))
    static = System(
        "static", engine=Engine(target, _draft(target, cfg.static_draft), engine_cfg(cfg.static_gamma))
    )

    # TIDE's background threads (librdkafka's, the publisher's, the draft sync's) are host work on a
    # serving node with an accelerator: they start on the host's stand-in, the training core
    # (threads keep the affinity they start with); encoding records stays on the engine's thread
    @contextlib.contextmanager
    def host_side() -> Iterator[None]:
        _pin(training_cores)
        try:
            yield
        finally:
            _pin(serving_cores)

    node_cfg = NodeConfig(
        engine_cfg(0, 6, cfg.proposer),
        kafka=PublisherConfig(kafka.bootstrap, DEFAULT_CODEC, 64),
        registry=SyncConfig(mlflow.url, work / "drafts", "bench", poll_seconds=5.0),
        adaptive=ControllerConfig(max_gamma=6),
        profile_batches=(1, cfg.max_batch),
    )
    node = ServingNode.build(target, _draft(target, cfg.static_draft), node_cfg, host_side)
    assert node.publisher is not None and node.sync is not None and node.engine.controller is not None
    publisher, sync, controller = node.publisher, node.sync, node.engine.controller
    capture = CapturePolicy({"*": CaptureRule(auto=True)})
    node.advise(capture)
    tide = System("tide", engine=node.engine, capture=capture)
    systems = [nospec, static, tide]

    trainer, gate = start_learning(setting)
    params = SamplingParams(max_tokens=cfg.max_new_tokens)
    events: list[dict[str, Any]] = []
    # the controller's state after each round: why TIDE drafted (or not) in each window
    states: list[tuple[float, dict[str, Any]]] = []
    sync.poll_once()  # here, on the serving core: it measures the step times the gate is given
    with host_side():
        node.start()
    t0 = time.perf_counter()
    total = cfg.phase_seconds * len(phases)
    try:
        with tqdm(total=int(total), desc="bench shift", unit="s") as bar:
            version = str(start.version)
            while (now := time.perf_counter() - t0) < total:
                phase = int(now // cfg.phase_seconds)
                for s in systems:
                    s.serve(phase, str(cfg.schedule[phase]), phases[phase], t0, cfg.slot_seconds, params)
                states.append((time.perf_counter() - t0, controller.snapshot().get(WORKLOAD, {})))
                following = sync.following.get(WORKLOAD)
                if following is not None and following.version != version:
                    # the node refuses a version it rolls back before it swaps (its counter comes after)
                    kind = "rollback" if (following.name, version) in sync.refused else "promotion"
                    try:
                        tags = client.get_model_version(following.name, following.version).tags or {}
                    except MlflowException as e:  # the registry dropped a connection: next slot
                        log.warning(
                            "reading version %s's tags failed, trying again: %s", following.version, e
                        )
                        continue
                    if kind == "promotion" and VersionTags.from_tags(tags).recall is not None:
                        kind = "recall"  # the gate brought an earlier champion back
                    version = following.version
                    events.append({"t": time.perf_counter() - t0, kind: version, "phase": phase})
                recent = [[x for x in s.slots if x.start >= now - cfg.window_seconds] for s in systems]
                base = _tokens_per_s(recent[0]) or 1.0  # nothing decoded yet: show zeros, not a crash
                bar.set_postfix_str(f"phase {phase} static {_tokens_per_s(recent[1]) / base:.2f}x "
                                    f"tide {_tokens_per_s(recent[2]) / base:.2f}x", refresh=False)  # fmt: skip
                bar.update(int(time.perf_counter() - t0) - bar.n)
    finally:
        node.stop()
        stop_groups([trainer, gate], 30)
    return shift_report(cfg, systems, events, controller.snapshot(), publisher.stats.records_published,
                   [len(ph) for ph in phases], states)  # fmt: skip


def shift_report(
    cfg: ShiftBenchConfig,
    systems: Sequence[Track],
    events: list[dict[str, Any]],
    controller: dict[str, Any],
    records: int,
    prompts: list[int],
    states: list[tuple[float, dict[str, Any]]],
) -> dict[str, Any]:
    nospec, static, tide = systems
    windows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    for p, path in enumerate(cfg.schedule):
        lo, hi = p * cfg.phase_seconds, (p + 1) * cfg.phase_seconds

        def within(s: Track, a: float, b: float) -> list[Slot]:
            return [x for x in s.slots if a <= x.start < b]

        base = _tokens_per_s(within(nospec, lo, hi))
        phase_windows = []
        w = lo
        while w + cfg.window_seconds <= hi + 1e-9:
            w_end = w + cfg.window_seconds
            ws, wt = within(static, w, w_end), within(tide, w, w_end)
            n = _tokens_per_s(within(nospec, w, w_end))
            row: dict[str, Any] = {
                "t": w,
                "phase": p,
                "nospec_tokens_per_s": n,
                "static_vs_nospec": _tokens_per_s(ws) / n if n else None,
                "tide_vs_nospec": _tokens_per_s(wt) / n if n else None,
                "static_tau": _tau(ws),
                "tide_tau": _tau(wt),
                "tide_drafted_share": _drafted(wt),
                "tide_suffix_share": _suffix_share(wt),
                "tide_mean_gamma": _gamma(wt),
                # the controller as the window ended: its averages, which one decided, the detector
                "tide_controller": next((c for t, c in reversed(states) if t <= w_end), None),
            }
            phase_windows.append(row)
            w += cfg.window_seconds
        windows += phase_windows
        ratios: list[float] = [r["tide_vs_nospec"] for r in phase_windows if r["tide_vs_nospec"] is not None]
        adapt = None
        for i in range(len(ratios)):
            if all(r >= 1.0 for r in ratios[i:]):
                adapt = phase_windows[i]["t"] - lo
                break
        ordered = sorted(ratios)
        end_lo = max(lo, hi - cfg.end_seconds)
        end = _tokens_per_s(within(nospec, end_lo, hi))
        name = Path(path).stem
        earlier = [ph for ph in phases if ph["workload"] == name]
        phases.append({
            "workload": name,
            "nospec_tokens_per_s": base,
            "static_vs_nospec": _tokens_per_s(within(static, lo, hi)) / base if base else None,
            "tide_vs_nospec": _tokens_per_s(within(tide, lo, hi)) / base if base else None,
            "tide_window_median": statistics.median(ratios) if ratios else None,
            "tide_window_p10": ordered[int(0.1 * (len(ordered) - 1))] if ordered else None,
            "tide_last_window": ratios[-1] if ratios else None,
            "static_end_vs_nospec": _tokens_per_s(within(static, end_lo, hi)) / end if end else None,
            "tide_end_vs_nospec": _tokens_per_s(within(tide, end_lo, hi)) / end if end else None,
            "adapt_seconds": adapt,
            "tide_suffix_share": _suffix_share(within(tide, lo, hi)),
            # a workload that comes back: from phase start to TIDE's window ratio reaching 95% of
            # what it was by the end of the workload's last phase
            "recovery_seconds": _recovery(phase_windows, lo, earlier[-1]["tide_end_vs_nospec"]) if earlier else None,
            "promotions": sum(1 for e in events if e["phase"] == p and "promotion" in e),
            "recalls": sum(1 for e in events if e["phase"] == p and "recall" in e),
            "rollbacks": sum(1 for e in events if e["phase"] == p and "rollback" in e),
            "workload_prompts": prompts[p],  # against tide_requests: how often prompts came again
            "tide_requests": tide.started[p],
        })  # fmt: skip
    return {
        "config": {
            "schedule": [str(p) for p in cfg.schedule],
            "phase_seconds": cfg.phase_seconds,
            "slot_seconds": cfg.slot_seconds,
            "window_seconds": cfg.window_seconds,
            "end_seconds": cfg.end_seconds,
            "max_batch": cfg.max_batch,
            "max_new_tokens": cfg.max_new_tokens,
            "static_gamma": cfg.static_gamma,
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "static_draft": str(cfg.static_draft),
            "engine": cfg.engine,
            "proposer": cfg.proposer,
        },
        "phases": phases,
        "windows": windows,
        "events": events,
        "records_published": records,
        "controller": controller,
    }


def _recovery(windows: list[dict[str, Any]], start: float, before: float | None) -> float | None:
    if before is None:
        return None
    for w in windows:
        if w["tide_vs_nospec"] is not None and w["tide_vs_nospec"] >= 0.95 * before:
            return float(w["t"] - start)
    return None


def plot_shift_report(report: dict[str, Any], path: Path) -> None:
    """Throughput ratio and acceptance over time, promotions marked (the paper's Figure 1, over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = report["windows"]
    t = [r["t"] / 60 for r in w]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.plot(t, [r["tide_vs_nospec"] for r in w], "-o", color="#2a7", label="TIDE / no speculation")
    ax1.plot(t, [r["static_vs_nospec"] for r in w], "-s", color="#a72", label="static draft / no speculation")
    ax1.axhline(1.0, color="#888", lw=1)
    ax1.set_ylabel("throughput ratio")
    ax2.plot(t, [r["tide_tau"] for r in w], "-o", color="#2a7", label="TIDE")
    ax2.plot(t, [r["static_tau"] for r in w], "-s", color="#a72", label="static draft")
    ax2.set_ylabel("tokens per step (speculating)")
    ax2.set_xlabel("minutes")
    phase_s = report["config"]["phase_seconds"]
    for ax in (ax1, ax2):
        for p, ph in enumerate(report["phases"]):
            ax.axvline(p * phase_s / 60, color="#bbb", ls="--", lw=1)
            ax.text(p * phase_s / 60, ax.get_ylim()[1], f" {ph['workload']}", va="top", fontsize=8)
        for e in report["events"]:
            color = "#2a7" if "promotion" in e else "#27a" if "recall" in e else "#c33"
            ax.axvline(e["t"] / 60, color=color, ls=":", lw=1)
        ax.legend(loc="lower right", fontsize=8)
    ax1.set_title("workload shift: promotions dotted green, recalls blue, rollbacks red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
