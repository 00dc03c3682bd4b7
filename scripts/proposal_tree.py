"""Would verifying both proposals as a tree pay? Measured on the states hybrid serving visits.

`python scripts/proposal_tree.py --prompts workloads/code_edits.jsonl --draft DIR [--limit 16]
[--max-new-tokens 128] [--gamma 4] [--out report.json]`

Hybrid serving (batch 1, greedy, fixed gamma) drafts each step from the suffix index or from the
learned draft, whichever the cost model expects to pay more. Here the draft also runs on the steps
the index won, so every step records both offers: the draft's chain and the index's proposal. Greedy
decoding is deterministic, so once a request is done its answer says how many tokens of each offer
the target would have accepted at that step (the longest common prefix with what followed). Three
policies are then scored on the same steps:

- hybrid: the offer the engine chose (what it verified; the script checks its count against the
  engine's own),
- draft: the learned draft's chain alone,
- tree: both offers verified in one pass as a two-branch tree (their shared prefix once), the longer
  accepted branch kept.

Tokens per second are the tokens each policy commits over its step times: drafting and target passes
of n tokens from a step profile measured here (`measure_profile`), plus the engine's own per-step
overhead (its measured step time minus the profile's prediction for what it ran). A tree pass is
priced as a chain pass of as many tokens: the same matrix work, only the attention mask differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tide.bench.spec import ModeResult
from tide.config import native_dtype
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target, load_target
from tide.prompts import load_prompts, split
from tide.registry.profile import StepProfile
from tide.serving.batch_state import BatchState
from tide.serving.cost_model import measure_profile
from tide.serving.drafts import DraftSet
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.sequence import Sequence
from tide.serving.speculation import Proposal, Speculator
from tide.serving.suffix import SuffixProposal, SuffixProposer


@dataclass
class RowStep:
    """One sequence's step: where it stood and what each source offered."""

    seq: Sequence
    position: int  # index of the token being decoded; its continuation starts one further
    offer: list[int]  # the suffix index's proposal ([]: none)
    chose_index: bool
    draft: list[int] = field(default_factory=list)


class RecordingSpeculator(Speculator):
    """Hands every chain it drafts to the rows of the step being recorded."""

    def __init__(self, state: BatchState, drafts: DraftSet, vocab_size: int):
        super().__init__(state, drafts, vocab_size)
        self.pending: list[RowStep] = []

    def propose(
        self,
        groups: dict[str, list[int]],
        lo: int,
        bsz: int,
        gamma: int,
        params: list[SamplingParams],
        u: torch.Tensor | None,
        stop_below: float = 0.0,
    ) -> Proposal | None:
        out = super().propose(groups, lo, bsz, gamma, params, u, stop_below)
        if out is not None:
            for row, tokens in zip(self.pending, out[0].tolist(), strict=True):
                row.draft = tokens
        return out


class RecordingEngine(Engine):
    """A hybrid engine that also drafts on the steps its index wins, and records both offers."""

    def __init__(self, target: Target, draft: Eagle3Draft, cfg: EngineConfig) -> None:
        super().__init__(target, draft, cfg)
        self.speculator = RecordingSpeculator(self.batch, self.drafts, self.model.cfg.vocab_size)
        self.rows: list[RowStep] = []

    def _suffix_picks(
        self, seqs: list[Sequence], groups: dict[str, list[int]] | None, gamma: int
    ) -> list[SuffixProposal | None]:
        picks = super()._suffix_picks(seqs, groups, gamma)
        assert self.suffix is not None and isinstance(self.speculator, RecordingSpeculator)
        step = []
        for i, (seq, pick) in enumerate(zip(seqs, picks, strict=True)):
            context = self.batch.tokens[i, : int(self.batch.lengths[i]) + 1]
            # what the index offers, chosen or not (no controller here: the engine asked the same)
            raw = pick or self.suffix.propose(seq.workload, context, self.cfg.max_gamma)
            step.append(RowStep(seq, len(context) - 1, raw.tokens if raw else [], pick is not None))
        self.speculator.pending = step
        self.rows += step
        if groups and gamma and all(p is not None for p in picks):
            # the engine skips the draft on such a step: draft here, as a mixed batch's step does
            params = [q.params for q in seqs]
            self.speculator.propose(groups, 0, len(seqs), gamma, params, None, self.policy.stop_below)
        return picks


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def step_tokens(r: RowStep) -> tuple[int, int]:
    """Tokens the step would have committed verifying the draft's chain, and the index's offer: the
    accepted ones and one more, no further than the answer went (its end token included)."""
    truth = (r.seq.prompt + r.seq.output)[r.position + 1 :]
    end = len(truth) + (r.seq.finish_reason == "stop")
    return min(1 + common_prefix(r.draft, truth), end), min(1 + common_prefix(r.offer, truth), end)


