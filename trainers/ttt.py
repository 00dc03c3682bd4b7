"""The EAGLE-3 training step (training-time test) and its evaluation, shared by every trainer.

A training example is one sequence as the tap saw it: token ids, aux hidden states (3d), the final
normed hidden state (d), and which positions' next-token distributions are worth learning (the
completion). The target distribution at position t is softmax(lm_head(hidden_t)) restricted to the
draft vocabulary: the trainer needs the target's LM head, never the target itself.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tide.models.eagle3 import Eagle3Draft, soft_cross_entropy


@dataclass
class Example:
    tokens: torch.Tensor  # (n,) long
    aux: torch.Tensor  # (n, 3d)
    hidden: torch.Tensor  # (n, d)
    best: torch.Tensor  # (n,) the target's argmax at each position (computed once, from hidden)
    learn_from: int = 0  # positions >= this have distributions worth learning (the completion)
    created_at: float = 0.0  # when the serving node captured it (unix seconds; 0: unknown)

    @classmethod
    def make(
        cls,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        hidden: torch.Tensor,
        lm_head: torch.Tensor | None,
        learn_from: int = 0,
        created_at: float = 0.0,
    ) -> Example:
        """`best` needs the full LM head over every position: only evaluation uses it, so an example
        made only for training (lm_head None) skips that cost and holds -1."""
        if lm_head is None:
            best = torch.full((len(tokens),), -1, dtype=torch.long)
        else:
            best = torch.cat([(h.float() @ lm_head.float().T).argmax(-1) for h in hidden.split(256)])
        return cls(tokens, aux, hidden, best, learn_from, created_at)


@dataclass
class TrainConfig:
    ttt_steps: int = (
        4  # unrolled draft steps (SpecForge uses 7; at these acceptance rates depth > 4 rarely pays)
    )
    step_weight: float = 0.8
    lr: float = 1e-3
    batch_size: int = 4  # small batches, more updates: measured better per wall-clock second on CPU
    max_len: int = 512
    weight_decay: float = 0.0
    seed: int = 0
    autocast: bool | None = None  # bf16 matmuls (fp32 master weights); None: where they are fast


@functools.cache
def bf16_is_fast(device_type: str) -> bool:
    """bf16 autocast pays on CUDA and on CPUs with bf16 instructions (AVX512-BF16, AMX), about 2.5x
    there. Elsewhere it is emulated: on an AVX2-only EPYC a draft training step took about 50 s in
    bf16 against 2.4 s in fp32."""
    if device_type == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class Metrics:
    loss: float
    top1: list[float]  # per step: draft argmax == target argmax, over learnable positions
    tau: list[float]  # simulated tokens per target step for gamma = 1..ttt_steps (greedy chain)
    # the same as serving steps through the examples: a step starts where the last one's tokens end.
    # `tau` counts every position as a chain's start; a served step starts after a rejection, on the
    # harder positions, and a long accepted run is one step, not one start per position it covers
    # (on a shift run's code requests 1.72 per step at gamma 3 against 1.88, on French 1.49 against 1.73)
    step_tau: list[float]
    # per example: drafts the greedy chain accepts at gamma = 1..ttt_steps, summed over its anchors,
    # and its anchors; what a paired comparison of two drafts on the same examples needs
    accepted: torch.Tensor  # (examples, ttt_steps)
    anchors: torch.Tensor  # (examples,)


def select_vocab(
    examples: list[Example],
    size: int,
    vocab_size: int,
    fill: list[Example] | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `size` most frequent target tokens: of the examples' completions, then of the whole
    examples, then of `fill` (older traffic, so a workload that comes back keeps some of its
    words), then the ids in `keep` (the vocabulary the draft had: a few thousand positions do not
    name a whole vocabulary), then the lowest unused ids."""
    ranked: list[int] = []
    for source, completions in ((examples, True), (examples, False), (fill or [], False)):
        if len(ranked) >= size:
            break
        counts: Counter[int] = Counter()
        for ex in source:
            counts.update((ex.tokens[ex.learn_from :] if completions else ex.tokens).tolist())
        seen = set(ranked)
        ranked += [t for t, _ in counts.most_common() if t not in seen][: size - len(ranked)]
    if len(ranked) < size and keep is not None:
        seen = set(ranked)
        ranked += [t for t in keep.tolist() if t not in seen][: size - len(ranked)]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def init_draft_head(draft: Eagle3Draft, lm_head: torch.Tensor) -> None:
    """Start the draft's LM head from the target's rows for the draft vocabulary."""
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head[draft.target_ids()].to(draft.lm_head.weight.dtype))


