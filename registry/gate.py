"""The acceptance gate: a candidate becomes `champion` only if it beats what serves its workload now.

For the newest undecided version of each workload's registered model, the candidate and the draft
serving that workload (its champion, else the `default` workload's champion) are evaluated on the
same held-out requests, each joined from its records (a draft serves with the whole request before
it in context): tau for gamma = 1..gamma_max (greedy chain, from the target's own states), and the
cost model's speedup at the step times a serving node last measured (the registered
model's `serving.profile` tag). The score is the best speedup over gamma, or tau at the serving
gamma while no node has published a profile. A candidate is promoted when it passes the minimum,
beats the baseline by the margin, and its tau gain is significant: `confidence` standard errors
above zero, the held-out requests compared in pairs (a couple of lucky requests promote nothing).
The old champion moves to `previous`. Every decision leaves
its figures and reason as `gate.*` tags on the version.

Held-out records are those of requests the trainers never learn from (the record's `held_out`), read
from the workload's topic from the start of its retention on every gate start (no commits); the
gate judges on the last couple of minutes of them, so after a shift it judges the new traffic.
Earlier champions are weighed against every candidate and, when new held-out traffic arrives
without one, against the champion: a workload that comes back gets its old draft back at once.

The gate fails closed. Only a version that is itself bad (its files, its config, its weights) is
refused; when a draft cannot be read for any other reason (a full disk, S3 or MLflow away) the
workload gets no decision this pass and is gated again at the next, the gate backing off while
passes fail. Aliases move only if they still point where the gate read them (`move_alias`), and
only the gate holding the registry's lease (`GateLease`) acts.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException

from tide.models.eagle3 import DraftLoadError, DraftMismatchError, Eagle3Draft
from tide.models.loader import TargetHead
from tide.names import gate_group, lease_prefix, model_name, model_prefix
from tide.producers.assembler import RequestAssembler
from tide.producers.consumer import RecordConsumer
from tide.producers.records import HeldOutWindow, HiddenStateRecord
from tide.registry.profile import StepProfile
from tide.registry.store import (
    CHAMPION,
    PREVIOUS,
    PROFILE_TAG,
    AliasMoved,
    ArtifactRefused,
    alias_version,
    download_version,
    move_alias,
    set_tags,
)
from tide.registry.tags import Figures, GateVerdict, Recall, VersionTags, champion_until_tags, now
from tide.trainers.examples import completion_positions, example_of, in_window
from tide.trainers.ttt import Example, TrainConfig, evaluate

log = logging.getLogger("tide.registry")

# what makes a version itself unusable, and refused for good; anything else (OSError, an MLflow or S3
# error) says nothing about the version: no verdict, gated again next pass
BAD_VERSION = (ArtifactRefused, DraftLoadError, DraftMismatchError)


@dataclass
class GateConfig:
    tracking_uri: str
    bootstrap: str  # Kafka: the held-out records
    cache_dir: Path  # downloaded versions
    margin: float = 0.02  # the candidate's score must beat the baseline's by this fraction
    # ... and its tau gain must stand this many standard errors above zero, requests as paired units:
    # on thin held-out data (a quiet workload, just after a shift) a lucky draft is not promoted.
    # (replayed on two shift runs, 1.64 refused three more candidates, all better in the minutes after)
    confidence: float = 1.0
    min_speedup: float = 1.0  # predicted speedup over no speculation the candidate must reach
    min_tau: float = 1.2  # without a serving profile: tokens per step at `gamma` to reach
    gamma: int = 4  # the serving gamma, used while no profile is known
    gamma_max: int = 4
    held_out: HeldOutWindow = field(default_factory=HeldOutWindow)  # per workload; no decision on less
    recall: int = 8  # earlier champions weighed against each candidate (a workload that comes back)
    # this many new held-out positions without a candidate: weigh the champion against earlier ones again
    recheck_positions: int = 128
    # the registry's gate lease lasts this long unless renewed (each pass and each alias move renews
    # it): a gate that was killed holds up another for at most this long
    lease_seconds: float = 180.0
    max_backoff_seconds: float = 600.0  # failing passes wait twice as long each time, up to this


@dataclass
class Evaluation:
    version: str
    tau: list[float]  # gamma = 1..gamma_max, per step as serving steps (`Metrics.step_tau`)
    speedup: list[float] | None  # the same, through the cost model (None: no profile)
    accepted: torch.Tensor  # (examples, gamma_max): drafts accepted, summed over each example's anchors
    anchors: torch.Tensor  # (examples,)

    @property
    def best_gamma(self) -> int:
        scores = self.speedup if self.speedup is not None else self.tau
        return 1 + max(range(len(scores)), key=scores.__getitem__)

    def score(self, gamma: int) -> float:
        """Best predicted speedup; without a profile, tau at the serving gamma."""
        return max(self.speedup) if self.speedup is not None else self.tau[gamma - 1]

    def figures(self, gamma: int) -> Figures:
        return Figures(self.tau, self.speedup, self.best_gamma, self.score(gamma))

    def gain_over(self, other: Evaluation, gamma: int) -> tuple[float, float]:
        """Tau gain at gamma over `other`, evaluated on the same examples, and its standard error with
        the examples as paired units (positions within one are not independent draws)."""
        n = self.anchors.double()
        d = (self.accepted[:, gamma - 1] - other.accepted[:, gamma - 1]).double()[n > 0]
        n = n[n > 0]
        total = float(n.sum())
        if not total:
            return 0.0, math.inf
        gain = float(d.sum()) / total
        k = len(n)
        if k < 2:
            return gain, math.inf
        spread = float(((d - gain * n) ** 2).sum()) * k / (k - 1)
        return gain, math.sqrt(spread) / total

    def beats(self, other: Evaluation, z: float) -> tuple[bool, str]:
        """Whether the tau gain at this draft's best gamma stands z standard errors above zero."""
        g = self.best_gamma
        gain, se = self.gain_over(other, g)
        return gain - z * se > 0, f"tau gain {gain:+.3f} at gamma {g}, standard error {se:.3f}"


