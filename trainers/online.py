"""The online trainer: one workload's records from Kafka → incremental EAGLE-3 training → candidates.

It never loads the target's decoder layers: the draft's inputs (aux states, final states) come in
the records, and the labels are the final state times the target's LM head. Training starts from
the workload's champion (or the bootstrap draft), refits the draft vocabulary to the workload's
tokens, and learns whole requests: each request's records are joined back first, because the draft
serves with everything before a position in context. It mixes each new request with one from a
replay buffer of earlier ones so the draft does not forget; between new requests it trains on the
newest ones and the whole buffer, half each.
Every record's training lands in a durable checkpoint before its offset is committed (see
`checkpoint.py`). A held-out slice of the stream (by request id) measures the draft; a
candidate is published when held-out τ improves, when the held-out set is mostly traffic the last
candidate was never judged on, or every `publish_every` steps.

Nothing it reads or calls may end it. Records are validated against the target and their topic
(the consumer skips and counts what is refused, and the offsets committed move past it); a step
whose loss or gradients are not finite is skipped and counted; weights that are not finite are
never checkpointed nor published (they are put back to the last checkpoint's). MLflow (publishing,
metrics) and Kafka (committing offsets) may be away for a while: what failed is retried with capped
exponential backoff while training goes on. The ledger and the candidate folders keep their newest
entries only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from confluent_kafka.admin import AdminClient

from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import TargetHead
from tide.names import trainer_group
from tide.producers.assembler import RequestAssembler, record_key
from tide.producers.consumer import RecordConsumer
from tide.producers.records import HeldOutWindow, HiddenStateRecord, TargetShape
from tide.trainers.checkpoint import (
    KeySet,
    Ledger,
    checkpoints_dir,
    finite_weights,
    load_checkpoint,
    save_checkpoint,
)
from tide.trainers.replay import ReplayBuffer, pack
from tide.trainers.ttt import Example, Metrics, TrainConfig, Trainer, evaluate, select_vocab

log = logging.getLogger("tide.trainers")
# idle time counts once the group has assigned the partitions; a topic that never gets any (it does
# not exist) counts from this long after the start
ASSIGNMENT_WAIT_S = 30.0


class WorkloadTaken(RuntimeError):
    """Another trainer is already training this workload's draft."""


@dataclass
class OnlineConfig:
    bootstrap: str
    workload: str
    state_dir: Path  # checkpoints and candidates of this workload
    # examples are whole requests (a few hundred positions: about six of the records they came in)
    batch_size: int = 1  # new requests per step; as many again come from the replay buffer
    replay_size: int = 400  # requests kept for replay (and saved with the checkpoint)
    # half of each replay batch comes from the newest this many requests: after a shift, steps
    # without new records (most of them: a trainer outpaces its traffic) train mostly on the new
    # workload instead of in proportion to its small share of the buffer
    recent_examples: int = 12
    held_out: HeldOutWindow = field(default_factory=HeldOutWindow)
    vocab_warmup_positions: int = 2048  # positions read before the draft vocabulary is refitted
    # the traffic moved away from the draft vocabulary: refit once the last `vocab_warmup_positions`
    # completion tokens are covered less than this
    refit_coverage: float = 0.8
    # and once per `vocab_warmup_positions` read, after the traffic moved and once what was read of
    # it has doubled since the last fit: refit to all of it when a vocabulary fitted to it would have
    # covered the newest positions better by this much.
    # The first fit sees a few requests of a new traffic: on the shift benchmark's French it covered
    # 0.80 of the held-out tokens, a fit to the whole phase 0.92
    grow_gain: float = 0.02
    checkpoint_every: int = 50  # steps on new records
    eval_every: int = 50  # steps
    publish_every: int = 500  # steps: publish even without improvement
    min_gain: float = 0.005  # held-out tau gain over the last candidate that makes a new one
    # this share of the held-out positions captured since the last candidate: publish again (unless
    # worse). The gate judges a candidate once, on its own held-out window, and right after a shift
    # that is the old traffic topped up (on the shift benchmark the first French candidate was
    # refused on code, and the next came 5 minutes later, when `publish_every` ran out)
    republish_turnover: float = 0.5
    # no new record: train on the replay buffer instead of waiting (a trainer's hardware is there to train)
    replay_when_idle: bool = True
    # records per poll, read until a batch of new examples is full: what comes between two polls (a
    # step per request read) must train well within Kafka's max.poll.interval (5 min), or the group
    # drops the trainer. At 64, a trainer revived behind its topic trained one poll's requests for over
    # 5 minutes on 2 shared cores and lost its partitions (its commits failed until it rejoined)
    poll_records: int = 4
    keep_candidates: int = 3  # candidate folders kept on disk (each is in MLflow once published)
    # trained keys the ledger remembers to recognise redelivered records (about 30 bytes each, and
    # the ledger is saved whole with every checkpoint): hours of a busy workload's records
    ledger_keys: int = 200_000
    # MLflow or Kafka away: retry after 1 s, 2 s, 4 s ... at most every minute
    backoff_first_s: float = 1.0
    backoff_cap_s: float = 60.0
    train: TrainConfig | None = None


