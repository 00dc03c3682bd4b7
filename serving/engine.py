"""The serving engine: continuous batching with EAGLE-3 chain speculation over one static KV cache.

One `step()` admits waiting requests (prefill, one at a time), then advances every running sequence
by one target forward pass: the draft proposes gamma tokens per sequence, the target verifies all
of them for the whole batch at once, and each sequence keeps its accepted prefix plus one
correction/bonus token. Each workload may have its own draft (the `default` one serves the rest);
a batch mixing workloads drafts once per draft and verifies once. Rejected tokens are rolled back by moving the sequence's length back: cache
entries past the length are never attended to and are overwritten next step.

Running sequences occupy the slots [0, B) of the cache in order, so every forward reads one
contiguous slice; a finishing sequence's slot is refilled by moving the last one into it.

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tide.models.eagle3 import DraftKV, Eagle3Draft
from tide.models.llama import Batch
from tide.models.loader import Target
from tide.models.packing import pack_linears
from tide.producers.records import is_held_out
from tide.producers.tap import TapCallback, TapEvent
from tide.serving.controller import Controller
from tide.serving.detokenizer import Detokenizer
from tide.serving.sampling import BatchSampling, SamplingParams, Verdict, probs_from_logits, sample, verify

log = logging.getLogger("tide.serving")


@dataclass
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 2048  # prompt + completion
    gamma: int = 4  # draft tokens per step; 0 turns speculation off
    max_gamma: int = 8
    seed: int = 0
    draft_failures: int = 3  # steps in a row on which a draft raised before its workload reverts


# (workload, version of the reverted draft, reason), on the engine's thread
RevertCallback = Callable[[str, str, str], None]


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    workload: str = "default"
    capture: bool = True
    held_out: bool = False  # its captured states only ever evaluate drafts
    output: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    steps: int = 0  # target forward passes spent on this sequence after prefill
    detok: Detokenizer | None = None  # text is tracked for stop strings and for callers that ask
    text: str = ""  # released text of the output, cut before a stop string

    @property
    def holdback(self) -> int:
        """Trailing characters a stop string might still claim: not safe to stream yet."""
        return max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def streamable_text(self) -> str:
        if self.finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    accepted: int | None = None  # draft tokens the verify pass accepted (None: prefill)


class DraftStats:
    """Acceptance counts by draft depth: alpha_i = accepted_i / attempted_i."""

    def __init__(self, max_gamma: int):
        self.attempted = torch.zeros(max_gamma, dtype=torch.long)
        self.accepted = torch.zeros(max_gamma, dtype=torch.long)
        self.steps = 0
        self.emitted = 0
        self.drafted = 0  # draft tokens proposed (gamma per sequence-step)

    def add(self, accepted: torch.Tensor, gamma: int) -> None:
        depth = torch.arange(gamma)
        self.attempted[:gamma] += (accepted.unsqueeze(1) >= depth).sum(0)
        self.accepted[:gamma] += (accepted.unsqueeze(1) > depth).sum(0)
        self.steps += int(accepted.numel())
        self.emitted += int(accepted.sum()) + int(accepted.numel())
        self.drafted += gamma * int(accepted.numel())

    def rates(self) -> list[float]:
        return [
            a / t if t else 0.0 for a, t in zip(self.accepted.tolist(), self.attempted.tolist(), strict=True)
        ]

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per sequence per target step (1 + accepted drafts)."""
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class DraftSlot:
    """A loaded draft with its own KV cache and acceptance counts (since it was swapped in)."""

    draft: Eagle3Draft
    cache: DraftKV
    ids: torch.Tensor  # draft vocabulary -> target token ids
    stats: DraftStats
    expected: dict[int, float] | None = None  # tau at each gamma the gate measured (the controller's prior)
    failures: int = 0  # steps in a row on which it raised

    @property
    def version(self) -> str:
        return self.draft.cfg.version


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
        self.target = target
        self.model = target.model
        self.cfg = cfg
        self.tap = tap
        self.dtype = self.model.dtype
        mc = self.model.cfg
        # room past the longest sequence for gamma+1 verified tokens and one scratch position
        self.capacity = cfg.max_model_len + cfg.max_gamma + 2
        self.scratch = self.capacity - 1
        b = cfg.max_batch
        self.cache = self.model.new_cache(b, self.capacity)
        self.tokens = torch.zeros(b, self.capacity + 1, dtype=torch.long)
        self.aux = torch.zeros(b, self.capacity, 3 * mc.hidden_size, dtype=self.dtype)
        self.lengths = torch.zeros(b, dtype=torch.long)  # tokens in the target's cache
        self.draft_lengths = torch.zeros(b, dtype=torch.long)  # positions in the draft's cache
        self.eos = set(mc.eos_token_ids)
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.stats = DraftStats(cfg.max_gamma)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[str, DraftSlot | None] = {}  # drafts to take over at the next step
        self.tap_seconds = 0.0  # time spent handing hidden states out (benchmarks report it)
        self.timing = StepTiming()  # measured while serving: what the cost model needs
        self.drafts: dict[str, DraftSlot] = {}  # by workload; "default" serves workloads without one
        self.workloads_seen: set[str] = set()  # the registry follower polls their drafts
        self.controller = controller  # chooses gamma each step while `adaptive`
        self.adaptive = controller is not None  # False: cfg.gamma, fixed
        # failing drafts: what each workload's draft replaced (None: nothing of its own), the
        # workloads reverted since (and why), counts for metrics, and who else wants to know
        self.previous: dict[str, tuple[Eagle3Draft, dict[int, float] | None] | None] = {}
        self.degraded: dict[str, str] = {}
        self.draft_step_failures = 0
        self.draft_reverts = 0
        self.on_draft_revert: RevertCallback | None = None
        self._draft_errors: dict[str, str] = {}  # this step's failing drafts, by key
        self._drafts_ok: set[str] = set()  # this step's drafts that proposed
        if draft is not None:
            self.set_draft(draft)
            self.swap_pending_drafts()

    # -- requests ---------------------------------------------------------------------------------
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
        rid = request_id or f"req-{next(self._ids)}"
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

    # -- drafts -----------------------------------------------------------------------------------
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
        """Queue a workload's draft (None: the workload falls back to the default draft, or, for
        the default, stops speculating). The engine takes it over (its linears get prepacked).
        `expected`: tau by gamma as the gate measured it on recent traffic, if known."""
        slot = None
        if draft is not None:
            # the slow parts happen here, off the engine's thread: weight packing, cache allocation
            pack_linears(draft)
            slot = self._new_slot(draft, expected)
        with self._lock:
            self._pending[workload] = slot

    def _new_slot(self, draft: Eagle3Draft, expected: dict[int, float] | None) -> DraftSlot:
        cache = draft.new_cache(self.cfg.max_batch, self.capacity, self.dtype)
        return DraftSlot(draft, cache, draft.target_ids(), DraftStats(self.cfg.max_gamma), expected)

    @property
    def draft(self) -> Eagle3Draft | None:
        """The default draft."""
        slot = self.drafts.get("default")
        return slot.draft if slot is not None else None

    def draft_versions(self) -> dict[str, str]:
        return {w: slot.version for w, slot in self.drafts.items()}

    def draft_key(self, workload: str) -> str | None:
        """Which draft serves a workload: its own, else the default one (None: no draft)."""
        if workload in self.drafts:
            return workload
        return "default" if "default" in self.drafts else None

    def set_gamma(self, gamma: int) -> None:
        """A fixed number of draft tokens per step from the next step on (0: no speculation)."""
        if not 0 <= gamma <= self.cfg.max_gamma:
            raise ValueError(f"gamma must be in [0, {self.cfg.max_gamma}], got {gamma}")
        self.cfg.gamma = gamma
        self.adaptive = False

    def set_adaptive(self) -> None:
        """Let the controller choose gamma at every step again."""
        if self.controller is None:
            raise ValueError("this node has no controller: start it with --gamma auto")
        self.adaptive = True

    @property
    def gamma(self) -> int:
        """Draft tokens per step: the controller's last choice, or the fixed setting."""
        return self.controller.last.gamma if self.adaptive and self.controller is not None else self.cfg.gamma

    @property
    def draft_version(self) -> str:
        slot = self.drafts.get("default")
        return slot.version if slot is not None else "none"

    def swap_pending_drafts(self) -> None:
        """Take over queued drafts: at the start of each step, and from an idle engine's loop."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        for workload in pending:  # a new draft gets its chance; the one it replaces is kept to revert to
            old = self.drafts.get(workload)
            self.previous[workload] = (
                (old.draft, old.expected) if old is not None and not old.failures else None
            )
            self.degraded.pop(workload, None)
        self._install(pending)

    def _install(self, pending: dict[str, DraftSlot | None]) -> None:
        before = {seq.request_id: self.draft_key(seq.workload) for seq in self.running}
        tracked = list(self.controller.acceptance) if self.controller is not None else []
        keys = {w: self.draft_key(w) for w in tracked}
        versions = {w: self.drafts[k].version if k is not None else None for w, k in keys.items()}
        for workload, slot in pending.items():
            if slot is None:
                self.drafts.pop(workload, None)
            else:
                self.drafts[workload] = slot
        if self.controller is not None:  # workloads on a new draft: start from what the gate measured
            for w in tracked:
                key = self.draft_key(w)
                if key in pending or key != keys[w]:
                    slot = self.drafts[key] if key is not None else None
                    self.controller.draft_changed(
                        [w],
                        slot.expected if slot is not None else None,
                        slot.version if slot is not None else None,
                        versions[w],
                    )
        # a sequence whose draft changed starts an empty cache: rebuild it from its stored aux states
        for seq in self.running:
            key = self.draft_key(seq.workload)
            if key is not None and (key in pending or key != before[seq.request_id]):
                self.draft_lengths[seq.slot] = 0
                self._sync_draft(seq, key)

    def _sync_draft(self, seq: Sequence, key: str) -> None:
        """Bring one sequence's draft cache up to its last committed position but one (a draft that
        raises leaves it where it was: the next proposal catches up from there)."""
        ds, slot = self.drafts[key], seq.slot
        start, end = int(self.draft_lengths[slot]), int(self.lengths[slot]) - 1
        if end <= start:
            return
        pos = torch.arange(start, end).unsqueeze(0)
        batch = Batch.make(slot, pos, None, self.capacity)
        try:
            hidden = ds.draft.fc(self.aux[slot, start:end].unsqueeze(0))
            ds.draft(hidden, self.tokens[slot, start + 1 : end + 1].unsqueeze(0), batch, ds.cache)
        except Exception as e:
            self._draft_failed(key, e)
            return
        self.draft_lengths[slot] = end

    # -- failing drafts ---------------------------------------------------------------------------
    def _draft_failed(self, key: str, e: Exception) -> None:
        if key not in self._draft_errors:
            log.warning("the draft of workload %s raised; this step goes without it: %r", key, e)
        self._draft_errors[key] = f"{type(e).__name__}: {e}"[:300]

    def _judge_drafts(self) -> None:
        """After a step: a draft that raised in it counts one more failure, one that proposed starts
        over; at `draft_failures` its workload reverts (once the step is over: no step sees half)."""
        errors, ok = self._draft_errors, self._drafts_ok
        self._draft_errors, self._drafts_ok = {}, set()
        self.draft_step_failures += len(errors)
        reverts: dict[str, DraftSlot | None] = {}
        for key, slot in self.drafts.items():
            if key in errors:
                slot.failures += 1
            elif key in ok:
                slot.failures = 0
            if slot.failures < self.cfg.draft_failures:
                continue
            prev = self.previous.pop(key, None)
            back = self._new_slot(*prev) if prev is not None else None
            to = back.version if back is not None else "no draft of its own"
            reason = f"draft {slot.version} raised on {slot.failures} steps in a row ({errors.get(key)}); reverted to {to}"
            log.error("workload %s: %s", key, reason)
            self.degraded[key] = reason
            self.draft_reverts += 1
            reverts[key] = back
            if self.on_draft_revert is not None:
                try:
                    self.on_draft_revert(key, slot.version, reason)
                except Exception:
                    log.exception("the draft-revert callback failed")
        if reverts:
            self._install(reverts)

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self.swap_pending_drafts()
        outputs: list[StepOutput] = []
        self._drop_finished()
        while self.waiting and len(self.running) < self.cfg.max_batch:
            with self._lock:
                seq = self.waiting.popleft()
            if seq.finished:
                continue
            try:
                outputs.append(self._prefill(seq))
            except Exception:
                outputs.append(self._fail(seq, "in its prefill"))
        self._drop_finished()
        if self.running:
            outputs.extend(self._decode())
        self._drop_finished()
        self._judge_drafts()
        return outputs

    def _fail(self, seq: Sequence, where: str) -> StepOutput:
        """Its own work raised (call from the except block): this sequence alone ends, with an
        error; its slot frees at the end of the step."""
        log.exception("request %s failed %s; the others carry on", seq.request_id, where)
        seq.finish_reason = "error"
        return StepOutput(seq, [])

    def _uniforms(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        return torch.stack([torch.rand(n, generator=s.generator or self.generator) for s in seqs])

    def _prefill(self, seq: Sequence) -> StepOutput:
        slot = len(self.running)
        seq.slot = slot
        self.running.append(seq)
        n = len(seq.prompt)
        prompt = torch.tensor(seq.prompt)
        pos = torch.arange(n).unsqueeze(0)
        out = self.model(prompt.unsqueeze(0), Batch.make(slot, pos, None, self.capacity), self.cache, True)
        assert out.aux is not None
        self.tokens[slot, :n] = prompt
        self.aux[slot, :n] = out.aux[0]
        self.lengths[slot] = n
        self.draft_lengths[slot] = 0
        s = BatchSampling.of([seq.params])
        logits = self.model.logits(out.hidden[:, -1:])
        if s.all_greedy:
            first = int(logits[0, 0].argmax())
        else:
            first = int(sample(probs_from_logits(logits, s), self._uniforms([seq], 1))[0, 0])
        self.tokens[slot, n] = first
        key = self.draft_key(seq.workload)
        if key is not None:
            self._sync_draft(seq, key)
        kept = self._append(seq, [first])
        self._emit(seq, 0, prompt, out.aux[0], out.hidden[0], kept, True)
        return StepOutput(seq, kept)

    def _draft_groups(self, seqs: list[Sequence]) -> dict[str, list[int]] | None:
        """Rows of the batch by the draft that serves them (None: some row has no draft at all)."""
        groups: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            key = self.draft_key(seq.workload)
            if key is None:
                return None
            groups.setdefault(key, []).append(i)
        return groups

    def _propose(
        self,
        groups: dict[str, list[int]],
        lo: int,
        bsz: int,
        gamma: int,
        params: list[SamplingParams],
        u: torch.Tensor | None,
        stop_below: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Chain-draft up to gamma tokens per sequence of the slots [lo, lo + bsz), one chain per
        draft: (B, n) target ids, and q (B, n, V) when sampling. With one draft, the chain stops
        early where the draft's own confidence in it falls below `stop_below` in every row.
        None: a draft raised, and the step goes without speculation."""
        key = ""
        try:
            if len(groups) == 1:  # the common case: contiguous slots, no gathers
                (key,) = groups
                slots = None if lo == 0 else torch.arange(lo, lo + bsz)
                out = self._propose_rows(self.drafts[key], slots, bsz, gamma, params, u, stop_below)
                self._drafts_ok.add(key)
                return out
            tokens = torch.empty(bsz, gamma, dtype=torch.long)
            q = None if u is None else torch.zeros(bsz, gamma, self.model.cfg.vocab_size)
            for key, idx in groups.items():
                rows = torch.tensor(idx)
                sub_u = None if u is None else u[rows]
                t, sub_q = self._propose_rows(
                    self.drafts[key], rows + lo, len(idx), gamma, [params[i] for i in idx], sub_u
                )
                tokens[rows] = t
                if q is not None and sub_q is not None:
                    q[rows] = sub_q
                self._drafts_ok.add(key)
            return tokens, q
        except Exception as e:
            self._draft_failed(key, e)
            return None

    def _propose_rows(
        self,
        ds: DraftSlot,
        slots: torch.Tensor | None,
        bsz: int,
        gamma: int,
        params: list[SamplingParams],
        u: torch.Tensor | None,
        stop_below: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft's chain over the running rows `slots` (None: rows [0, bsz)). Past its first
        token the chain ends where, in every row, the draft's own probability of the chain so far
        falls below `stop_below` (EAGLE-2's confidence): such a tail is rarely accepted, and each
        token of it widens the verify."""
        draft = ds.draft
        rows = torch.arange(bsz) if slots is None else slots
        lengths, dlen = self.lengths[rows], self.draft_lengths[rows]
        # catch up: step-0 inputs for the positions the target committed since the last step
        span = int((lengths - dlen).max())
        pos = dlen.unsqueeze(1) + torch.arange(span)
        valid = pos < lengths.unsqueeze(1)
        # padding rows sit at the sequence's last position (keeps the attended span short) and write to scratch
        pos = torch.where(valid, pos, (lengths - 1).unsqueeze(1))
        hidden = draft.fc(self.aux[rows.unsqueeze(1), pos])
        out = draft(
            hidden,
            self.tokens[rows.unsqueeze(1), pos + 1],
            Batch.make(0, pos, valid, self.capacity, slots),
            ds.cache,
        )
        local = torch.arange(bsz)
        last = out[local, lengths - 1 - dlen].unsqueeze(1)
        self.draft_lengths[rows] = lengths
        tokens = torch.empty(bsz, gamma, dtype=torch.long)
        qs: list[torch.Tensor] = []
        s = BatchSampling.of(params) if u is not None else None
        sure = torch.ones(bsz)  # the draft's probability of its chain so far, per row
        for i in range(gamma):
            logits = draft.logits(last[:, 0]).unsqueeze(1)  # (B, 1, Vd)
            if u is None or s is None:
                d = logits[:, 0].argmax(-1)
                if stop_below:
                    sure = sure * logits[:, 0].float().softmax(-1).amax(-1)
                    if i and bool((sure < stop_below).all()):
                        return self._checked(tokens[:, :i]), None
            else:
                q = probs_from_logits(logits, BatchSampling(s.temperature, s.top_p, s.top_k, False))[:, 0]
                d = sample(q, u[:, i])
                if stop_below:
                    sure = sure * q.gather(1, d.unsqueeze(1))[:, 0]
                    if i and bool((sure < stop_below).all()):
                        return self._checked(tokens[:, :i]), torch.stack(qs, 1)
                full = torch.zeros(bsz, self.model.cfg.vocab_size)
                qs.append(full.index_copy_(1, ds.ids, q))
            tokens[:, i] = ds.ids[d]
            if i + 1 < gamma:
                p = (lengths + i).unsqueeze(1)
                batch = Batch.make(0, p, None, self.capacity, slots)
                last = draft(last, tokens[:, i : i + 1], batch, ds.cache)
        return self._checked(tokens), (torch.stack(qs, 1) if qs else None)

    def _checked(self, tokens: torch.Tensor) -> torch.Tensor:
        """A draft's tokens must be the target's (a bad vocabulary map would fail the verify pass)."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.model.cfg.vocab_size):
            raise ValueError("the draft proposed token ids outside the target's vocabulary")
        return tokens

    def _decode(self) -> list[StepOutput]:
        start = time.perf_counter()
        seqs = list(self.running)
        adaptive = self.adaptive and self.controller is not None
        groups = self._draft_groups(seqs) if (self.cfg.gamma > 0 or adaptive) else None
        if groups and adaptive and self.controller is not None:
            gamma = self.controller.choose([q.workload for q in seqs]).gamma
        else:
            gamma = self.cfg.gamma if groups else 0
        s = BatchSampling.of([q.params for q in seqs])
        # drawn once: a sequence decoded again alone (below) samples with the same numbers
        u = None if s.all_greedy else self._uniforms(seqs, 2 * gamma + 1)
        dlen = self.draft_lengths.clone()
        try:
            return self._decode_rows(0, len(seqs), groups, gamma, s, u, start)
        except Exception:
            if len(seqs) == 1:
                return [self._fail(seqs[0], "in its decode step")]
            log.exception("a decode step of %d sequences failed; decoding each alone", len(seqs))
        # nothing was committed: every sequence's step is still to do, the draft caches' too
        self.draft_lengths.copy_(dlen)
        results: list[StepOutput] = []
        for i, seq in enumerate(seqs):
            one = self._draft_groups([seq]) if groups else None
            try:
                ui = None if u is None else u[i : i + 1]
                g = gamma if one else 0
                results += self._decode_rows(i, i + 1, one, g, BatchSampling.of([seq.params]), ui, start)
            except Exception:
                self.draft_lengths[i] = dlen[i]
                results.append(self._fail(seq, "in its decode step"))
        return results

    def _decode_rows(
        self,
        lo: int,
        hi: int,
        groups: dict[str, list[int]] | None,
        gamma: int,
        s: BatchSampling,
        u: torch.Tensor | None,
        start: float,
    ) -> list[StepOutput]:
        """One target step for the running sequences in slots [lo, hi); `groups` index rows from lo."""
        seqs = self.running[lo:hi]
        bsz = hi - lo
        rows = torch.arange(lo, hi)
        adaptive = self.adaptive and self.controller is not None
        params = [q.params for q in seqs]
        lengths = self.lengths[lo:hi].clone()
        drafted, q = torch.zeros(bsz, 0, dtype=torch.long), None
        if groups and gamma > 0:
            stop = self.controller.cfg.stop_below if adaptive and self.controller is not None else 0.0
            dlen = self.draft_lengths[lo:hi].clone()
            proposal = self._propose(groups, lo, bsz, gamma, params, u, stop)
            if proposal is None:  # the draft failed: its half-done catch-up is redone next step
                self.draft_lengths[lo:hi] = dlen
            else:
                drafted, q = proposal
                self.timing.propose_seconds += time.perf_counter() - start
        gamma = drafted.shape[1]  # the chain may have stopped early, or not started
        inp = torch.cat([self.tokens[rows, lengths].unsqueeze(1), drafted], 1)
        pos = lengths.unsqueeze(1) + torch.arange(gamma + 1)
        out = self.model(inp, Batch.make(lo, pos, None, self.capacity), self.cache, True)
        assert out.aux is not None
        logits = self.model.logits(out.hidden)
        verdict = self._verify(logits, drafted, q, s, u, gamma)
        acc = verdict.accepted
        new_tokens, accepted, starts = verdict.tokens.tolist(), acc.tolist(), lengths.tolist()
        # commit: aux states of the verified positions and the tokens that follow them
        self.aux[rows.unsqueeze(1), pos] = out.aux
        self.tokens[rows.unsqueeze(1), pos + 1] = verdict.tokens
        self.lengths[lo:hi] = lengths + acc + 1
        seconds = time.perf_counter() - start
        self.timing.decode_steps += 1
        self.timing.decode_seconds += seconds
        try:  # committed: from here on nothing may raise out of the step (it would be decoded again)
            if groups and gamma > 0:
                self.stats.add(acc, gamma)
                for key, idx in groups.items():
                    self.drafts[key].stats.add(acc if len(groups) == 1 else acc[torch.tensor(idx)], gamma)
            if adaptive and self.controller is not None:
                self.controller.observe([q.workload for q in seqs], acc, gamma, seconds)
        except Exception:
            log.exception("acceptance statistics of a step failed")
        results = []
        for i, (seq, n) in enumerate(zip(seqs, accepted, strict=True)):
            seq.steps += 1
            try:
                kept = self._append(seq, new_tokens[i][: n + 1])
            except Exception:
                results.append(self._fail(seq, "appending its tokens"))
                continue
            self._emit(seq, starts[i], inp[i, :1], out.aux[i], out.hidden[i], kept, False)
            results.append(StepOutput(seq, kept, n))
        return results

    def _verify(
        self,
        logits: torch.Tensor,
        drafted: torch.Tensor,
        q: torch.Tensor | None,
        s: BatchSampling,
        u: torch.Tensor | None,
        gamma: int,
    ) -> Verdict:
        if u is None:  # all greedy: accept while the draft equals the target's argmax
            best = logits.argmax(-1)
            accepted = (drafted == best[:, :gamma]).long().cumprod(-1).sum(-1)
            tokens = torch.cat([drafted, best[:, -1:]], 1)
            tokens[torch.arange(len(tokens)), accepted] = best.gather(1, accepted.unsqueeze(1)).squeeze(1)
            return Verdict(accepted, tokens)
        p = probs_from_logits(logits, s)
        if q is None:
            q = torch.zeros_like(p[:, :gamma])
        return verify(p, q, drafted, u[:, gamma : 2 * gamma], u[:, 2 * gamma])

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
            self._version_for(seq),
            seq.finished,
            seq.held_out,
        )
        try:
            self.tap(event)
        except Exception:  # capture is a side job: the request is served on, no longer captured
            log.exception("capture of request %s failed; it goes on uncaptured", seq.request_id)
            seq.capture = False
        self.tap_seconds += time.perf_counter() - t

    def _version_for(self, seq: Sequence) -> str:
        key = self.draft_key(seq.workload)
        return self.drafts[key].version if key is not None else "none"

    # -- finishing --------------------------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append a burst of tokens, cutting it exactly where a stop condition fires."""
        p = seq.params
        kept: list[int] = []
        for t in tokens:
            if t in self.eos and not p.ignore_eos:
                seq.finish_reason = "stop"
                break
            kept.append(t)
            seq.output.append(t)
            if seq.detok is not None:
                delta = seq.detok.push(t)
                seq.text = seq.detok.text
                if p.stop and delta and self._hit_stop(seq, len(delta)):
                    seq.finish_reason = "stop"
                    return kept
            if len(seq.output) >= p.max_tokens:
                seq.finish_reason = "length"
                break
        if seq.finished and seq.detok is not None:
            seq.detok.flush()
            seq.text = seq.detok.text
        return kept

    def _hit_stop(self, seq: Sequence, new_chars: int) -> bool:
        """Cut seq.text before the first stop string that ends in the newly released text."""
        text = seq.text
        start = max(0, len(text) - new_chars - seq.holdback)
        hits = [i for i in (text.find(stop, start) for stop in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = text[: min(hits)]
        return True

    def _drop_finished(self) -> None:
        done = sorted((s.slot for s in self.running if s.finished), reverse=True)
        for slot in done:
            seq, none = self.running[slot], self.aux[slot, :0]
            # ended from outside (aborted, failed): tell the tap now, so it frees the request's states
            if seq.finish_reason not in ("stop", "length"):
                self._emit(seq, int(self.lengths[slot]), self.tokens[slot, :1], none, none, [], False)
            last = len(self.running) - 1
            if slot != last:
                self._move(last, slot)
                self.running[slot] = self.running[last]
                self.running[slot].slot = slot
            self.running.pop()

    def _move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src]) + 1
        self.cache.move_slot(src, dst, n)
        key = self.draft_key(self.running[src].workload)
        if key is not None:  # only the moving sequence's own draft holds anything of it
            dc, m = self.drafts[key].cache, int(self.draft_lengths[src])
            dc.k[dst, :, :m] = dc.k[src, :, :m]
            dc.v[dst, :, :m] = dc.v[src, :, :m]
        self.tokens[dst, : n + 1] = self.tokens[src, : n + 1]
        self.aux[dst, :n] = self.aux[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.draft_lengths[dst] = self.draft_lengths[src]
