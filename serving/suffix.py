"""Model-free drafting: continue the context the way the workload's recent text continued it.

A `SuffixIndex` keeps one workload's recent token streams (prompts and completions) in a ring of
`tokens` ids, oldest out first. To propose, it finds where the context's last tokens occurred
before (in the index and in the sequence's own context, longest match first: all tensor
comparisons, no tree to keep in step) and follows what came next, one depth at a time by majority
vote among the matches that still agree.

How far to follow is learned, not guessed. `SuffixProposer` keeps acceptance counts by depth for
each class of match length, per workload, like the learned draft's: the probability that a
proposal reaches depth d is the product of those rates times the vote's agreement, and the sum of
those probabilities is the tokens it is expected to add. The proposal is cut where tokens per
second peak: at the k that maximises (1 + expected tokens of its first k) / C(k), C(k) the verify
time of k + 1 tokens per row relative to one, from the node's measured step times (k = 0: no
proposal, where none pays). The engine weighs the speedup this predicts against the learned
draft's.

It needs no hidden states and runs no model: it serves before any draft exists, and the moment
a workload repeats itself. Other nodes' finished requests can come in too (`feed`, from any
thread: `suffix_feed.py` reads them off the workload topics); they join the indexes when the
engine next drafts (`take_fed`), and a request this node served itself is not indexed twice.
"""

from __future__ import annotations

import queue
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tide.serving.drafts import DraftStats

# match lengths are classed by these lower bounds: a long match predicts a long continuation
MATCH_CLASSES = (2, 4, 8, 16)
PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 4.0  # an untried class: half its tokens accepted, soon overruled


@dataclass
class SuffixConfig:
    tokens: int = 1 << 16  # per workload: the index's memory is 8 bytes a token
    max_match: int = 32  # context tokens compared at most
    min_match: int = 2  # shorter matches are coincidences more often than not
    # verify time of each extra token relative to a one-token step, where the node measured none
    # (T(2)/T(1) - 1 was 0.096 at batch 1 on a 2-core CPU)
    step_cost: float = 0.1
    max_tokens: int = 8  # proposed at most per step
    max_workloads: int = 64  # indexes a feed may open for workloads this node has not served
    inbox: int = 1024  # fed requests waiting for the engine's next proposal; more are dropped


@dataclass
class SuffixProposal:
    tokens: list[int]
    reach: list[float]  # probability that each token is accepted (and all before it)
    match_class: int
    speedup: float  # predicted tokens per second over a step without proposal


class SuffixIndex:
    """One workload's recent streams in a ring; -1 separates streams, so no match crosses two."""

    def __init__(self, capacity: int):
        self.buf = torch.full((capacity,), -1, dtype=torch.long)
        self.end = 0

    def add(self, tokens: list[int]) -> None:
        t = torch.tensor(tokens[-(len(self.buf) - 1) :], dtype=torch.long)
        n = len(t) + 1
        if self.end + n > len(self.buf):  # wrap: the tail past the last stream is left empty
            self.buf[self.end :] = -1
            self.end = 0
        self.buf[self.end : self.end + len(t)] = t
        self.buf[self.end + len(t)] = -1
        self.end += n


def longest_matches(hay: torch.Tensor, context: torch.Tensor, max_match: int) -> tuple[int, torch.Tensor]:
    """The longest match of the context's tail in `hay` with a token after it: (its length, the
    positions in `hay` of its last token). (0, empty) if the last token never occurs."""
    ends = (hay[:-1] == context[-1]).nonzero().squeeze(1)
    if ends.numel() == 0:
        return 0, ends
    depth = torch.arange(min(max_match, len(context)))
    idx = ends.unsqueeze(1) - depth
    same = (hay[idx.clamp(min=0)] == context.flip(0)[: len(depth)]) & (idx >= 0)
    lengths = same.long().cumprod(1).sum(1)
    best = int(lengths.max())
    return best, ends[lengths == best]