@dataclass
class Candidate:
    folder: Path
    version: str
    metrics: Metrics
    ledger: Ledger
    gain: float  # held-out tau over the previous candidate's (or the start draft's), same examples


@dataclass
class Backoff:
    """Capped exponential backoff for a service that may be away: `due()` says whether to try now."""

    first_s: float = 1.0
    cap_s: float = 60.0
    failures: int = 0
    next_at: float = 0.0  # time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self) -> float:
        """Record a failure; returns the seconds until the next try."""
        delay = min(self.cap_s, self.first_s * 2**self.failures)
        self.failures += 1
        self.next_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures, self.next_at = 0, 0.0


def completion_positions(examples: list[Example]) -> int:
    """Positions an evaluation counts: those predicting completion tokens."""
    return sum(max(0, len(e.tokens) - e.learn_from) for e in examples)


def keep_recent(
    examples: list[Example], positions: int, newer_than: float | None = None, floor: int = 0
) -> list[Example]:
    """The newest examples holding at most `positions` learnable (completion) positions, the ones an
    evaluation counts (always the newest example). With `newer_than`, examples captured before it are
    dropped too, unless the newer ones hold fewer than `floor` positions: then the newest older ones
    fill up to `floor` (a quiet workload keeps something to measure on)."""
    total, i = 0, len(examples)
    while i > 0:
        ex = examples[i - 1]
        n = len(ex.tokens) - ex.learn_from
        if i < len(examples) and (
            total + n > positions
            or (newer_than is not None and ex.created_at < newer_than and total >= floor)
        ):
            break
        total += n
        i -= 1
    return examples[i:]


def in_window(examples: list[Example], window: HeldOutWindow, now: float) -> list[Example]:
    """The held-out examples drafts are judged on at `now` (`HeldOutWindow`)."""
    return keep_recent(examples, window.max_positions, now - window.seconds, window.min_positions)


def coverage(examples: list[Example], covered: torch.Tensor) -> float:
    """The share of these completion tokens that `covered` (a bool per target id: the draft
    vocabulary) can say; 1.0 for none."""
    tokens = torch.cat([ex.tokens[ex.learn_from :] for ex in examples] or [torch.zeros(0, dtype=torch.long)])
    return float(covered[tokens].float().mean()) if len(tokens) else 1.0