# Batch lengths and the first anchor are rounded to multiples of this, so a trainer sees a few shapes:
# oneDNN keeps primitives per shape, and with every length its own a training loop's memory kept
# growing (0.7 GB over 50 steps of new examples, 0.3 GB with lengths in multiples of 32:
# `scripts/training_rss.py DRAFT --mmap-threshold [--shape-step 1]`).
# Padding is at the end and masked: losses and gradients do not change (tests/test_trainer_parts.py).
SHAPE_STEP = 32


def collate(examples: list[Example], max_len: int) -> dict[str, torch.Tensor]:
    """Pad a batch (to a multiple of SHAPE_STEP); long sequences are cut to a random window of max_len
    positions."""
    picked = []
    for ex in examples:
        n = len(ex.tokens)
        start = random.randint(0, n - max_len) if n > max_len else 0
        picked.append((ex, start, min(n, start + max_len)))
    length = -(-max(e - s for _, s, e in picked) // SHAPE_STEP) * SHAPE_STEP
    b = len(picked)
    d = examples[0].hidden.shape[-1]
    tokens = torch.zeros(b, length, dtype=torch.long)
    aux = torch.zeros(b, length, 3 * d)
    hidden = torch.zeros(b, length, d)
    learn = torch.zeros(b, length, dtype=torch.bool)
    best = torch.zeros(b, length, dtype=torch.long)
    for i, (ex, s, e) in enumerate(picked):
        n = e - s
        tokens[i, :n] = ex.tokens[s:e]
        aux[i, :n] = ex.aux[s:e].float()
        hidden[i, :n] = ex.hidden[s:e].float()
        learn[i, :n] = torch.arange(s, e) >= ex.learn_from
        best[i, :n] = ex.best[s:e]
    positions = torch.arange(length).repeat(b, 1)
    return {
        "tokens": tokens,
        "aux": aux,
        "hidden": hidden,
        "learn": learn,
        "best": best,
        "positions": positions,
    }


def shift(x: torch.Tensor, k: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + k], padded at the end."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], 1)


def learn_start(learn: torch.Tensor, steps: int) -> int:
    """The first anchor any of `steps` unrolled steps learns from, over the batch: the earliest
    completion position less `steps` (a step's anchor t predicts position t + 1 + i)."""
    rows = learn.any(-1)
    if not bool(rows.any()):
        return 0
    first = int(learn[rows].int().argmax(-1).min())
    return max(0, first - steps)


def ttt_forward(
    draft: Eagle3Draft, lm_head: torch.Tensor, batch: dict[str, torch.Tensor], steps: int, weight: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Loss over `steps` unrolled draft steps; also per-step correctness and validity masks, (B, L - s)
    from the first anchor s any step learns from (prompt positions before it teach nothing; skipping
    them saved about a tenth of a step on chat-shaped batches)."""
    tokens, learn = batch["tokens"], batch["learn"]
    s = learn_start(learn, steps) // SHAPE_STEP * SHAPE_STEP
    inputs = [shift(tokens, 1 + i) for i in range(steps)]
    outs = draft.unrolled(batch["aux"], inputs, batch["positions"], start=s)
    outs[0] = outs[0][:, s:]
    learn, best = learn[:, s:], batch["best"][:, s:]
    ids = draft.target_ids()
    head = lm_head[ids]  # target LM head restricted to the draft vocabulary
    with torch.no_grad():  # once per sequence, then shifted for each step
        target_probs = (batch["hidden"][:, s:] @ head.T).float().softmax(-1)
    total = torch.zeros((), device=lm_head.device)
    corrects: list[torch.Tensor] = []
    valids: list[torch.Tensor] = []
    for i, out in enumerate(outs):
        tgt_probs = shift(target_probs, 1 + i)
        valid = shift(learn, 1 + i, False)
        full_best = shift(best, 1 + i)  # the target's choice over its full vocabulary
        logits = draft.logits(out)
        loss = soft_cross_entropy(logits, tgt_probs)
        denom = valid.sum().clamp(min=1)
        total = total + (weight**i) * (loss * valid).sum() / denom
        pred = ids[logits.argmax(-1)]
        corrects.append((pred == full_best) & valid)
        valids.append(valid)
    return total, corrects, valids


def chain_lengths(corrects: list[torch.Tensor], valids: list[torch.Tensor]) -> torch.Tensor:
    """(B, L): drafts the greedy chain accepts from each anchor, up to len(corrects)."""
    alive = valids[0].clone()
    length = torch.zeros(alive.shape, dtype=torch.long, device=alive.device)
    for c, v in zip(corrects, valids, strict=True):
        alive = alive & c & v
        length += alive.long()
    return length


def chain_accepted(
    corrects: list[torch.Tensor], valids: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance per sequence: drafts accepted at gamma = 1..steps summed over its
    anchors (positions where every step has a target), (B, steps); and its anchors, (B,)."""
    anchors = valids[-1]
    depth = torch.arange(len(corrects), device=anchors.device)
    reached = (chain_lengths(corrects, valids).unsqueeze(-1) > depth) & anchors.unsqueeze(-1)
    return reached.sum(1).cumsum(-1), anchors.sum(-1)


def served_steps(lengths: torch.Tensor, starts: torch.Tensor, gamma: int) -> tuple[int, int]:
    """Tokens and target steps of serving each row at `gamma` drafts a step, from its first start
    (`starts`: where a chain can start, the completion) to its last: greedy acceptance at gamma is
    the smaller of the chain's length there and gamma. Evaluation only: a walk per row."""
    tokens = steps = 0
    for row, ok in zip(lengths.tolist(), starts.tolist(), strict=True):
        where = [i for i, o in enumerate(ok) if o]
        if not where:
            continue
        t, last = where[0], where[-1]
        while t <= last:
            k = min(row[t], gamma) if ok[t] else 0
            tokens, steps, t = tokens + k + 1, steps + 1, t + k + 1
    return tokens, steps


def chain_tau(accepted: torch.Tensor, anchors: torch.Tensor) -> list[float]:
    """tau(gamma) = 1 + sum_k P(first k drafts all accepted), over all anchors."""
    n = float(anchors.sum())
    return [1.0 + float(a) / n if n else 1.0 for a in accepted.sum(0)]


class Trainer:
    """Owns a draft, its optimizer and the target's LM head; one call to `step` is one update."""

    def __init__(self, draft: Eagle3Draft, lm_head: torch.Tensor, cfg: TrainConfig):
        self.draft = draft.float().train()
        self.lm_head = lm_head.detach().float()
        self.cfg = cfg
        params = [p for p in draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.steps = 0  # updates made
        self.skipped = 0  # steps not taken: their loss or gradients were not finite
        self.device_type = self.lm_head.device.type
        self.autocast = bf16_is_fast(self.device_type) if cfg.autocast is None else cfg.autocast

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # examples stay in host memory; a CUDA trainer moves one batch at a time
        return {k: v.to(self.lm_head.device, non_blocking=True) for k, v in batch.items()}

    def step(self, examples: list[Example]) -> float:
        batch = self._to_device(collate(examples, self.cfg.max_len))
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, _, _ = ttt_forward(
                self.draft, self.lm_head, batch, self.cfg.ttt_steps, self.cfg.step_weight
            )
        self.opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        # an inf or NaN step would make every weight NaN for good: no update (`steps` stays, `skipped` counts)
        if not math.isfinite(value):
            self.skipped += 1
            return value
        loss.backward()
        norm = nn.utils.clip_grad_norm_(self.draft.parameters(), 0.5)
        if not bool(torch.isfinite(norm)):
            self.opt.zero_grad(set_to_none=True)
            self.skipped += 1
            return value
        self.opt.step()
        self.steps += 1
        return value

    def evaluate(self, examples: list[Example]) -> Metrics:
        self.draft.eval()
        try:
            return evaluate(self.draft, self.lm_head, examples, self.cfg)
        finally:
            self.draft.train()


@torch.no_grad()
def evaluate(draft: Eagle3Draft, lm_head: torch.Tensor, examples: list[Example], cfg: TrainConfig) -> Metrics:
    """Held-out metrics of a draft (in eval mode, on lm_head's device): loss, top-1 and chain tau."""
    losses, accepted, anchors = [], [], []
    hits, counts = torch.zeros(cfg.ttt_steps), torch.zeros(cfg.ttt_steps)
    served = torch.zeros(cfg.ttt_steps, 2)  # tokens and steps at gamma = 1..ttt_steps
    for i in range(0, len(examples), cfg.batch_size):
        batch = {
            k: v.to(lm_head.device, non_blocking=True)
            for k, v in collate(examples[i : i + cfg.batch_size], 10**9).items()
        }
        loss, c, v = ttt_forward(draft, lm_head, batch, cfg.ttt_steps, cfg.step_weight)
        losses.append(float(loss))
        hits += torch.stack([ck.sum() for ck in c]).cpu()
        counts += torch.stack([vk.sum() for vk in v]).cpu()
        a, n = chain_accepted(c, v)
        accepted.append(a.cpu())
        anchors.append(n.cpu())
        lengths, starts = chain_lengths(c, v).cpu(), v[0].cpu()
        for g in range(cfg.ttt_steps):
            served[g] += torch.tensor(served_steps(lengths, starts, g + 1), dtype=served.dtype)
    top1 = (hits / counts.clamp(min=1)).tolist()
    acc = torch.cat(accepted) if accepted else torch.zeros(0, cfg.ttt_steps, dtype=torch.long)
    n = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.long)
    step_tau = [float(t / s) if s else 1.0 for t, s in served.tolist()]
    return Metrics(sum(losses) / max(1, len(losses)), top1, chain_tau(acc, n), step_tau, acc, n)