@dataclass
class Verdict:
    name: str
    version: str
    decision: str  # a GateVerdict's (promoted, refused, skipped), or recalled
    reason: str
    tags: dict[str, str] = field(default_factory=dict)


def parse_profile(raw: str | None) -> StepProfile | None:
    if not raw:
        return None
    try:
        return StepProfile.from_json(raw)
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("ignoring an unreadable %s tag", PROFILE_TAG)
        return None


class HeldOut:
    """A workload's most recent held-out examples, read from its topic."""

    def __init__(self, cfg: GateConfig, workload: str, head: TargetHead):
        self.cfg = cfg
        self.head = head
        self.examples: list[Example] = []
        self.arrived = 0  # positions read so far
        self.checked = 0  # `arrived` when the champion was last weighed against earlier ones
        self.drained = False  # a first drain has waited for the partitions (or its whole budget)
        # a group of its own: nothing is committed, and a standby gate must not take half the partitions
        group = gate_group(workload, uuid.uuid4().hex[:8])
        self.consumer = RecordConsumer(cfg.bootstrap, [workload], group, head.fingerprint)
        self.requests = RequestAssembler()  # judged whole, as they are served

    @property
    def positions(self) -> int:
        return completion_positions(self.examples)

    def drain(self, budget_s: float = 5.0) -> list[Example]:
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            batch = self.consumer.poll(256, 0.5)
            if not batch:
                # a new consumer reads nothing until its group has assigned it the partitions (seconds
                # on a busy broker): an empty poll before that is no sign the topic has been read
                if self.consumer.assigned or self.drained:
                    break
                continue
            for c in batch:
                if c.record.held_out:
                    self._judge_on(self.requests.add(c.record))
        self._judge_on(self.requests.flush())
        self.drained = True
        self.examples = in_window(self.examples, self.cfg.held_out, time.time())
        return self.examples

    def _judge_on(self, requests: list[HiddenStateRecord]) -> None:
        for r in requests:
            ex = example_of(r, self.head.lm_head)
            if ex is not None:
                self.examples.append(ex)
                self.arrived += len(ex.tokens) - ex.learn_from

    def close(self) -> None:
        self.consumer.close()


class NoVerdict(RuntimeError):
    """A decision cannot be made now (a baseline out of reach, the lease lost): none is recorded."""