def newest_uncovered(
    examples: list[Example], covered: torch.Tensor, below: float, min_positions: int
) -> list[Example]:
    """The newest examples whose completions `covered` (a bool per target id) says less than `below`
    of, back to the first one it covers: the traffic that moved the vocabulary off. The window the
    trainer watches is only partly new when its coverage drops, and a vocabulary fitted to all of
    it is half the old workload's (on the shift benchmark a second refit was needed 6 minutes
    later). Too few such positions to fit to: all of `examples`."""
    i = len(examples)
    while i > 0:
        ex = examples[i - 1 : i]
        if completion_positions(ex) and coverage(ex, covered) >= below:
            break
        i -= 1
    return examples[i:] if completion_positions(examples[i:]) >= min_positions else examples


def turned_over(held_out: list[Example], since: float, share: float) -> bool:
    """Were at least `share` of these examples' completion positions captured after `since`?"""
    newer = completion_positions([e for e in held_out if e.created_at > since])
    return newer > 0 and newer >= share * completion_positions(held_out)


def example_of(r: HiddenStateRecord, lm_head: torch.Tensor | None) -> Example | None:
    """A record as an example (lm_head: for evaluation); positions predicting prompt tokens are not learned."""
    m = r.num_positions
    if m < 2:
        return None
    k = int(r.prefill.sum())
    learn_from = k - 1 if k < m else m  # the last prompt position predicts the first completion token
    return Example.make(r.tokens[:m], r.aux, r.hidden, lm_head, max(0, learn_from), r.created_at)


def refit_vocab(draft: Eagle3Draft, ids: torch.Tensor, lm_head: torch.Tensor) -> None:
    """New draft vocabulary: rows the draft already had are kept, new rows start from the target's head."""
    old = {int(t): i for i, t in enumerate(draft.target_ids().tolist())}
    with torch.no_grad():
        fresh = lm_head[ids].to(draft.lm_head.weight.dtype).clone()
        for row, t in enumerate(ids.tolist()):
            if t in old:
                fresh[row] = draft.lm_head.weight[old[t]]
        draft.lm_head.weight.copy_(fresh)
    draft.set_vocab(ids)


def grown_vocab(
    earlier: list[Example], newest: list[Example], covered: torch.Tensor, fitted: int, vocab_size: int,
    fill: list[Example] | None, gain: float,
) -> torch.Tensor | None:  # fmt: skip
    """A draft vocabulary fitted to `earlier + newest` (one traffic, oldest first) if one fitted to
    `earlier` alone covers `newest` at least `gain` better than `covered` (the draft's, a bool per
    target id, fitted to `fitted` completion positions of this traffic) does: judged on positions
    the trial fit never saw. Else None; also until the traffic read has doubled since that fit, as
    coverage grows with the log of what a fit saw (on the shift benchmark's French about 2 points a
    doubling) and judging every window refitted (and reset the optimiser) every two minutes."""
    if not completion_positions(earlier) or not completion_positions(newest):
        return None
    if completion_positions(earlier + newest) < 2 * fitted:
        return None
    size, keep = int(covered.sum()), covered.nonzero().flatten()
    trial = torch.zeros_like(covered)
    trial[select_vocab(earlier, size, vocab_size, fill, keep)] = True
    if coverage(newest, trial) < coverage(newest, covered) + gain:
        return None
    return select_vocab(earlier + newest, size, vocab_size, fill, keep)


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