class SuffixProposer:
    """Per workload: an index of its recent text and the acceptance its proposals have met."""

    def __init__(self, cfg: SuffixConfig):
        self.cfg = cfg
        self.indexes: dict[str, SuffixIndex] = {}
        self.stats: dict[str, SuffixStats] = {}
        self._inbox: queue.Queue[tuple[str, str, list[int]]] = queue.Queue(cfg.inbox)
        self._own: OrderedDict[str, None] = OrderedDict()  # recent request ids served here
        self.fed = 0  # requests from the feed that joined an index
        # from the feed, dropped; each counter has one writer (`+=` from two threads can lose counts)
        self.dropped_inbox_full = 0  # the feed's thread
        self.dropped_workloads_full = 0  # the engine's thread

    def remember(self, workload: str, tokens: list[int], request_id: str = "") -> None:
        """A request this node finished (engine thread)."""
        if request_id:
            self._own[request_id] = None
            while len(self._own) > 4 * self.cfg.inbox:
                self._own.popitem(last=False)
        self._add(workload, tokens)

    def feed(self, workload: str, request_id: str, tokens: list[int]) -> None:
        """A request some node finished (any thread): indexed at the next proposal."""
        try:
            self._inbox.put_nowait((workload, request_id, tokens))
        except queue.Full:
            self.dropped_inbox_full += 1

    @property
    def fed_dropped(self) -> int:
        """Requests from the feed not indexed: the inbox full, or too many workloads."""
        return self.dropped_inbox_full + self.dropped_workloads_full

    def _add(self, workload: str, tokens: list[int]) -> None:
        if workload not in self.indexes:
            self.indexes[workload] = SuffixIndex(self.cfg.tokens)
        self.indexes[workload].add(tokens)

    def take_fed(self) -> None:
        """Index what the feed brought (engine thread, once a step)."""
        while True:
            try:
                workload, rid, tokens = self._inbox.get_nowait()
            except queue.Empty:
                return
            if rid in self._own:
                continue
            if workload not in self.indexes and len(self.indexes) >= self.cfg.max_workloads:
                self.dropped_workloads_full += 1
                continue
            self._add(workload, tokens)
            self.fed += 1

    def _stats(self, workload: str) -> SuffixStats:
        if workload not in self.stats:
            self.stats[workload] = SuffixStats(self.cfg.max_tokens)
        return self.stats[workload]

    def propose(
        self, workload: str, context: torch.Tensor, limit: int, cost: list[float] | None = None
    ) -> SuffixProposal | None:
        """Up to `limit` tokens to follow `context` (its last token is the one being decoded), as
        many as maximise tokens per second; None where no proposal pays. `cost[k]`: the verify time
        of k + 1 tokens per row over one token's (default: `step_cost` per extra token)."""
        cfg = self.cfg
        limit = min(limit, cfg.max_tokens)
        if cost is None:
            cost = [1.0 + k * cfg.step_cost for k in range(limit + 1)]
        limit = min(limit, len(cost) - 1)
        if limit < 1 or len(context) < cfg.min_match:
            return None
        hays = [context[:-1]]
        if workload in self.indexes:
            hays.append(self.indexes[workload].buf)
        found = [(*longest_matches(h, context, cfg.max_match), h) for h in hays]
        best = max(n for n, _, _ in found)
        if best < cfg.min_match:
            return None
        span = torch.arange(1, limit + 1)
        follows = []
        for n, ends, h in found:
            if n == best:
                at = ends.unsqueeze(1) + span
                follows.append(torch.where(at < len(h), h[at.clamp(max=len(h) - 1)], -1))
        after = torch.cat(follows)  # (matches, limit): -1 where a stream ended
        cls = sum(best >= c for c in MATCH_CLASSES) - 1
        alphas = self._stats(workload).alphas(cls)
        tokens: list[int] = []
        reach: list[float] = []
        p = 1.0
        alive = torch.ones(len(after), dtype=torch.bool)
        for d in range(limit):
            col = after[alive, d]
            col = col[col >= 0]
            if col.numel() == 0:
                break
            values, counts = col.unique(return_counts=True)
            top = int(counts.argmax())
            p *= alphas[d] * float(counts[top]) / int(alive.sum())
            tokens.append(int(values[top]))
            reach.append(p)
            alive &= after[:, d] == values[top]
        gains = [(1.0 + sum(reach[:k])) / cost[k] for k in range(len(tokens) + 1)]
        k = max(range(len(gains)), key=gains.__getitem__)
        return SuffixProposal(tokens[:k], reach[:k], cls, gains[k]) if k else None

    def observe(self, workload: str, proposal: SuffixProposal, accepted: int) -> None:
        self._stats(workload).add(proposal, accepted)

    @property
    def chosen(self) -> int:
        """Sequence-steps drafted from the index, all workloads together."""
        return sum(s.chosen for s in self.stats.values())


@dataclass
class SuffixStats:
    """A workload's suffix proposals: the draft's acceptance counts by depth (`DraftStats`), one set
    per match class, and their totals for reports."""

    max_tokens: int
    by_class: list[DraftStats] = field(init=False)

    def __post_init__(self) -> None:
        self.by_class = [DraftStats(self.max_tokens) for _ in MATCH_CLASSES]

    def alphas(self, cls: int) -> list[float]:
        s = self.by_class[cls]
        rates = (s.accepted + PRIOR_WEIGHT * PRIOR_ALPHA) / (s.attempted + PRIOR_WEIGHT)
        return [float(r) for r in rates]

    def add(self, proposal: SuffixProposal, accepted: int) -> None:
        n = len(proposal.tokens)  # a padding token the target happened to accept is not the index's
        self.by_class[proposal.match_class].add(torch.tensor([min(accepted, n)]), n)

    @property
    def chosen(self) -> int:
        """Sequence-steps that drafted from the index."""
        return sum(s.steps for s in self.by_class)

    @property
    def proposed_tokens(self) -> int:
        return sum(s.drafted for s in self.by_class)

    @property
    def accepted_tokens(self) -> int:
        return sum(s.emitted - s.steps for s in self.by_class)