class GateLease:
    """Only one gate acts on a target's drafts in a registry at a time.

    MLflow has no conditional write: two gates that each write an owner tag and read it back can
    both read their own (A writes, A reads, B writes, B reads). Creating a registered model is atomic
    though (its name is unique in the registry's database), so the lease is a series of registered
    models `tide-gate-lease-<fp12>-<epoch>`, each created by exactly one gate, with the owner and an
    expiry (unix seconds, the holder's clock) in tags. The newest epoch rules: its owner renews it
    while it is valid; once it has expired, whoever creates the next epoch holds it. The holder
    deletes older epochs, and its own when it stops. (An advisory lock in the registry's database
    would need the gate to hold the database's password; a file lock holds on one machine only.)
    """

    def __init__(self, client: MlflowClient, fingerprint: str, seconds: float, owner: str | None = None):
        self.client = client
        self.prefix = lease_prefix(fingerprint)
        self.seconds = seconds
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.epoch: int | None = None  # the epoch this gate created, while it may hold it

    def _epochs(self) -> dict[int, dict[str, str]]:
        found = self.client.search_registered_models(f"name LIKE '{self.prefix}%'")
        out = {}
        for rm in found:
            tail = rm.name[len(self.prefix) :]
            if tail.isdigit():
                out[int(tail)] = dict(rm.tags or {})
        return out

    def acquire(self) -> bool:
        """Hold the lease for the next `seconds`: renew ours while it is valid, or take the next epoch
        once the newest has expired. False: another gate holds it."""
        epochs = self._epochs()
        now = time.time()
        expiry = str(now + self.seconds)
        top = max(epochs, default=0)
        if top and float(epochs[top].get("expires", "0")) > now:
            if top != self.epoch or epochs[top].get("owner") != self.owner:
                self.epoch = None
                return False
            try:
                self.client.set_registered_model_tag(self.prefix + str(top), "expires", expiry)
            except MlflowException as e:  # deleted under us: we lost it
                if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                    self.epoch = None
                    return False
                raise
        else:
            try:
                self.client.create_registered_model(
                    self.prefix + str(top + 1), tags={"owner": self.owner, "expires": expiry}
                )
            except MlflowException as e:
                if e.error_code == "RESOURCE_ALREADY_EXISTS":  # another gate took this epoch first
                    self.epoch = None
                    return False
                raise
            self.epoch = top + 1
        for old in epochs.keys() - {self.epoch}:
            if old < self.epoch:
                self._delete(old)
        return True

    def release(self) -> None:
        if self.epoch is not None:
            self._delete(self.epoch)
            self.epoch = None

    def _delete(self, epoch: int) -> None:
        try:
            self.client.delete_registered_model(self.prefix + str(epoch))
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                log.warning("could not delete gate lease epoch %d: %s", epoch, e)


