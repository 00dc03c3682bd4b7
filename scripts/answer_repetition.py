"""How much of the target's greedy answers repeats what came before in the same request.

`python scripts/answer_repetition.py --prompts workloads/chat_fr.jsonl [--part test] [--limit 8] [--max-new-tokens 192]`

For each prompt, the share of answer tokens whose three preceding tokens already occurred earlier in
the prompt or answer, followed by the same token: what a suffix index can continue from the
sequence's own context alone. A small model's greedy answers loop, which inflates what such an index
gains over fluent text; this says by how much for a workload.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tide.models.loader import load_target
from tide.prompts import load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams


def repeated_share(prompt: list[int], answer: list[int], n: int = 3) -> float:
    seq = prompt + answer
    seen: dict[tuple[int, ...], int] = {}
    hits = 0
    for i in range(n, len(seq)):
        key = tuple(seq[i - n : i])
        if i >= len(prompt) and seen.get(key) == seq[i]:
            hits += 1
        seen[key] = seq[i]
    return hits / max(1, len(answer))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--part", default="test")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    args = ap.parse_args()
    target = load_target(None, torch.bfloat16)
    engine = Engine(target, None, EngineConfig(max_batch=1, max_model_len=2048, gamma=0))
    shares = []
    for p in split(load_prompts(args.prompts), args.part)[: args.limit]:
        ids = p.token_ids(target.tok)
        answer = engine.generate([ids], SamplingParams(max_tokens=args.max_new_tokens))[0].output
        shares.append(repeated_share(ids, answer))
        print(f"{len(answer):4d} tokens, {shares[-1]:.0%} repeated: {target.tok.decode(answer)[:100]!r}")
    print(f"median {statistics.median(shares):.0%}, range {min(shares):.0%}-{max(shares):.0%}")


if __name__ == "__main__":
    main()
