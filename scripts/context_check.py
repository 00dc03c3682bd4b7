"""Does the held-out evaluation measure what serving gets? Served tau against evaluated tau.

`python scripts/context_check.py DRAFT [DRAFT ...] [--prompts workloads/code.jsonl] [--limit 6]
[--gamma 3]` serves the test prompts with each draft at a fixed gamma (greedy, batch 1, capture on),
then evaluates the same draft (as the gate does: float32, the greedy chain, served steps) on the
states those requests left, once as whole requests and once cut into records of 64 and of 128
positions the way the publisher cuts them (and through the int8-g64 codec). The tokens per step
serving measured and the evaluation of whole requests should agree; a record alone starts with no
context, so the evaluation of records is lower by what a draft gets from the context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tide.bench.records import as_records
from tide.bootstrap import Recorder
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import load_target
from tide.producers.records import decode, encode
from tide.prompts import load_prompts, split
from tide.serving.drafts import DraftStats
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.trainers.examples import example_of
from tide.trainers.ttt import TrainConfig, evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", type=Path, nargs="+")
    ap.add_argument("--prompts", default="workloads/code.jsonl")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    args = ap.parse_args()
    target = load_target(None, torch.bfloat16)
    lm_head = target.model.lm_head.weight.detach().float()
    prompts = [p.token_ids(target.tok) for p in split(load_prompts(args.prompts), "test")[: args.limit]]
    cfg = TrainConfig(ttt_steps=max(4, args.gamma))
    for path in args.drafts:
        draft = Eagle3Draft.load(
            path, target.model.embed_tokens, target.config, target.fingerprint, torch.bfloat16
        )
        rec = Recorder()
        length = max(len(p) for p in prompts) + args.max_new_tokens + 8
        engine = Engine(
            target, draft, EngineConfig(max_batch=1, max_model_len=length, gamma=args.gamma), tap=rec
        )
        engine.stats = DraftStats(engine.cfg.max_gamma)
        seqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
        served = engine.stats.mean_accept_length
        # its own requests: bf16 verification of different chains can part greedy texts a little
        examples = [rec.example(s.request_id, lm_head) for s in seqs]
        judge = Eagle3Draft.load(
            path, target.model.embed_tokens, target.config, target.fingerprint, torch.float32
        )
        row = {"draft": str(path), "served": round(served, 3)}
        row["whole"] = round(evaluate(judge.eval(), lm_head, examples, cfg).step_tau[args.gamma - 1], 3)
        for size in (64, 128):
            pieces = [
                example_of(decode(encode(r)), lm_head)
                for e in examples
                for r in as_records(e, target.fingerprint, size)
            ]
            scored = [p for p in pieces if p is not None]
            row[f"records_{size}"] = round(evaluate(judge, lm_head, scored, cfg).step_tau[args.gamma - 1], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