class OnlineTrainer:
    def __init__(
        self,
        cfg: OnlineConfig,
        head: TargetHead,
        start_draft: Path,
        publish: Callable[[Candidate], None] | None = None,
        log_metrics: Callable[[int, dict[str, float]], None] | None = None,
    ):
        self.cfg = cfg
        self.head = head
        self.start_draft = start_draft
        self.publish = publish
        self.log_metrics = log_metrics
        self._losses: list[float] = []
        self.group = trainer_group(cfg.workload)
        claim_workload(cfg.bootstrap, self.group)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.lm_head = head.lm_head.to(self.device)
        self.ckpt_dir = checkpoints_dir(cfg.state_dir)
        resumed = load_checkpoint(self.ckpt_dir)
        source = resumed.draft_dir if resumed else start_draft
        self.draft = Eagle3Draft.load(source, head.embed, head.config, head.fingerprint, torch.float32)
        self.ledger = resumed.ledger if resumed else Ledger()
        self.replay = ReplayBuffer(cfg.replay_size, resumed.replay if resumed else [])
        self.held_out: list[Example] = resumed.held_out if resumed else []
        self.vocab_fitted = resumed is not None
        self.trainer = self._new_trainer()
        if resumed and resumed.optimizer:
            self.trainer.opt.load_state_dict(resumed.optimizer)
        self.trainer.steps = self.ledger.steps
        shape = TargetShape(head.config.hidden_size, head.config.vocab_size)
        self.consumer = RecordConsumer(
            cfg.bootstrap, [cfg.workload], self.group, head.fingerprint, shape=shape
        )
        self.requests = RequestAssembler()  # the draft learns each request whole, as it serves it
        self._waiting: list[Example] = []  # read before the vocabulary was refitted
        self._recent: list[Example] = []  # the last fresh examples, bare: the draft vocabulary's coverage
        self.published = copy.deepcopy(self.draft).eval()  # what the last candidate was, to compare with
        self.refits = 0
        self._since_refit = 0  # positions read since the vocabulary was last refitted or judged
        # the traffic the vocabulary follows was captured since; None: the vocabulary is the start
        # draft's, fitted offline to all of its training data, which growing would only churn
        self._moved_at: float | None = None
        self._fitted = 0  # completion positions of that traffic the vocabulary was fitted to
        self._fresh_steps = 0  # steps on new records since the last checkpoint
        self._last_publish = self.ledger.steps
        # held-out examples captured after this: the last candidate was never judged on them
        self._published_at = time.time()
        self._last_eval = self.ledger.steps
        # what failed to reach MLflow or Kafka, tried again when its backoff is due
        self._mlflow = Backoff(cfg.backoff_first_s, cfg.backoff_cap_s)
        self._kafka = Backoff(cfg.backoff_first_s, cfg.backoff_cap_s)
        self._unpublished: Candidate | None = None
        self._uncommitted: dict[str, int] | None = None
        log.info(
            "trainer for %s %s at step %d",
            cfg.workload,
            "resumed" if resumed else "started",
            self.ledger.steps,
        )

    def _new_trainer(self) -> Trainer:
        return Trainer(self.draft.to(self.device), self.lm_head, self.cfg.train or TrainConfig())

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, idle_seconds: float | None = None,
            stop: threading.Event | None = None) -> Ledger:  # fmt: skip
        """Train until `max_steps`, until no record arrived for `idle_seconds`, or until `stop` is set."""
        started = idle_since = time.monotonic()
        while not (stop and stop.is_set()) and not (max_steps and self.ledger.steps >= max_steps):
            self._retry()
            replaying = self.cfg.replay_when_idle and self.vocab_fitted and bool(self.replay)
            fresh = self._read(0.05 if replaying else 1.0)
            if fresh is None:
                now = time.monotonic()
                if not self.consumer.assigned and now - started < ASSIGNMENT_WAIT_S:
                    idle_since = now  # no partitions yet, so nothing could arrive: not idle
                elif idle_seconds is not None and now - idle_since > idle_seconds:
                    break
                if replaying:
                    self._replay_step()
                continue
            idle_since = time.monotonic()
            self._train(fresh)
            if self._fresh_steps >= self.cfg.checkpoint_every:
                self.checkpoint()
        self._train([], force=True)
        if self.ledger.steps > self._last_eval:
            self._evaluate()  # the last steps count too
        self.checkpoint()
        self._retry()
        return self.ledger

    def _read(self, timeout: float) -> list[Example] | None:
        """New examples from the next polls, until a batch is full or a poll comes back empty ([] when
        all were duplicates or held out; None when idle)."""
        fresh = self._read_once(timeout)
        while fresh is not None and len(fresh) < self.cfg.batch_size:
            more = self._read_once(0.0)
            if more is None:
                break
            fresh += more
        return fresh

    def _read_once(self, timeout: float) -> list[Example] | None:
        """One poll's new examples (as `_read`)."""
        consumed = self.consumer.poll(self.cfg.poll_records, timeout)
        stats = self.consumer.stats
        self.ledger.skipped, self.ledger.refused = stats.skipped, dict(stats.refused)
        # past refused messages too: poison is skipped once, not read again after every restart
        for where, position in self.consumer.positions.items():
            self.ledger.offsets[where] = max(self.ledger.offsets.get(where, 0), position)
        requests = self.requests.flush()
        if not consumed and not requests:
            return None
        for c in consumed:
            where = f"{c.topic}:{c.partition}"
            self.ledger.offsets[where] = max(self.ledger.offsets.get(where, 0), c.offset + 1)
            self.ledger.first_offsets.setdefault(where, c.offset)
            key = record_key(c.record)
            if key in self.ledger.trained:
                self.ledger.redeliveries += 1
                continue
            self.ledger.trained.add(key)
            self.ledger.records += 1
            requests += self.requests.add(c.record, where, c.offset)
        self.ledger.trim(self.cfg.ledger_keys)
        fresh: list[Example] = []
        for r in requests:
            held = r.held_out
            ex = example_of(r, self.head.lm_head if held else None)
            if ex is None:
                continue
            if held:
                self.held_out.append(ex)
            else:
                fresh.append(ex)
        self._trim_held_out()
        return fresh

    def _trim_held_out(self) -> None:
        cfg = self.cfg
        self.held_out = in_window(self.held_out, cfg.held_out, time.time())

    def _train(self, fresh: list[Example], force: bool = False) -> None:
        if not self.vocab_fitted:
            self._waiting += fresh
            warm = sum(len(e.aux) for e in self._waiting) >= self.cfg.vocab_warmup_positions
            if not self._waiting or not (warm or force):
                return
            if coverage(self._waiting, self.draft.t2d) < self.cfg.refit_coverage:
                self._refit(self._waiting)
                self._moved_at = min(e.created_at for e in self._waiting)
            self.vocab_fitted = True
            fresh, self._waiting = self._waiting, []
        kept = [pack(e) for e in fresh]  # vocabulary decisions read tokens alone: the bare examples
        self._recent = keep_recent(self._recent + [k.bare for k in kept], self.cfg.vocab_warmup_positions)
        self._since_refit += sum(len(ex.tokens) for ex in fresh)
        if self._vocab_stale():
            cfg = self.cfg
            moved = newest_uncovered(
                self._recent, self.draft.t2d, cfg.refit_coverage, cfg.vocab_warmup_positions // 4
            )
            self._refit(moved, self.replay.bare())
            self._moved_at = min(e.created_at for e in moved)
        elif self._since_refit >= self.cfg.vocab_warmup_positions:
            self._grow_vocab()
        n = self.cfg.batch_size
        for i in range(0, len(fresh), n):
            new = fresh[i : i + n]
            self._step(new + self.replay.sample(len(new)))
            self._fresh_steps += 1
        self.replay.add(kept)

    def _replay_step(self) -> None:
        self._step(self.replay.batch(self.cfg.batch_size, self.cfg.recent_examples))

    def _step(self, examples: list[Example]) -> None:
        before = self.trainer.steps
        loss = self.trainer.step(examples)
        if self.trainer.steps == before:  # inf or NaN in the loss or the gradients: no update was made
            self.ledger.nonfinite_steps += 1
            log.warning(
                "skipped a step with a non-finite loss or gradient (%d so far)", self.ledger.nonfinite_steps
            )
            return
        self._losses.append(loss)
        self.ledger.steps = self.trainer.steps
        if self.ledger.steps % self.cfg.eval_every == 0:
            self._evaluate()

    def _vocab_stale(self) -> bool:
        """Has the traffic moved off the draft vocabulary (a shift the trainer sees in the tokens)?"""
        positions = completion_positions(self._recent)
        if (
            positions < self.cfg.vocab_warmup_positions // 2
            or self._since_refit < self.cfg.vocab_warmup_positions
        ):
            return False
        return coverage(self._recent, self.draft.t2d) < self.cfg.refit_coverage

    def _grow_vocab(self) -> None:
        """Refit to everything read since the traffic moved (the newest window included) if that
        covers the newest window better (`grown_vocab`); judged again `vocab_warmup_positions` later.
        Never while the vocabulary is the start draft's (nor after a resume: when the traffic moved
        is not checkpointed)."""
        self._since_refit = 0
        if self._moved_at is None:
            return
        newest = {id(e) for e in self._recent}
        earlier = [e for e in self.replay.bare() if e.created_at >= self._moved_at and id(e) not in newest]
        ids = grown_vocab(
            earlier,
            self._recent,
            self.draft.t2d,
            self._fitted,
            self.head.config.vocab_size,
            self.replay.bare(),
            self.cfg.grow_gain,
        )
        if ids is not None:
            self._refit(earlier + self._recent, self.replay.bare(), ids)

    def _refit(
        self, examples: list[Example], fill: list[Example] | None = None, ids: torch.Tensor | None = None
    ) -> None:
        if ids is None:
            ids = select_vocab(
                examples,
                self.draft.cfg.draft_vocab_size,
                self.head.config.vocab_size,
                fill,
                self.draft.target_ids(),
            )
        refit_vocab(self.draft, ids, self.head.lm_head)
        self._fitted = completion_positions(examples)
        self.trainer = self._new_trainer()
        self.trainer.steps = self.ledger.steps
        self.refits += 1
        self._since_refit = 0
        log.info("draft vocabulary refitted to the last %d examples (refit %d)", len(examples), self.refits)

    def _evaluate(self) -> None:
        self._trim_held_out()
        if not self.held_out:
            return
        m = self.trainer.evaluate(self.held_out)
        self._last_eval = self.ledger.steps
        log_metrics, steps = self.log_metrics, self.ledger.steps
        if log_metrics is not None and self._mlflow.due():  # metrics are dropped while MLflow is away
            train_loss = sum(self._losses) / max(1, len(self._losses))
            metrics = {"train_loss": train_loss, "eval_loss": m.loss, "tau": m.tau[-1], "top1": m.top1[0],
                       "records": float(self.ledger.records), "redeliveries": float(self.ledger.redeliveries)}  # fmt: skip
            self._call(self._mlflow, "log metrics", lambda: log_metrics(steps, metrics))
        self._losses = []
        # the held-out set follows the traffic, so the last candidate is measured again on the same examples
        before = evaluate(self.published, self.lm_head, self.held_out, self.trainer.cfg).tau[-1]
        gain = m.tau[-1] / before - 1.0
        if (
            gain > self.cfg.min_gain
            or (turned_over(self.held_out, self._published_at, self.cfg.republish_turnover) and gain >= 0.0)
            or self.ledger.steps - self._last_publish >= self.cfg.publish_every
        ):
            self.ledger.best_tau = m.tau[-1]
            self._publish(m, gain)

    def _publish(self, m: Metrics, gain: float) -> None:
        if not self._weights_ok():
            return
        self.ledger.candidates += 1
        version = f"{self.cfg.workload}-s{self.ledger.steps}-{time.strftime('%Y%m%d%H%M%S')}"
        folder = self.cfg.state_dir / "candidates" / version
        self.draft.cfg.version = version
        self.draft.save(folder)
        self.published = copy.deepcopy(self.draft).eval()
        self._last_publish = self.ledger.steps
        self._published_at = time.time()
        # the ledger as it is now: a retry after an outage describes the candidate, not later training
        ledger = dataclasses.replace(self.ledger, offsets=dict(self.ledger.offsets),
                                     first_offsets=dict(self.ledger.first_offsets))  # fmt: skip
        self._unpublished = Candidate(folder, version, m, ledger, gain)  # a newer one replaces a waiting one
        self._retry()
        self._trim_candidates()

    def _trim_candidates(self) -> None:
        """Retention: the newest `keep_candidates` folders (never one still waiting to be published)."""
        ours = []
        for f in (self.cfg.state_dir / "candidates").iterdir():
            _, steps, stamp = f.name.rsplit("-", 2) if f.name.count("-") >= 2 else ("", "", "")
            if f.is_dir() and steps[:1] == "s" and steps[1:].isdigit() and stamp.isdigit():  # see `_publish`
                ours.append((stamp, int(steps[1:]), f))
        ours.sort()
        waiting = self._unpublished.folder if self._unpublished else None
        for _, _, old in ours[: max(0, len(ours) - self.cfg.keep_candidates)]:
            if old != waiting:
                shutil.rmtree(old, ignore_errors=True)

    def _call(self, backoff: Backoff, what: str, call: Callable[[], None]) -> bool:
        """Call a service that may be away; a failure is counted, logged and retried after a backoff."""
        try:
            call()
        except Exception as e:  # MLflow, S3 and Kafka raise many types; none of them may end the trainer
            self.ledger.outages += 1
            log.warning(
                "could not %s (%s: %s); trying again in %.0f s", what, type(e).__name__, e, backoff.failed()
            )
            return False
        backoff.succeeded()
        return True

    def _retry(self) -> None:
        """Publish the waiting candidate and commit the waiting offsets, each when its backoff is due."""
        c, publish, offsets = self._unpublished, self.publish, self._uncommitted
        if (
            c is not None
            and self._mlflow.due()
            and (publish is None or self._call(self._mlflow, f"publish {c.version}", lambda: publish(c)))
        ):
            self._unpublished = None
        if (
            offsets is not None
            and self._kafka.due()
            and self._call(self._kafka, "commit offsets", lambda: self.consumer.commit_offsets(offsets))
        ):
            self._uncommitted = None

    def _weights_ok(self) -> bool:
        """Finite weights; else they are put back to the last checkpoint's (or the start draft's).
        Skipping non-finite steps should keep them finite: this is the last line, before anything
        is saved."""
        if finite_weights(self.draft):
            return True
        self.ledger.reverts += 1
        resumed = load_checkpoint(self.ckpt_dir)
        source = resumed.draft_dir if resumed else self.start_draft
        log.error("the draft's weights are not finite: back to %s (revert %d)", source, self.ledger.reverts)
        head = self.head
        self.draft = Eagle3Draft.load(source, head.embed, head.config, head.fingerprint, torch.float32)
        self.trainer = self._new_trainer()
        self.trainer.steps = self.ledger.steps
        if resumed and resumed.optimizer:
            self.trainer.opt.load_state_dict(resumed.optimizer)
        return False

    def checkpoint(self) -> None:
        """Make the training so far durable, then commit the offsets it covers."""
        self._train([], force=True)  # records read but held back for the vocabulary are trained first
        self._weights_ok()
        # records of requests still being assembled are not covered: a resumed trainer reads them again
        holding, held = self.requests.holding(), self.requests.keys()
        ledger = dataclasses.replace(
            self.ledger,
            trained=KeySet(k for k in self.ledger.trained if k not in held),
            records=self.ledger.records - len(held),
            offsets={w: min(o, holding.get(w, o)) for w, o in self.ledger.offsets.items()},
        )
        save_checkpoint(
            self.ckpt_dir, ledger, self.draft, self.trainer.opt, self.replay.examples(), self.held_out
        )
        self._fresh_steps = 0
        # the checkpoint holds them: a commit that fails only means records delivered again, which the
        # ledger recognises; the newest offsets are the ones to commit
        self._uncommitted = ledger.offsets
        self._retry()

    def close(self) -> None:
        self.consumer.close()
