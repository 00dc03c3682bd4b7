"""The online trainer: one workload's records from Kafka → incremental EAGLE-3 training → candidates.
It orchestrates parts with one job each: `reader.RecordReader` (records as whole requests, each
once), `vocab.VocabFollower` (the draft vocabulary follows the tokens), `replay.ReplayBuffer`,
`ttt.Trainer` (the step), `checkpoint` (durability) and `outbox.Outbox` (MLflow and Kafka, retried).

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

from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import TargetHead
from tide.names import trainer_group
from tide.producers.consumer import RecordConsumer
from tide.producers.records import DEFAULT_CODEC, HeldOutWindow
from tide.producers.topics import TopicSizing
from tide.trainers.checkpoint import (
    KeySet,
    Ledger,
    checkpoints_dir,
    finite_weights,
    load_checkpoint,
    save_checkpoint,
)
from tide.trainers.examples import in_window, turned_over
from tide.trainers.outbox import Candidate, Outbox
from tide.trainers.reader import RecordReader, claim_workload
from tide.trainers.replay import ReplayBuffer
from tide.trainers.topic_sizer import TopicSizer
from tide.trainers.ttt import Example, Metrics, TrainConfig, Trainer, evaluate
from tide.trainers.vocab import VocabFollower

log = logging.getLogger("tide.trainers")
# idle time counts once the group has assigned the partitions; a topic that never gets any (it does
# not exist) counts from this long after the start
ASSIGNMENT_WAIT_S = 30.0


@dataclass
class OnlineConfig:
    bootstrap: str
    workload: str
    state_dir: Path  # checkpoints and candidates of this workload
    # examples are whole requests (a few hundred positions: about six of the records they came in)
    batch_size: int = 1  # new requests per step; as many again come from the replay buffer
    replay_size: int = 400  # requests kept for replay (and saved with the checkpoint)
    codec: str = DEFAULT_CODEC  # how the replay buffer and checkpoints keep states (a record codec)
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
    # the topic keeps what a trainer this far behind still needs, measured from its traffic (None: as made)
    topic_sizing: TopicSizing | None = field(default_factory=TopicSizing)
    resize_every_s: float = 300.0
    train: TrainConfig | None = None


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
        self.replay = ReplayBuffer(cfg.replay_size, resumed.replay if resumed else [], cfg.codec)
        self.held_out: list[Example] = resumed.held_out if resumed else []
        self.trainer = self._new_trainer()
        if resumed and resumed.optimizer:
            self.trainer.opt.load_state_dict(resumed.optimizer)
        self.vocab = VocabFollower(head, cfg.vocab_warmup_positions, cfg.refit_coverage, cfg.grow_gain,
                                   resumed is not None, self._reset_optimizer)  # fmt: skip
        self.reader = RecordReader(cfg.bootstrap, cfg.workload, self.group, head, self.ledger,
                                   cfg.poll_records, cfg.ledger_keys)  # fmt: skip
        self.sizer = (
            TopicSizer(cfg.bootstrap, cfg.workload, cfg.topic_sizing, cfg.resize_every_s, self.ledger)
            if cfg.topic_sizing
            else None
        )
        # late-bound: the consumer is the reader's, and what commits is looked up when it commits
        self.outbox = Outbox(publish, lambda offsets: self.consumer.commit_offsets(offsets), self.ledger,
                             cfg.backoff_first_s, cfg.backoff_cap_s)  # fmt: skip
        self.published = copy.deepcopy(self.draft).eval()  # what the last candidate was, to compare with
        self._fresh_steps = 0  # steps on new records since the last checkpoint
        self._last_publish = self.ledger.steps
        # held-out examples captured after this: the last candidate was never judged on them
        self._published_at = time.time()
        self._last_eval = self.ledger.steps
        log.info(
            "trainer for %s %s at step %d",
            cfg.workload,
            "resumed" if resumed else "started",
            self.ledger.steps,
        )

    @property
    def consumer(self) -> RecordConsumer:
        return self.reader.consumer

    def _new_trainer(self) -> Trainer:
        trainer = Trainer(self.draft.to(self.device), self.lm_head, self.cfg.train or TrainConfig())
        trainer.steps = self.ledger.steps
        return trainer

    def _reset_optimizer(self) -> None:
        """The vocabulary was refitted: its rows changed under the optimiser's state."""
        self.trainer = self._new_trainer()

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, idle_seconds: float | None = None,
            stop: threading.Event | None = None) -> Ledger:  # fmt: skip
        """Train until `max_steps`, until no record arrived for `idle_seconds`, or until `stop` is set."""
        started = idle_since = time.monotonic()
        while not (stop and stop.is_set()) and not (max_steps and self.ledger.steps >= max_steps):
            self.outbox.flush()
            if self.sizer:
                self.sizer(self.reader.traffic)
            replaying = self.cfg.replay_when_idle and self.vocab.fitted and bool(self.replay)
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
        self.outbox.flush()
        return self.ledger

    def _read(self, timeout: float) -> list[Example] | None:
        """New examples to train on ([] when all were duplicates or held out; None when idle)."""
        got = self.reader.read(self.cfg.batch_size, timeout)
        if got is None:
            return None
        self.held_out += got.held_out
        self._trim_held_out()
        return got.train

    def _trim_held_out(self) -> None:
        self.held_out = in_window(self.held_out, self.cfg.held_out, time.time())

    def _train(self, fresh: list[Example], force: bool = False) -> None:
        fresh = self.vocab.admit(fresh, self.draft, force)
        if not self.vocab.fitted:
            return
        # vocabulary decisions read tokens alone: the bare examples
        kept = [self.replay.pack(e) for e in fresh]
        self.vocab.follow([k.bare for k in kept], self.draft, self.replay.bare())
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

    def _evaluate(self) -> None:
        self._trim_held_out()
        if not self.held_out:
            return
        m = self.trainer.evaluate(self.held_out)
        self._last_eval = self.ledger.steps
        log_metrics, steps, out = self.log_metrics, self.ledger.steps, self.outbox
        if log_metrics is not None and out.mlflow.due():  # metrics are dropped while MLflow is away
            train_loss = sum(self._losses) / max(1, len(self._losses))
            metrics = {"train_loss": train_loss, "eval_loss": m.loss, "tau": m.tau[-1], "top1": m.top1[0],
                       "records": float(self.ledger.records), "redeliveries": float(self.ledger.redeliveries)}  # fmt: skip
            out.call(out.mlflow, "log metrics", lambda: log_metrics(steps, metrics))
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
        self.outbox.candidate = Candidate(folder, version, m, ledger, gain)  # replaces a waiting one
        self.outbox.flush()
        self._trim_candidates()

    def _trim_candidates(self) -> None:
        """Retention: the newest `keep_candidates` folders (never one still waiting to be published)."""
        ours = []
        for f in (self.cfg.state_dir / "candidates").iterdir():
            _, steps, stamp = f.name.rsplit("-", 2) if f.name.count("-") >= 2 else ("", "", "")
            if f.is_dir() and steps[:1] == "s" and steps[1:].isdigit() and stamp.isdigit():  # see `_publish`
                ours.append((stamp, int(steps[1:]), f))
        ours.sort()
        waiting = self.outbox.candidate.folder if self.outbox.candidate else None
        for _, _, old in ours[: max(0, len(ours) - self.cfg.keep_candidates)]:
            if old != waiting:
                shutil.rmtree(old, ignore_errors=True)

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
        if resumed and resumed.optimizer:
            self.trainer.opt.load_state_dict(resumed.optimizer)
        return False

    def checkpoint(self) -> None:
        """Make the training so far durable, then commit the offsets it covers."""
        self._train([], force=True)  # records read but held back for the vocabulary are trained first
        self._weights_ok()
        # records of requests still being assembled are not covered: a resumed trainer reads them again
        requests = self.reader.requests
        holding, held = requests.holding(), requests.keys()
        ledger = dataclasses.replace(
            self.ledger,
            trained=KeySet(k for k in self.ledger.trained if k not in held),
            records=self.ledger.records - len(held),
            offsets={w: min(o, holding.get(w, o)) for w, o in self.ledger.offsets.items()},
        )
        replay, held_out = self.replay.examples(), self.held_out
        save_checkpoint(self.ckpt_dir, ledger, self.draft, self.trainer.opt, replay, held_out, self.cfg.codec)
        self._fresh_steps = 0
        # the checkpoint holds them: a commit that fails only means records delivered again, which the
        # ledger recognises; the newest offsets are the ones to commit
        self.outbox.offsets = ledger.offsets
        self.outbox.flush()

    def close(self) -> None:
        self.reader.close()