def score(rows: list[RowStep], profile: StepProfile, gamma: int, overhead: float) -> dict[str, ModeResult]:
    """Tokens and seconds of each policy over the recorded steps (batch 1: one row a step)."""
    out = {name: ModeResult() for name in ("hybrid", "draft", "tree")}
    drafting = profile.drafting(gamma)
    for r in rows:
        t_d, t_s = step_tokens(r)
        draft_step = drafting + profile.target[len(r.draft) + 1] + overhead
        out["draft"].tokens += t_d
        out["draft"].seconds += draft_step
        if r.chose_index:
            out["hybrid"].tokens += t_s
            out["hybrid"].seconds += profile.target[len(r.offer) + 1] + overhead
        else:
            out["hybrid"].tokens += t_d
            out["hybrid"].seconds += draft_step
        union = len(r.draft) + len(r.offer) - common_prefix(r.draft, r.offer)
        out["tree"].tokens += max(t_d, t_s)
        out["tree"].seconds += drafting + profile.target[union + 1] + overhead
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--part", default="test")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    dtype = native_dtype()
    target = load_target(None, dtype)
    draft = Eagle3Draft.load(args.draft, target.model.embed_tokens, target.config, target.fingerprint, dtype)
    prompts = [p.token_ids(target.tok) for p in split(load_prompts(args.prompts), args.part)[: args.limit]]
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 8
    cfg = EngineConfig(max_batch=1, max_model_len=max_len, gamma=args.gamma, proposer="hybrid")
    engine = RecordingEngine(target, draft, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
    engine.rows, engine.timing.decode_steps, engine.timing.decode_seconds = [], 0, 0.0
    engine.suffix = SuffixProposer(cfg.suffix)  # the index starts empty
    committed = 0  # tokens the decode steps committed (the first came from prefill; an end token counts)
    for p in tqdm(prompts, desc="hybrid, both offers recorded", unit="prompt"):
        (seq,) = engine.generate([p], params)
        committed += len(seq.output) - 1 + (seq.finish_reason == "stop")

    rows = [r for r in engine.rows if r.draft]  # a step whose chain failed offers nothing to compare
    width = args.gamma + cfg.suffix.max_tokens + 1
    context = int(statistics.median(len(p) for p in prompts)) + args.max_new_tokens // 2
    profile = measure_profile(target.model, draft, 1, context, width)
    # what the engine ran: the draft on every step, the chosen offer verified
    ran = sum(
        profile.drafting(args.gamma) + profile.target[(len(r.offer) if r.chose_index else len(r.draft)) + 1]
        for r in rows
    )
    overhead = max(0.0, engine.timing.decode_seconds - ran) / max(1, engine.timing.decode_steps)
    scores = score(rows, profile, args.gamma, overhead)
    both = sum(1 for r in rows if r.offer)
    report = {
        "prompts": args.prompts,
        "draft": args.draft,
        "gamma": args.gamma,
        "steps": len(rows),
        "steps_index_offered": both,
        "steps_index_chosen": sum(r.chose_index for r in rows),
        # steps on which the offer not chosen would have committed more than the one chosen
        "steps_tree_ahead": sum(max(step_tokens(r)) > step_tokens(r)[r.chose_index] for r in rows),
        # a check on the recount: what the engine kept, and what the answers say the chosen offers kept
        "committed_engine": committed,
        "committed_recounted": scores["hybrid"].tokens,
        "overhead_s": overhead,
        "measured_step_s": engine.timing.step,
        "predicted_step_s": ran / max(1, len(rows)),
        "profile_target_s": profile.target,
        "profile_drafting_s": profile.drafting(args.gamma),
        "policies": {
            k: {**asdict(v), "tokens_per_step": v.tokens / len(rows), "tokens_per_s": v.tokens_per_s}
            for k, v in scores.items()
        },
        "tree_over_hybrid": scores["tree"].tokens_per_s / scores["hybrid"].tokens_per_s,
        "hybrid_over_draft": scores["hybrid"].tokens_per_s / scores["draft"].tokens_per_s,
    }
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("profile")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
