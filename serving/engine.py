"""The serving engine: continuous batching with EAGLE-3 chain speculation over one static KV cache.

One `step()` admits waiting requests (prefill, one at a time), then advances every running sequence
by one target forward pass: the draft proposes gamma tokens per sequence, the target verifies all
of them for the whole batch at once, and each sequence keeps its accepted prefix plus one
correction/bonus token. Rejected tokens are rolled back by moving the sequence's length back: cache
entries past the length are never attended to and are overwritten next step.

Running sequences occupy the slots [0, B) of the cache in order, so every forward reads one
contiguous slice; a finishing sequence's slot is refilled by moving the last one into it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tide.models.eagle3 import DraftKV, Eagle3Draft
from tide.models.llama import Batch
from tide.models.loader import Target
from tide.models.packing import pack_linears
from tide.serving.detokenizer import Detokenizer
from tide.serving.sampling import BatchSampling, SamplingParams, Verdict, probs_from_logits, sample, verify


@dataclass
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 2048  # prompt + completion
    gamma: int = 4  # draft tokens per step; 0 turns speculation off
    max_gamma: int = 8
    seed: int = 0


@dataclass
class TapEvent:
    """Hidden states of committed positions whose next token the request kept.

    Positions [first_position, first_position + m): `aux` and `hidden` hold m states and `tokens` the
    m + 1 tokens at positions first_position ... first_position + m, so the state at position p comes
    with the token it predicted. Consecutive events of a request overlap by that one token, and
    together they carry exactly the prompt and the completion the client received.
    """

    request_id: str
    workload: str
    first_position: int
    tokens: torch.Tensor  # (m + 1,) token ids
    aux: torch.Tensor  # (m, 3d) residual stream before the aux layers
    hidden: torch.Tensor  # (m, d) final normed hidden state (predicts the next token)
    prefill: bool
    draft_version: str
    final: bool = False  # the request's last event


TapCallback = Callable[[TapEvent], None]


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    workload: str = "default"
    capture: bool = True
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

    def add(self, accepted: torch.Tensor, gamma: int) -> None:
        depth = torch.arange(gamma)
        self.attempted[:gamma] += (accepted.unsqueeze(1) >= depth).sum(0)
        self.accepted[:gamma] += (accepted.unsqueeze(1) > depth).sum(0)
        self.steps += int(accepted.numel())
        self.emitted += int(accepted.sum()) + int(accepted.numel())

    def rates(self) -> list[float]:
        return [
            a / t if t else 0.0 for a, t in zip(self.accepted.tolist(), self.attempted.tolist(), strict=True)
        ]

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per sequence per target step (1 + accepted drafts)."""
        return self.emitted / self.steps if self.steps else 0.0


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
        self, target: Target, draft: Eagle3Draft | None, cfg: EngineConfig, tap: TapCallback | None = None
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
        self._pending: tuple[Eagle3Draft | None, DraftKV | None] | None = None  # next draft and its cache
        self.tap_seconds = 0.0  # time spent handing hidden states out (benchmarks report it)
        self.timing = StepTiming()  # measured while serving: what the cost model needs
        self.draft: Eagle3Draft | None = None
        self.dcache: DraftKV | None = None
        if draft is not None:
            self.set_draft(draft)
            self._swap_if_pending()

    # -- requests ---------------------------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        workload: str = "default",
        capture: bool = True,
        detokenize: bool = False,
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
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt), params, workload, capture)
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
    def load_draft(self, path: str | Path) -> Eagle3Draft:
        """Load and check a draft in the caller's thread; the engine switches to it between steps."""
        draft = Eagle3Draft.load(
            path, self.model.embed_tokens, self.model.cfg, self.target.fingerprint, self.dtype
        )
        self.set_draft(draft)
        return draft

    def set_draft(self, draft: Eagle3Draft | None) -> None:
        """Queue a draft (None: stop speculating). The engine takes it over (its linears get prepacked)."""
        cache = None
        if draft is not None:
            # the slow parts happen here, off the engine's thread: weight packing, cache allocation
            pack_linears(draft)
            cache = draft.new_cache(self.cfg.max_batch, self.capacity, self.dtype)
        with self._lock:
            self._pending = (draft, cache)

    def set_gamma(self, gamma: int) -> None:
        """Draft tokens per step from the next step on (0: no speculation)."""
        if not 0 <= gamma <= self.cfg.max_gamma:
            raise ValueError(f"gamma must be in [0, {self.cfg.max_gamma}], got {gamma}")
        self.cfg.gamma = gamma

    @property
    def draft_version(self) -> str:
        return self.draft.cfg.version if self.draft is not None else "none"

    def _swap_if_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self.draft, self.dcache = pending
        if self.draft is None:
            return
        self._draft_ids = self.draft.target_ids()
        # the new draft's cache is empty: rebuild it from the stored aux states of running sequences
        for seq in self.running:
            self.draft_lengths[seq.slot] = 0
            self._sync_draft(seq.slot)

    def _sync_draft(self, slot: int) -> None:
        """Bring one sequence's draft cache up to its last committed position but one."""
        assert self.draft is not None and self.dcache is not None
        start, end = int(self.draft_lengths[slot]), int(self.lengths[slot]) - 1
        if end <= start:
            return
        pos = torch.arange(start, end).unsqueeze(0)
        batch = Batch.make(slot, pos, None, self.capacity)
        hidden = self.draft.fc(self.aux[slot, start:end].unsqueeze(0))
        self.draft(hidden, self.tokens[slot, start + 1 : end + 1].unsqueeze(0), batch, self.dcache)
        self.draft_lengths[slot] = end

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self._swap_if_pending()
        outputs: list[StepOutput] = []
        self._drop_finished()
        while self.waiting and len(self.running) < self.cfg.max_batch:
            with self._lock:
                seq = self.waiting.popleft()
            if seq.finished:
                continue
            outputs.append(self._prefill(seq))
        self._drop_finished()
        if self.running:
            outputs.extend(self._decode())
        self._drop_finished()
        return outputs

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
        if self.draft is not None:
            self._sync_draft(slot)
        kept = self._append(seq, [first])
        self._emit(seq, 0, prompt, out.aux[0], out.hidden[0], kept, True)
        return StepOutput(seq, kept)

    def _propose(
        self, seqs: list[Sequence], gamma: int, s: BatchSampling, u: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain-draft gamma tokens per sequence: (B, gamma) target ids, and q (B, gamma, V) when sampling."""
        draft = self.draft
        assert draft is not None and self.dcache is not None
        bsz = len(seqs)
        rows = torch.arange(bsz)
        lengths, dlen = self.lengths[:bsz], self.draft_lengths[:bsz]
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
            Batch.make(0, pos, valid, self.capacity),
            self.dcache,
        )
        last = out[rows, lengths - 1 - dlen].unsqueeze(1)
        self.draft_lengths[:bsz] = lengths
        tokens = torch.empty(bsz, gamma, dtype=torch.long)
        qs: list[torch.Tensor] = []
        for i in range(gamma):
            logits = draft.logits(last[:, 0]).unsqueeze(1)  # (B, 1, Vd)
            if u is None:
                d = logits[:, 0].argmax(-1)
            else:
                q = probs_from_logits(logits, BatchSampling(s.temperature, s.top_p, s.top_k, False))[:, 0]
                d = sample(q, u[:, i])
                full = torch.zeros(bsz, self.model.cfg.vocab_size)
                qs.append(full.index_copy_(1, self._draft_ids, q))
            tokens[:, i] = self._draft_ids[d]
            if i + 1 < gamma:
                p = (lengths + i).unsqueeze(1)
                last = draft(last, tokens[:, i : i + 1], Batch.make(0, p, None, self.capacity), self.dcache)
        return tokens, (torch.stack(qs, 1) if qs else None)

    def _decode(self) -> list[StepOutput]:
        start = time.perf_counter()
        seqs = self.running
        bsz = len(seqs)
        rows = torch.arange(bsz)
        gamma = self.cfg.gamma if self.draft is not None else 0
        s = BatchSampling.of([q.params for q in seqs])
        u = None if s.all_greedy else self._uniforms(seqs, 2 * gamma + 1)
        lengths = self.lengths[:bsz].clone()
        if gamma > 0:
            drafted, q = self._propose(seqs, gamma, s, u)
            self.timing.propose_seconds += time.perf_counter() - start
        else:
            drafted, q = torch.zeros(bsz, 0, dtype=torch.long), None
        inp = torch.cat([self.tokens[rows, lengths].unsqueeze(1), drafted], 1)
        pos = lengths.unsqueeze(1) + torch.arange(gamma + 1)
        out = self.model(inp, Batch.make(0, pos, None, self.capacity), self.cache, True)
        assert out.aux is not None
        logits = self.model.logits(out.hidden)
        verdict = self._verify(logits, drafted, q, s, u, gamma)
        acc = verdict.accepted
        # commit: aux states of the verified positions and the tokens that follow them
        self.aux[rows.unsqueeze(1), pos] = out.aux
        self.tokens[rows.unsqueeze(1), pos + 1] = verdict.tokens
        self.lengths[:bsz] = lengths + acc + 1
        if gamma > 0:
            self.stats.add(acc, gamma)
        new_tokens = verdict.tokens.tolist()
        self.timing.decode_steps += 1
        self.timing.decode_seconds += time.perf_counter() - start
        results = []
        starts = lengths.tolist()
        for i, (seq, n) in enumerate(zip(seqs, acc.tolist(), strict=True)):
            seq.steps += 1
            kept = self._append(seq, new_tokens[i][: n + 1])
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
        if m == 0:
            return
        t = time.perf_counter()
        tokens = torch.cat([inputs, torch.tensor(kept, dtype=inputs.dtype)])
        self.tap(
            TapEvent(
                seq.request_id,
                seq.workload,
                first,
                tokens,
                aux[:m],
                hidden[:m],
                prefill,
                self.draft_version,
                seq.finished,
            )
        )
        self.tap_seconds += time.perf_counter() - t

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
            last = len(self.running) - 1
            if slot != last:
                self._move(last, slot)
                self.running[slot] = self.running[last]
                self.running[slot].slot = slot
            self.running.pop()

    def _move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src]) + 1
        self.cache.move_slot(src, dst, n)
        if self.dcache is not None:
            m = int(self.draft_lengths[src])
            self.dcache.k[dst, :, :m] = self.dcache.k[src, :, :m]
            self.dcache.v[dst, :, :m] = self.dcache.v[src, :, :m]
        self.tokens[dst, : n + 1] = self.tokens[src, : n + 1]
        self.aux[dst, :n] = self.aux[src, :n]
        self.lengths[dst] = self.lengths[src]
        self.draft_lengths[dst] = self.draft_lengths[src]