class Gate:
    def __init__(self, cfg: GateConfig, head: TargetHead):
        self.cfg = cfg
        self.head = head
        self.client = MlflowClient(cfg.tracking_uri)
        self.held_out: dict[str, HeldOut] = {}
        self.train_cfg = TrainConfig(ttt_steps=cfg.gamma_max)
        self.lease = GateLease(self.client, head.fingerprint, cfg.lease_seconds)
        self.failed: list[str] = []  # the last pass's models without a verdict, and why

    # -- one pass over every workload ---------------------------------------------------------------
    def run_once(self) -> list[Verdict]:
        """One pass, if this gate holds the lease. A model whose drafts cannot be read now gets no
        decision (`failed` says why) and the others go on."""
        self.failed = []
        if not self.lease.acquire():
            log.info("another gate holds the lease: not acting")
            return []
        prefix = model_prefix(self.head.fingerprint)
        decisions: list[Verdict] = []
        for rm in self.client.search_registered_models(f"name LIKE '{prefix}%'"):
            try:
                decisions += self.gate_model(rm, rm.name[len(prefix) :])
            except Exception as e:  # not the version's fault: no verdict, the next pass tries again
                log.warning("%s: no decision this pass: %s", rm.name, e)
                self.failed.append(f"{rm.name}: {e}")
        return decisions

    def run(self, poll_seconds: float, stop: threading.Event | None = None) -> None:
        """Pass after pass; while passes fail (MLflow, S3 or Kafka away) each waits twice as long
        as the one before, up to `max_backoff_seconds`."""
        stop = stop or threading.Event()
        failures = 0
        try:
            while not stop.is_set():
                try:
                    for d in self.run_once():
                        log.info("%s v%s %s: %s", d.name, d.version, d.decision, d.reason)
                    failures = failures + 1 if self.failed else 0
                except Exception as e:  # a registry that went away
                    failures += 1
                    log.warning("gate pass failed: %s", e)
                wait = backoff(poll_seconds, failures, self.cfg.max_backoff_seconds)
                if failures:
                    log.warning("%d failing passes in a row: next in %.0f s", failures, wait)
                stop.wait(wait)
        finally:
            self._release()

    def gate_model(self, rm: RegisteredModel, workload: str) -> list[Verdict]:
        versions = self.client.search_model_versions(f"name = '{rm.name}'")
        undecided = sorted(
            (v for v in versions if VersionTags.from_tags(v.tags).verdict is None), key=_number
        )
        champion = alias_version(self.client, rm.name, CHAMPION)
        held = self._held_out(workload)
        if not undecided:
            return self._recheck(rm, versions, champion, held)
        newest = undecided[-1]
        if champion is not None and champion.version == newest.version:  # made champion by hand
            return [
                self._record(v, GateVerdict("skipped", "made champion outside the gate"))
                if v is newest
                else self._record(v, GateVerdict("skipped", f"superseded by version {newest.version}"))
                for v in undecided
            ]
        decisions = [
            self._record(
                v, GateVerdict("skipped", f"superseded by version {newest.version} before it was gated")
            )
            for v in undecided[:-1]
        ]
        examples = held.examples
        positions = held.positions
        if positions < self.cfg.held_out.min_positions:
            log.debug(
                "%s: %d held-out positions, waiting for %d",
                rm.name,
                positions,
                self.cfg.held_out.min_positions,
            )
            return decisions
        held.checked = held.arrived
        profile = parse_profile((rm.tags or {}).get(PROFILE_TAG))
        alumni = _alumni(versions, champion, self.cfg.recall)
        return [
            *decisions,
            self._decide(rm, workload, newest, champion, examples, positions, profile, alumni),
        ]

    def _held_out(self, workload: str) -> HeldOut:
        """The workload's held-out examples, with what arrived since the last pass."""
        if workload not in self.held_out:
            self.held_out[workload] = HeldOut(self.cfg, workload, self.head)
        held = self.held_out[workload]
        held.drain()
        return held

    def _recheck(
        self, rm: RegisteredModel, versions: list[ModelVersion], champion: ModelVersion | None, held: HeldOut
    ) -> list[Verdict]:
        """No candidate, but new held-out traffic: does an earlier champion serve it better than the
        champion (a workload that came back while its trainer had nothing new to publish)?"""
        alumni = _alumni(versions, champion, self.cfg.recall)
        fresh = held.arrived - held.checked >= self.cfg.recheck_positions
        if champion is None or not alumni or not fresh or held.positions < self.cfg.held_out.min_positions:
            return []
        held.checked = held.arrived
        profile = parse_profile((rm.tags or {}).get(PROFILE_TAG))
        try:
            now = self.evaluate(champion, held.examples, profile)
        except BAD_VERSION as e:
            log.warning("champion %s v%s unusable for a recheck: %s", rm.name, champion.version, e)
            return []
        gamma = self.cfg.gamma
        recalled = self._recall(alumni, held.examples, profile, now.score(gamma) * (1 + self.cfg.margin), now)
        if recalled is None:
            return []
        mv, old = recalled
        reason = (f"champion v{champion.version} scores {now.score(gamma):.3f} on the last "
                  f"{held.positions} held-out positions, earlier champion v{mv.version} {old.score(gamma):.3f}")  # fmt: skip
        recall = self._bring_back(rm, champion, mv, old, reason)
        return [Verdict(mv.name, str(mv.version), "recalled", reason, recall.to_tags())]

    def _bring_back(
        self,
        rm: RegisteredModel,
        champion: ModelVersion | None,
        mv: ModelVersion,
        ev: Evaluation,
        reason: str,
    ) -> Recall:
        """Make an earlier champion the champion again; its `gate.recall.*` tags say why."""
        self._promote(rm, champion, mv)
        recall = Recall(ev.figures(self.cfg.gamma), reason)
        set_tags(self.client, mv, recall.to_tags())
        return recall

    # -- a decision -----------------------------------------------------------------------------
    def _decide(
        self,
        rm: RegisteredModel,
        workload: str,
        cand: ModelVersion,
        champion: ModelVersion | None,
        examples: list[Example],
        positions: int,
        profile: StepProfile | None,
        alumni: Sequence[ModelVersion] = (),
    ) -> Verdict:
        gamma = self.cfg.gamma
        v = GateVerdict("refused", "", held_out_positions=positions, profile=_describe(profile))
        try:
            ev = self.evaluate(cand, examples, profile)
        except ArtifactRefused as e:
            return self._record(cand, replace(v, reason=f"{e.reason}: {e}"))
        except (DraftLoadError, DraftMismatchError) as e:  # other errors: no verdict (fail closed)
            kind = "foreign target" if isinstance(e, DraftMismatchError) else "unloadable"
            return self._record(cand, replace(v, reason=f"{kind}: {e}"))
        base_mv, base = self._baseline(workload, cand, champion, examples, profile)
        v = replace(
            v,
            figures=ev.figures(gamma),
            baseline=f"{base_mv.name} v{base_mv.version}"
            if base is not None and base_mv is not None
            else "none",
            baseline_figures=base.figures(gamma) if base is not None else None,
        )
        score = ev.score(gamma)
        minimum, unit = (self.cfg.min_speedup, "speedup") if profile else (self.cfg.min_tau, f"tau@{gamma}")
        needed = max(minimum, base.score(gamma) * (1 + self.cfg.margin) if base is not None else 0.0)
        recalled = self._recall(
            alumni, examples, profile, max(score, needed), base if base is not None else ev
        )
        if recalled is not None:
            mv, old = recalled
            reason = f"{unit} {score:.3f}, but earlier champion v{mv.version} has {old.score(gamma):.3f}"
            self._bring_back(rm, champion, mv, old, f"beat candidate v{cand.version}: {reason}")
            return self._record(cand, replace(v, reason=reason))
        if score < minimum:
            return self._record(
                cand, replace(v, reason=f"{unit} {score:.3f} below the minimum {minimum:.3f}")
            )
        if base is not None and score < needed:
            reason = (f"{unit} {score:.3f} does not beat the baseline's {base.score(gamma):.3f} "
                      f"by {self.cfg.margin:.0%} (needs {needed:.3f})")  # fmt: skip
            return self._record(cand, replace(v, reason=reason))
        if base is not None:
            sure, gain = ev.beats(base, self.cfg.confidence)
            v = replace(v, gain=gain)
            if not sure:
                reason = (f"{unit} {score:.3f} over the baseline's {base.score(gamma):.3f}, but {gain} "
                          f"on {len(examples)} examples: under {self.cfg.confidence:g} standard errors")  # fmt: skip
                return self._record(cand, replace(v, reason=reason))
        over = f"baseline {base.score(gamma):.3f}" if base is not None else "no baseline"
        promoted = replace(v, decision="promoted", reason=f"{unit} {score:.3f} (over {over})")
        return self._record(cand, promoted, lambda: self._promote(rm, champion, cand))

    def _promote(self, rm: RegisteredModel, champion: ModelVersion | None, mv: ModelVersion) -> None:
        """`mv` becomes champion, only if the champion is still the one this decision read (a node's
        rollback or a hand may have moved it since) and this gate still holds the lease."""
        read = str(champion.version) if champion is not None else None
        if not self.lease.acquire():
            raise NoVerdict("the gate lease was lost: another gate acts now")
        now = alias_version(self.client, rm.name, CHAMPION)
        if (str(now.version) if now is not None else None) != read:
            raise AliasMoved(
                f"{rm.name}: champion moved to v{now.version if now else None} since v{read} was read"
            )
        if champion is not None:
            self.client.set_registered_model_alias(rm.name, PREVIOUS, champion.version)
            set_tags(self.client, champion, champion_until_tags())  # recallable from now on
        move_alias(self.client, rm.name, CHAMPION, read, str(mv.version))

    def _recall(
        self,
        alumni: Sequence[ModelVersion],
        examples: list[Example],
        profile: StepProfile | None,
        bar: float,
        serving: Evaluation,
    ) -> tuple[ModelVersion, Evaluation] | None:
        """The best earlier champion above `bar` (the candidate's score and what promotion needs) on
        today's held-out traffic, and surely better than what serves now: a workload that comes back
        finds its draft again at once, instead of waiting for the trainer to relearn it."""
        best: tuple[ModelVersion, Evaluation] | None = None
        for mv in alumni:
            try:
                ev = self.evaluate(mv, examples, profile)
            except BAD_VERSION as e:
                log.warning("earlier champion %s v%s unusable: %s", mv.name, mv.version, e)
                continue
            better = ev.score(self.cfg.gamma) > max(bar, best[1].score(self.cfg.gamma) if best else 0.0)
            if better and ev.beats(serving, self.cfg.confidence)[0]:
                best = (mv, ev)
        return best

    def _baseline(
        self,
        workload: str,
        cand: ModelVersion,
        champion: ModelVersion | None,
        examples: list[Example],
        profile: StepProfile | None,
    ) -> tuple[ModelVersion | None, Evaluation | None]:
        """What serves the workload now: its champion, else the default workload's champion. A
        baseline that is itself bad serves nowhere (nodes refuse it) and is gated without; one out of
        reach (disk, S3, MLflow) leaves the candidate undecided: judged against nothing, a worse
        candidate would pass."""
        mv = champion
        if mv is None and workload != "default":
            mv = alias_version(self.client, model_name(self.head.fingerprint, "default"), CHAMPION)
        if mv is None or (mv.name == cand.name and mv.version == cand.version):
            return None, None
        try:
            return mv, self.evaluate(mv, examples, profile)
        except BAD_VERSION as e:
            log.warning("baseline %s v%s unusable, gating without it: %s", mv.name, mv.version, e)
            return None, None
        except Exception as e:
            raise NoVerdict(f"baseline {mv.name} v{mv.version} out of reach: {e}") from e

    def evaluate(self, mv: ModelVersion, examples: list[Example], profile: StepProfile | None) -> Evaluation:
        # the cache keeps what a decision reads: candidate, champion and the earlier champions
        folder = download_version(self.client, mv, self.cfg.cache_dir, keep=self.cfg.recall + 2)
        h = self.head
        draft = Eagle3Draft.load(folder, h.embed, h.config, h.fingerprint, torch.float32).eval()
        m = evaluate(draft, h.lm_head, examples, self.train_cfg)
        speedup = None
        if profile is not None:
            speedup = [profile.speedup_at(t, g) for g, t in enumerate(m.step_tau, start=1)]
        return Evaluation(str(mv.version), m.step_tau, speedup, m.accepted, m.anchors)

    def _record(self, mv: ModelVersion, v: GateVerdict, act: Callable[[], None] | None = None) -> Verdict:
        """Tag the evidence, carry the decision out (`act`: a promotion moves the alias), then tag the
        decision: a gate stopped in between leaves a version that is gated again, never a champion
        without its figures (a loop test's gate, stopped mid-promotion, once did)."""
        set_tags(self.client, mv, v.evidence_tags())
        if act is not None:
            act()
        v = replace(v, time=now())
        set_tags(self.client, mv, v.decision_tags())
        return Verdict(mv.name, str(mv.version), v.decision, v.reason, v.to_tags())

    def close(self) -> None:
        for h in self.held_out.values():
            h.close()
        self._release()

    def _release(self) -> None:
        try:
            self.lease.release()
        except Exception as e:  # the registry is away: the lease expires on its own
            log.warning("could not release the gate lease: %s", e)


def backoff(poll_seconds: float, failures: int, cap: float) -> float:
    """The wait after `failures` failing passes in a row: the poll interval, doubled for each."""
    return min(poll_seconds * 2 ** min(failures, 30), max(cap, poll_seconds))


def _number(mv: ModelVersion) -> int:
    return int(mv.version)


def _alumni(versions: list[ModelVersion], champion: ModelVersion | None, n: int) -> list[ModelVersion]:
    """The newest n versions that were champion once (the gate promoted them, or displaced them) and are not now."""
    serving = champion.version if champion is not None else None
    done = [v for v in versions if v.version != serving and VersionTags.from_tags(v.tags).was_champion]
    return sorted(done, key=_number)[-n:] if n > 0 else []


def _describe(profile: StepProfile | None) -> str:
    if profile is None:
        return "none (no serving node has published step times)"
    return (
        f"batch {profile.batch_size}: T(1) {profile.target[1] * 1e3:.1f} ms, "
        f"draft {profile.drafting(1) * 1e3:.2f} ms then {(profile.drafting(2) - profile.drafting(1)) * 1e3:.2f} ms"
    )
