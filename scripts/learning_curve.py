"""How fast the trainer learns a new traffic: held-out tau against the requests it trained on.

`python scripts/learning_curve.py WORK_DIR START_DRAFT [--requests workloads/chat_fr.jsonl] [--lrs 1e-3,3e-3]
[--replay-steps 30] [--recent 64]` restarts the Kafka broker of a finished `tide bench shift --work-dir
WORK_DIR` (as `replay_gate.py` does) and reads every record, joined into the requests they were cut
from. The requests whose id starts with `--requests` (the new traffic) are split as they were
captured: held out, or to train on. A copy of START_DRAFT (the static draft: what the trainer started
the run from) is trained the way the online trainer trains (its `OnlineConfig` defaults): its
vocabulary refitted on the first 2,048 new positions, the earlier traffic's requests in its replay
buffer, each step one new request and one from the buffer, and between new requests `--replay-steps`
steps on the buffer (one from its newest `--recent`, one from all of it; live, with traffic of one
request every 12-13 s, the trainer made about 30 per new step). It prints, per learning rate,
held-out tau at gamma 1..4 on all the new traffic's held-out requests each time the requests trained
on double, after the held-out tau of each `--compare` draft (say, the run's own candidates) on the
same requests. `--lrs ''` only compares. Each learning rate takes minutes per hundred steps.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from replay_gate import read_records

from tide.infra.kafka.broker import KafkaBroker
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import TargetHead, load_head
from tide.trainers.examples import completion_positions, keep_recent
from tide.trainers.online import OnlineConfig
from tide.trainers.replay import ReplayBuffer
from tide.trainers.ttt import Example, TrainConfig, Trainer, evaluate, select_vocab
from tide.trainers.vocab import coverage, grown_vocab, refit_vocab

BATCH = OnlineConfig.batch_size


def curve(
    head: TargetHead, start: Path, old: list[Example], new: list[Example], held: list[Example], lr: float,
    replay_steps: int, recent: int, warmup_positions: int, grow_gain: float | None,
) -> None:  # fmt: skip
    """Prints held-out tau by gamma each time the requests trained on double."""
    draft = Eagle3Draft.load(start, head.embed, head.config, head.fingerprint, torch.float32)
    cfg = TrainConfig(lr=lr)
    warm, n = 0, 0
    while warm < len(new) and sum(len(e.tokens) for e in new[: warm + 1]) < warmup_positions:
        warm += 1

    def fit(ids: torch.Tensor) -> Trainer:
        refit_vocab(draft, ids, head.lm_head)
        return Trainer(draft, head.lm_head, cfg)

    trainer = fit(
        select_vocab(
            new[: warm + 1], draft.cfg.draft_vocab_size, head.config.vocab_size, old, draft.target_ids()
        )
    )
    since_fit, refits, fitted = 0, 1, completion_positions(new[: warm + 1])
    replay = ReplayBuffer(OnlineConfig.replay_size, old)
    report = 8
    while n < len(new):
        fresh = new[n : n + BATCH]
        since_fit += sum(len(e.tokens) for e in fresh)
        if grow_gain is not None and n > warm and since_fit >= warmup_positions:
            # as the online trainer grows its vocabulary with the traffic
            window = keep_recent(new[: n + len(fresh)], warmup_positions)
            earlier = new[: n + len(fresh) - len(window)]
            since_fit = 0
            if (
                ids := grown_vocab(earlier, window, draft.t2d, fitted, head.config.vocab_size, old, grow_gain)
            ) is not None:
                steps = trainer.steps
                trainer = fit(ids)
                trainer.steps, refits = steps, refits + 1
                fitted = completion_positions(earlier + window)
        trainer.step(fresh + replay.sample(len(fresh)))
        replay.extend(fresh)
        n += len(fresh)
        for _ in range(replay_steps):
            trainer.step(replay.batch(BATCH, recent))
        if n >= report or n >= len(new):
            tau = evaluate(draft.eval(), head.lm_head, held, cfg).tau
            draft.train()
            print(f"lr {lr:g}: {n:4d} requests, {trainer.steps:5d} steps, {refits} vocabulary fits "
                  f"(coverage {coverage(held, draft.t2d):.3f}), held-out tau {[round(t, 3) for t in tau]}",
                  flush=True)  # fmt: skip
            report *= 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("start", type=Path)
    ap.add_argument(
        "--requests", default="workloads/chat_fr.jsonl", help="request ids of the new traffic start so"
    )
    ap.add_argument("--lrs", default="1e-3")
    ap.add_argument("--replay-steps", type=int, default=30)
    ap.add_argument("--recent", type=int, default=OnlineConfig.recent_examples)
    ap.add_argument("--workload", default="default")
    ap.add_argument("--seed", type=int, default=0, help="of the replay sampling and the new rows' order")
    ap.add_argument(
        "--warmup",
        type=int,
        default=OnlineConfig.vocab_warmup_positions,
        help="positions the vocabulary is first fitted on",
    )
    ap.add_argument(
        "--grow-gain",
        type=float,
        default=None,
        help="grow the vocabulary as the online trainer does, at this coverage gain (default: never)",
    )
    ap.add_argument(
        "--compare", default="", help="draft folders to score on the same held-out requests, comma-separated"
    )
    args = ap.parse_args()
    if not (args.work / "kafka" / "ports.json").is_file():
        sys.exit(f"{args.work} is not the --work-dir of a finished `tide bench shift`")
    head = load_head()
    with KafkaBroker(args.work / "kafka") as kafka:
        records = read_records(kafka.bootstrap, head, args.workload)
    first = min((ex.created_at for rid, _, ex in records if rid.startswith(args.requests)), default=None)
    if first is None:
        sys.exit(f"no requests {args.requests}*")
    old = [ex for rid, held, ex in records if not held and ex.created_at < first]
    new = [ex for rid, held, ex in records if not held and rid.startswith(args.requests)]
    held = [ex for rid, h, ex in records if h and rid.startswith(args.requests)]
    print(f"{len(old)} earlier requests in the replay buffer; new traffic: {len(new)} to train on "
          f"({sum(len(e.tokens) for e in new)} positions), {len(held)} held out", flush=True)  # fmt: skip
    if not held:
        sys.exit(f"no held-out requests {args.requests}* to measure on")
    for folder in filter(None, args.compare.split(",")):
        draft = Eagle3Draft.load(folder, head.embed, head.config, head.fingerprint, torch.float32)
        tau = evaluate(draft, head.lm_head, held, TrainConfig()).tau
        print(f"{folder}: held-out tau {[round(t, 3) for t in tau]}", flush=True)
    for lr in (float(x) for x in filter(None, args.lrs.split(","))):
        random.seed(args.seed)  # the replay batches: runs that differ only in an option are comparable
        torch.manual_seed(args.seed)
        curve(
            head,
            args.start,
            old[-OnlineConfig.replay_size :],
            new,
            held,
            lr,
            args.replay_steps,
            args.recent,
            args.warmup,
            args.grow_gain,
        )


if __name__ == "__main__":
    main()
