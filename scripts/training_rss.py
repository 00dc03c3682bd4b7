"""A training loop's memory as new examples arrive: `python scripts/training_rss.py [DRAFT] [--steps 60]
[--mmap-threshold] [--kernel-cache] [--shape-step 32]`. Each step trains on one new random example (60-450 positions,
kept as a trainer keeps its replay buffer) and three earlier ones; every 10 steps it prints RSS (from
/proc) and the bytes of live tensors, so allocator growth shows apart from data."""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import time
from pathlib import Path

import torch

from tide.config import MMAP_THRESHOLD, bound_kernel_cache
from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.loader import load_head
from tide.trainers import ttt


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def live_mb() -> float:
    return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if torch.is_tensor(o)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "draft", type=Path, nargs="?", help="a draft folder (default: a fresh 32k-vocabulary draft)"
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mmap-threshold", action="store_true", help="as every tide process sets it")
    ap.add_argument("--shape-step", type=int, default=ttt.SHAPE_STEP, help="1: every length its own shape")
    ap.add_argument("--kernel-cache", action="store_true", help="bound oneDNN's kernel cache, as trainers do")
    args = ap.parse_args()
    if args.kernel_cache:
        bound_kernel_cache()
    if args.mmap_threshold:
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)
    ttt.SHAPE_STEP = args.shape_step
    head = load_head(None)
    if args.draft is None:
        draft = Eagle3Draft(DraftConfig.for_target(head.config, head.fingerprint, 32_000), head.embed)
        draft.set_vocab(torch.arange(draft.cfg.draft_vocab_size))
    else:
        draft = Eagle3Draft.load(args.draft, head.embed, head.config, head.fingerprint, torch.float32)
    d, vocab = head.lm_head.shape[1], head.lm_head.shape[0]
    trainer = ttt.Trainer(draft, head.lm_head, ttt.TrainConfig())
    rnd = random.Random(0)
    examples: list[ttt.Example] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        n = rnd.randint(60, 450)
        aux, hidden = torch.randn(n, 3 * d).bfloat16(), torch.randn(n, d).bfloat16()
        examples = [*examples, ttt.Example.make(torch.randint(0, vocab, (n,)), aux, hidden, None, n // 2)][
            -400:
        ]
        trainer.step([examples[-1], *rnd.sample(examples, min(3, len(examples)))])
        if step % 10 == 0:
            kept = (
                sum(e.aux.nbytes + e.hidden.nbytes + e.tokens.nbytes + e.best.nbytes for e in examples)
                / 2**20
            )
            print(
                f"step {step}: RSS {rss_mb():.0f} MB, live tensors {live_mb():.0f} MB, "
                f"of which examples {kept:.0f} MB; {(time.perf_counter() - t0) / 10:.1f} s a step",
                flush=True,
            )
            t0 = time.perf_counter()


if __name__ == "__main__":
    main()
