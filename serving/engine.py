"""The serving engine: continuous batching with EAGLE-3 chain speculation over one static KV cache.

`step()` takes queued draft swaps over, admits waiting requests (prefill, one at a time), then
advances every running sequence by one target forward pass: the draft proposes gamma tokens per
sequence, the target verifies all of them for the whole batch at once, and each sequence keeps its
accepted prefix plus one correction/bonus token. The engine orchestrates parts with one job each:

| part | module | job |
| --- | --- | --- |
| `BatchState` | `batch_state.py` | slots, KV cache, tokens, aux states, lengths; compaction |
| `DraftSet` | `drafts.py` | which draft serves which workload; swaps; failing drafts reverted |
| `Speculator`, `accept` | `speculation.py` | chain drafting per draft; the exact accept rule |
| `GammaPolicy` | `gamma_policy.py` | gamma per step: fixed, or the controller's |
| `SuffixProposer` | `suffix.py` | drafts from the workload's recent text where that is expected to pay more |
| `Sequence` | `sequence.py` | a request's output and its stop conditions |

One request cannot fail another: its sampling settings and token ids are checked when it is added,
its own work in a step (prefill, appending tokens, stop strings, text) fails it alone, and a batched
decode that raises is decoded again sequence by sequence to find the culprit (nothing is committed
before the verify pass has succeeded). A draft that raises costs its step's speculation only; after
`draft_failures` such steps in a row its workload goes back to the draft it had before (or none),
and the engine reports itself degraded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tide.models.eagle3 import DraftKV, Eagle3Draft
from tide.models.llama import Batch
from tide.models.loader import Target
from tide.producers.records import is_held_out
from tide.producers.tap import TapCallback, TapEvent
from tide.registry.profile import StepProfile
from tide.serving.batch_state import BatchState
from tide.serving.controller import Controller
from tide.serving.cost_model import measure_profile
from tide.serving.detokenizer import Detokenizer
from tide.serving.draft_sink import LiveAcceptance
from tide.serving.drafts import DraftSet, DraftSlot, DraftStats
from tide.serving.gamma_policy import AdaptiveGamma, FixedGamma, GammaPolicy
from tide.serving.sampling import BatchSampling, SamplingParams, probs_from_logits, sample
from tide.serving.sequence import Sequence, StepOutput
from tide.serving.speculation import Speculator, accept, with_suffix
from tide.serving.suffix import SuffixConfig, SuffixProposal, SuffixProposer

log = logging.getLogger("tide.serving")

BUSY_REFRESH_S = 60.0  # a busy node's step times stale this long are measured again between two steps


PROPOSERS = ("draft", "suffix", "hybrid")


@dataclass
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 2048  # prompt + completion
    gamma: int = 4  # draft tokens per step; 0 turns speculation off
    max_gamma: int = 8
    seed: int = 0
    draft_failures: int = 3  # steps in a row on which a draft raised before its workload reverts
    # where proposals come from: the learned draft, the workload's recent text, or per row the one
    # expected to add more tokens
    proposer: str = "draft"  # draft | suffix | hybrid
    suffix: SuffixConfig = field(default_factory=SuffixConfig)

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")


@dataclass
class StepTiming:
    decode_steps: int = 0
    decode_seconds: float = 0.0  # whole decode steps (draft + verify + bookkeeping)
    propose_seconds: float = 0.0  # drafting only

    @property
    def step(self) -> float:
        return self.decode_seconds / self.decode_steps if self.decode_steps else 0.0

    @property
    def propose(self) -> float:
        return self.propose_seconds / self.decode_steps if self.decode_steps else 0.0


class Engine:
    def __init__(
        self,
        target: Target,
        draft: Eagle3Draft | None,
        cfg: EngineConfig,
        tap: TapCallback | None = None,
        controller: Controller | None = None,
    ):
        self.target, self.model, self.cfg, self.tap = target, target.model, cfg, tap
        self.dtype = self.model.dtype
        self.eos = set(self.model.cfg.eos_token_ids)
        self.batch = BatchState(self.model, cfg.max_batch, cfg.max_model_len, cfg.max_gamma)
        self.drafts = DraftSet(
            cfg.max_batch,
            self.batch.capacity,
            self.dtype,
            cfg.max_gamma,
            cfg.draft_failures,
            target.draft_step,
        )
        self.speculator = Speculator(self.batch, self.drafts, self.model.cfg.vocab_size)
        self.suffix = SuffixProposer(cfg.suffix) if cfg.proposer != "draft" else None
        self.controller: Controller | None = None  # told of every draft change; chooses gamma while adaptive
        self.policy: GammaPolicy = FixedGamma(cfg.gamma)
        self._costs_for: tuple[object, ...] | None = None  # what the controller's step times were measured on
        self._stale_since: float | None = None  # when what serves last changed from that
        self.waiting: deque[Sequence] = deque()
        self._lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.stats = DraftStats(cfg.max_gamma)
        self.timing = StepTiming()  # measured while serving: what the cost model needs
        self.tap_seconds = 0.0  # time spent handing hidden states out (benchmarks report it)
        self.workloads_seen: set[str] = set()  # the registry follower polls their drafts
        # ids unique across nodes and restarts: trainers take a request id seen before for a redelivery
        self._ids = (f"{uuid.uuid4().hex[:12]}-{n}" for n in itertools.count())
        if draft is not None:
            self.set_draft(draft)
            self.swap_pending_drafts()
        if controller is not None:  # measured before this engine prepared the draft it was given
            self.use_controller(controller, stale=draft is not None)

    # -- the step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self.swap_pending_drafts()
        self._compact()
        outputs = [self._prefill_alone(seq) for seq in self._admit()]
        self._compact()
        if self.running:
            outputs += self._decode()
        self._compact()
        self._install(self.drafts.judge())  # drafts that kept raising go back to what they replaced
        return outputs

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_batch:
            with self._lock:
                seq = self.waiting.popleft()
            if not seq.finished:
                admitted.append(seq)
        return admitted

    def _prefill_alone(self, seq: Sequence) -> StepOutput:
        try:
            return self._prefill(seq)
        except Exception:
            return self._fail(seq, "in its prefill")

    def _fail(self, seq: Sequence, where: str) -> StepOutput:
        """Its own work raised (call from the except block): this sequence alone ends, with an
        error; its slot frees at the end of the step."""
        log.exception("request %s failed %s; the others carry on", seq.request_id, where)
        seq.finish_reason = "error"
        return StepOutput(seq, [])

    def _compact(self) -> None:
        self.batch.compact(self._released, self._draft_cache)

    def _released(self, seq: Sequence) -> None:
        """A finished request's text goes into its workload's suffix index. Ended from outside
        (aborted, failed): tell the tap now, so it frees the request's states."""
        if self.suffix is not None and seq.finish_reason != "error":
            self.suffix.remember(seq.workload, seq.prompt + seq.output, seq.request_id)
        if seq.finish_reason not in ("stop", "length"):
            b, none = self.batch, self.batch.aux[seq.slot, :0]
            self._emit(seq, int(b.lengths[seq.slot]), b.tokens[seq.slot, :1], none, none, [], False)

    def _draft_cache(self, seq: Sequence) -> DraftKV | None:
        key = self.drafts.key_for(seq.workload)
        return self.drafts[key].cache if key is not None else None

    # -- requests -----------------------------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        workload: str = "default",
        capture: bool = True,
        detokenize: bool = False,
        held_out: bool | None = None,  # None: the default split by request id
    ) -> Sequence:
        params.validate()
        if not prompt:
            raise ValueError("empty prompt")
        tokenizer = self.target.tokenizer
        if (params.stop or detokenize) and tokenizer is None:
            raise ValueError("stop strings and text output need a tokenizer")
        if len(prompt) + params.max_tokens > self.cfg.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.cfg.max_model_len} tokens"
            )
        # checked here, not in a step: a bad value would fail every request batched with it
        vocab = self.model.cfg.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.top_k >= vocab:  # the same distribution, and a value every tensor can hold
            params = replace(params, top_k=0)
        try:
            BatchSampling.of([params])
        except (RuntimeError, OverflowError, TypeError) as e:
            raise ValueError(f"sampling settings unusable: {e}") from None
        rid = request_id or next(self._ids)
        held = is_held_out(rid) if held_out is None else held_out
        seq = Sequence(rid, list(prompt), params, workload, capture, held)
        self.workloads_seen.add(workload)
        if tokenizer is not None and (params.stop or detokenize):
            seq.detok = Detokenizer(tokenizer, seq.prompt)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        with self._lock:
            self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Finish a request now (e.g. its client went away); its slot frees at the next step."""
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def running(self) -> list[Sequence]:
        return self.batch.running

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_work:
            self.step()
        return seqs

    # -- drafts and gamma ---------------------------------------------------------------------------
    def read_draft(self, path: str | Path) -> Eagle3Draft:
        """Load and check a draft (shapes, finiteness, target fingerprint) without using it."""
        return Eagle3Draft.load(
            path, self.model.embed_tokens, self.model.cfg, self.target.fingerprint, self.dtype
        )

    def load_draft(self, path: str | Path, workload: str = "default") -> Eagle3Draft:
        """Load and check a draft in the caller's thread; the engine switches to it between steps."""
        draft = self.read_draft(path)
        self.set_draft(draft, workload)
        return draft

    def set_draft(
        self, draft: Eagle3Draft | None, workload: str = "default", expected: dict[int, float] | None = None
    ) -> None:
        """Queue a workload's draft, from any thread (`DraftSet.set`)."""
        self.drafts.set(draft, workload, expected)

    def swap_pending_drafts(self) -> None:
        """Take over queued drafts: at the start of each step, and from an idle engine's loop."""
        self._install(self.drafts.take_pending())

    def _install(self, swaps: dict[str, DraftSlot | None]) -> None:
        """Swap drafts in; the controller hears which workloads' drafts changed (it starts them from
        what the gate measured), and each running sequence whose draft changed rebuilds its draft
        cache from its stored aux states."""
        if not swaps:
            return
        tracked = list(self.controller.acceptance) if self.controller is not None else []
        key_before = {w: self.drafts.key_for(w) for w in tracked}
        seq_before = {seq.request_id: self.drafts.key_for(seq.workload) for seq in self.running}
        self.drafts.apply(swaps)
        if self.controller is not None:
            for w in tracked:
                key = self.drafts.key_for(w)
                if key in swaps or key != key_before[w]:
                    slot = self.drafts[key] if key is not None else None
                    self.controller.draft_changed([w], slot.expected if slot is not None else None)
        for seq in self.running:
            key = self.drafts.key_for(seq.workload)
            if key is not None and (key in swaps or key != seq_before[seq.request_id]):
                self.batch.draft_lengths[seq.slot] = 0
                self.speculator.catch_up(seq.slot, key)

    @property
    def draft(self) -> Eagle3Draft | None:
        """The default draft."""
        slot = self.drafts.get("default")
        return slot.draft if slot is not None else None

    @property
    def draft_version(self) -> str:
        slot = self.drafts.get("default")
        return slot.version if slot is not None else "none"

    def draft_versions(self) -> dict[str, str]:
        return self.drafts.versions()

    # -- what the registry follower reads (`DraftSink`) ----------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.target.fingerprint

    def workloads(self) -> set[str]:
        return {"default", *self.workloads_seen}

    def acceptance(self, workload: str) -> LiveAcceptance | None:
        slot = self.drafts.get(workload)
        if slot is None:
            return None
        return LiveAcceptance(slot.version, slot.stats.steps, slot.stats.mean_accept_length)

    def _a_draft(self) -> Eagle3Draft | None:
        """The default draft, else any workload's: whose step time the cost model takes."""
        return self.draft or next((s.draft for s in self.drafts.values()), None)

    def step_profile(self) -> StepProfile | None:
        draft = self._a_draft()
        stale = self.controller is not None and self._costs_for != self._served()
        if draft is None or self.target.compiling or stale:
            # without a draft's step time it would overstate every speedup; mid-compile it would time
            # the eager layers about to be replaced, and beside `refresh_costs` each would time the
            # other (the registry follower asks again)
            return None
        # measured once and judged on for the node's lifetime: nine rounds (a few seconds); with five
        # the worst ratio at batch 1 was off by 0.09 at the median and 0.17 one time in ten, with nine
        # 0.07 and 0.12 (against 45 rounds on an idle machine here: scripts/profile_noise.py)
        return measure_profile(self.model, draft, 1, 256, self.cfg.max_gamma + 1)

    def set_gamma(self, gamma: int) -> None:
        """A fixed number of draft tokens per step from the next step on (0: no speculation)."""
        if not 0 <= gamma <= self.cfg.max_gamma:
            raise ValueError(f"gamma must be in [0, {self.cfg.max_gamma}], got {gamma}")
        self.cfg.gamma = gamma
        self.policy = FixedGamma(gamma)

    def use_controller(self, controller: Controller, stale: bool = False) -> None:
        """The controller chooses gamma from now on. Its step times were measured on what serves now;
        `stale`: while the target compiled, so they are measured again once it has."""
        self.controller, self.policy = controller, AdaptiveGamma(controller)
        self._costs_for = None if stale else self._served()

    def _served(self) -> tuple[object, ...]:
        """What step times depend on: the target's layers compiled or eager, its drafts' step, and
        the size of the draft timed (None: no draft): a version of another size costs another time."""
        draft = self._a_draft()
        if draft is None:
            return self.target.compiled, bool(self.target.draft_step.runners), None
        c = draft.cfg
        size = (
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.draft_vocab_size,
        )
        return self.target.compiled, bool(self.target.draft_step.runners), (draft.dtype, *size)

    def refresh_costs(self, idle: bool = True) -> None:
        """The controller's step times measured again where what serves changed since they were: a
        node compiles its layers in the background while it serves eagerly, and may start without a
        draft. The engine's loop calls it between steps, on its thread, so no step contends with
        the timing: when idle, or once `BUSY_REFRESH_S` have passed without an idle moment (the
        requests in flight then wait the few seconds it takes, once)."""
        if self.controller is None or self.target.compiling:
            return
        c, served, draft = self.controller, self._served(), self._a_draft()
        if served == self._costs_for or draft is None:  # without a draft: keep what it had
            self._stale_since = None
            return
        now = time.monotonic()
        self._stale_since = self._stale_since or now
        if not idle and now - self._stale_since < BUSY_REFRESH_S:
            return
        self._costs_for, self._stale_since = served, None
        try:
            c.measure_costs(self.model, draft)
        except Exception:  # serving goes on, on the step times it had
            log.exception("measuring step times again failed; the controller keeps the ones it had")
            return
        log.info("step times measured again (compiled, compiled draft step, draft size: %s)", served)

    def set_adaptive(self) -> None:
        """Let the controller choose gamma at every step again."""
        if self.controller is None:
            raise ValueError("this node has no controller: start it with --gamma auto")
        self.policy = AdaptiveGamma(self.controller)

    @property
    def adaptive(self) -> bool:
        return isinstance(self.policy, AdaptiveGamma)

    @property
    def gamma(self) -> int:
        """Draft tokens per step: the controller's last choice, or the fixed setting."""
        return self.policy.gamma

    # -- prefill and decode ---------------------------------------------------------------------------
    def _uniforms(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        return torch.stack([torch.rand(n, generator=s.generator or self.generator) for s in seqs])

    def _prefill(self, seq: Sequence) -> StepOutput:
        slot = self.batch.admit(seq)
        prompt = torch.tensor(seq.prompt)
        pos = torch.arange(len(prompt)).unsqueeze(0)
        out = self.model(
            prompt.unsqueeze(0), Batch.make(slot, pos, None, self.batch.capacity), self.batch.cache, True
        )
        assert out.aux is not None
        s = BatchSampling.of([seq.params])
        logits = self.model.logits(out.hidden[:, -1:])
        if s.all_greedy:
            first = int(logits[0, 0].argmax())
        else:
            first = int(sample(probs_from_logits(logits, s), self._uniforms([seq], 1))[0, 0])
        self.batch.commit_prompt(slot, prompt, out.aux[0], first)
        key = self.drafts.key_for(seq.workload)
        if key is not None:
            self.speculator.catch_up(slot, key)
        kept = seq.append([first], self.eos)
        self._emit(seq, 0, prompt, out.aux[0], out.hidden[0], kept, True)
        return StepOutput(seq, kept)

    def _decode(self) -> list[StepOutput]:
        start = time.perf_counter()
        seqs = list(self.running)
        speculating = self.adaptive or self.policy.gamma > 0
        drafting = speculating and self.cfg.proposer != "suffix"
        groups = self.drafts.groups(q.workload for q in seqs) if drafting else None
        gamma = self.policy.choose([q.workload for q in seqs]) if groups else 0
        picks: list[SuffixProposal | None] = [None] * len(seqs)
        if speculating:
            picks = self._suffix_picks(seqs, groups if gamma else None, gamma)
        width = max([gamma] + [len(p.tokens) for p in picks if p is not None])
        s = BatchSampling.of([q.params for q in seqs])
        # drawn once: a sequence decoded again alone (below) samples with the same numbers
        u = None if s.all_greedy else self._uniforms(seqs, 2 * width + 1)
        dlen = self.batch.draft_lengths.clone()
        try:
            return self._decode_rows(0, len(seqs), groups if gamma else None, gamma, picks, s, u, start)
        except Exception:
            if len(seqs) == 1:
                return [self._fail(seqs[0], "in its decode step")]
            log.exception("a decode step of %d sequences failed; decoding each alone", len(seqs))
        # nothing was committed: every sequence's step is still to do, the draft caches' too
        self.batch.draft_lengths.copy_(dlen)
        results: list[StepOutput] = []
        for i, seq in enumerate(seqs):
            one = self.drafts.groups([seq.workload]) if gamma else None
            try:
                ui = None if u is None else u[i : i + 1]
                results += self._decode_rows(
                    i,
                    i + 1,
                    one,
                    gamma if one else 0,
                    picks[i : i + 1],
                    BatchSampling.of([seq.params]),
                    ui,
                    start,
                )
            except Exception:
                self.batch.draft_lengths[i] = dlen[i]
                results.append(self._fail(seq, "in its decode step"))
        return results

    def _decode_rows(
        self,
        lo: int,
        hi: int,
        groups: dict[str, list[int]] | None,
        gamma: int,
        picks: list[SuffixProposal | None],
        s: BatchSampling,
        u: torch.Tensor | None,
        start: float,
    ) -> list[StepOutput]:
        """One target step for the running sequences in slots [lo, hi); `groups` index rows from lo,
        `picks` are the rows' suffix proposals (None: the row drafts with its draft, if any)."""
        b, seqs, rows = self.batch, self.running[lo:hi], torch.arange(lo, hi)
        lengths = b.lengths[lo:hi].clone()
        drafted, q = torch.zeros(hi - lo, 0, dtype=torch.long), None
        if all(p is not None for p in picks):
            groups = None  # no row drafts: the draft catches up on its next chain
        if groups and gamma > 0:
            dlen = b.draft_lengths[lo:hi].clone()
            proposal = self.speculator.propose(
                groups, lo, hi - lo, gamma, [q.params for q in seqs], u, self.policy.stop_below
            )
            if proposal is None:  # the draft failed: its half-done catch-up is redone next step
                b.draft_lengths[lo:hi] = dlen
            else:
                drafted, q = proposal
                self.timing.propose_seconds += time.perf_counter() - start
        draft_gamma = drafted.shape[1]  # the chain may have stopped early, or not started
        suffix = any(p is not None for p in picks)
        if suffix:
            drafted, q = with_suffix((drafted, q), picks, self.model.cfg.vocab_size, u is not None)
        gamma = drafted.shape[1]
        inp = torch.cat([b.tokens[rows, lengths].unsqueeze(1), drafted], 1)
        pos = lengths.unsqueeze(1) + torch.arange(gamma + 1)
        out = self.model(inp, Batch.make(lo, pos, None, b.capacity), b.cache, True)
        assert out.aux is not None
        verdict = accept(self.model.logits(out.hidden), drafted, q, s, u, gamma)
        acc = verdict.accepted
        # commit: aux states of the verified positions and the tokens that follow them
        b.aux[rows.unsqueeze(1), pos] = out.aux
        b.tokens[rows.unsqueeze(1), pos + 1] = verdict.tokens
        b.lengths[lo:hi] = lengths + acc + 1
        seconds = time.perf_counter() - start
        self.timing.decode_steps += 1
        self.timing.decode_seconds += seconds
        try:  # committed: from here on nothing may raise out of the step (it would be decoded again)
            if suffix:
                self._observe_suffix(seqs, picks, acc, groups, draft_gamma)
            else:
                if groups and gamma > 0:
                    self.stats.add(acc, gamma)
                    for key, idx in groups.items():
                        self.drafts[key].stats.add(acc if len(groups) == 1 else acc[torch.tensor(idx)], gamma)
                self.policy.observe([q.workload for q in seqs], acc, gamma, seconds)
        except Exception:
            log.exception("acceptance statistics of a step failed")
        new_tokens, accepted, starts = verdict.tokens.tolist(), acc.tolist(), lengths.tolist()
        results = []
        for i, (seq, n) in enumerate(zip(seqs, accepted, strict=True)):
            seq.steps += 1
            try:
                kept = seq.append(new_tokens[i][: n + 1], self.eos)
            except Exception:
                results.append(self._fail(seq, "appending its tokens"))
                continue
            self._emit(seq, starts[i], inp[i, :1], out.aux[i], out.hidden[i], kept, False)
            results.append(StepOutput(seq, kept, n))
        return results

    # -- the suffix index ---------------------------------------------------------------------------
    def _suffix_picks(
        self, seqs: list[Sequence], groups: dict[str, list[int]] | None, gamma: int
    ) -> list[SuffixProposal | None]:
        """Per row, the index's proposal where it predicts a higher speedup than the row's draft at
        this step's gamma (than 1.0 where the row does not draft), else None."""
        if self.suffix is None:
            return [None] * len(seqs)
        b, c = len(seqs), self.controller
        rival = [1.0] * b
        drafts: dict[str, float] = {}  # per workload: the controller's estimate, this machine's step times
        for key, idx in (groups or {}).items():
            st = self.drafts[key].stats
            for i in idx:
                w = seqs[i].workload
                if c is not None:
                    if w not in drafts:
                        drafts[w] = (
                            c.tracker(w).tau(gamma) * c.costs.step_time(b, 0) / c.costs.step_time(b, gamma)
                        )
                    rival[i] = drafts[w]
                else:  # untried: one token a step more, say; drafting's own time unknown
                    tau = st.mean_accept_length if st.steps else 2.0
                    rival[i] = tau / (1.0 + gamma * self.suffix.cfg.step_cost)
        cost = c.costs.verify_costs(b) if c is not None else None
        picks: list[SuffixProposal | None] = []
        try:
            self.suffix.take_fed()
            for i, seq in enumerate(seqs):
                context = self.batch.tokens[i, : int(self.batch.lengths[i]) + 1]
                p = self.suffix.propose(seq.workload, context, self.cfg.max_gamma, cost)
                picks.append(p if p is not None and p.speedup > rival[i] else None)
        except Exception:  # like a draft that raises: this step goes without the index
            log.exception("the suffix index failed to propose")
            return [None] * len(seqs)
        return picks

    def _observe_suffix(
        self,
        seqs: list[Sequence],
        picks: list[SuffixProposal | None],
        acc: torch.Tensor,
        groups: dict[str, list[int]] | None,
        draft_gamma: int,
    ) -> None:
        """A step some rows drafted from the index: each source learns from its own rows. The
        controller does not: the step's time and tokens are not the draft's evidence."""
        assert self.suffix is not None
        accepted = acc.tolist()
        for seq, p, n in zip(seqs, picks, accepted, strict=True):
            if p is not None:
                self.suffix.observe(seq.workload, p, n)
        if groups and draft_gamma > 0:
            for key, idx in groups.items():
                mine = [i for i in idx if picks[i] is None]
                if mine:
                    own = acc[torch.tensor(mine)].clamp(max=draft_gamma)
                    self.stats.add(own, draft_gamma)
                    self.drafts[key].stats.add(own, draft_gamma)

    # -- the tap ------------------------------------------------------------------------------------
    def _emit(
        self,
        seq: Sequence,
        first: int,
        inputs: torch.Tensor,
        aux: torch.Tensor,
        hidden: torch.Tensor,
        kept: list[int],
        prefill: bool,
    ) -> None:
        """Tap the positions from `first` whose next token was kept: inputs[1:] are known to follow."""
        if self.tap is None or not seq.capture:
            return
        m = len(inputs) - 1 + len(kept)
        if m == 0 and not seq.finished:  # a request that ends on EOS still tells the tap it ended
            return
        t = time.perf_counter()
        tokens = torch.cat([inputs, torch.tensor(kept, dtype=inputs.dtype)])
        event = TapEvent(
            seq.request_id,
            seq.workload,
            first,
            tokens,
            aux[:m],
            hidden[:m],
            prefill,
            self.drafts.version_for(seq.workload),
            seq.finished,
            seq.held_out,
        )
        try:
            self.tap(event)
        except Exception:  # capture is a side job: the request is served on, no longer captured
            log.exception("capture of request %s failed; it goes on uncaptured", seq.request_id)
            seq.capture = False
        self.tap_seconds += time.perf_counter() - t
