"""Per-workload drafts and their swaps: which draft serves which workload, queued swaps taken over
between steps, and drafts that keep raising sent back to what they replaced.

A workload with a draft of its own runs it; every other workload runs the `default` draft (none:
no speculation). `set` queues a draft from any thread (the slow parts, weight packing and cache
allocation, happen there); the engine takes queued drafts over at the start of a step (`swap`), so
no step sees half a swap. A draft that raised on `max_failures` steps in a row (`judge`, after each
step) is reverted to the draft it replaced, or to none, and its workload is reported degraded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from tide.models.eagle3 import DraftKV, DraftStepCall, Eagle3Draft
from tide.models.packing import pack_linears
from tide.models.weights import int4_draft

log = logging.getLogger("tide.serving")

# (workload, version of the reverted draft, reason), on the engine's thread
RevertCallback = Callable[[str, str, str], None]


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


class DraftSet(Mapping[str, DraftSlot]):
    """The drafts serving now, by workload (a read-only mapping), and the swaps due."""

    def __init__(
        self,
        max_batch: int,
        capacity: int,
        dtype: torch.dtype,
        max_gamma: int,
        max_failures: int,
        step: DraftStepCall | None = None,
    ):
        self.max_batch, self.capacity, self.dtype = max_batch, capacity, dtype
        self.step = step  # the draft step compiled ahead of time, given to every draft served
        self.max_gamma, self.max_failures = max_gamma, max_failures
        self.slots: dict[str, DraftSlot] = {}  # by workload; "default" serves workloads without one
        self._pending: dict[str, DraftSlot | None] = {}  # drafts to take over at the next step
        self._lock = threading.Lock()
        # what each workload's draft replaced (None: nothing of its own), to revert to if it fails
        self.previous: dict[str, tuple[Eagle3Draft, dict[int, float] | None] | None] = {}
        self.degraded: dict[str, str] = {}  # workloads reverted since their last swap, and why
        self.step_failures = 0
        self.reverts = 0
        self.on_revert: RevertCallback | None = None
        self._errors: dict[str, str] = {}  # this step's failing drafts, by key
        self._ok: set[str] = set()  # this step's drafts that proposed

    def __getitem__(self, workload: str) -> DraftSlot:
        return self.slots[workload]

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    # -- which draft serves what -------------------------------------------------------------------
    def key_for(self, workload: str) -> str | None:
        """Which draft serves a workload: its own, else the default one (None: no draft)."""
        if workload in self.slots:
            return workload
        return "default" if "default" in self.slots else None

    def groups(self, workloads: Iterable[str]) -> dict[str, list[int]] | None:
        """Rows of the batch by the draft that serves them (None: some row has no draft at all)."""
        out: dict[str, list[int]] = {}
        for i, w in enumerate(workloads):
            key = self.key_for(w)
            if key is None:
                return None
            out.setdefault(key, []).append(i)
        return out

    def version_for(self, workload: str) -> str:
        key = self.key_for(workload)
        return self.slots[key].version if key is not None else "none"

    def versions(self) -> dict[str, str]:
        return {w: slot.version for w, slot in self.slots.items()}

    # -- swaps ---------------------------------------------------------------------------------------
    def new_slot(self, draft: Eagle3Draft, expected: dict[int, float] | None) -> DraftSlot:
        cache = draft.new_cache(self.max_batch, self.capacity, self.dtype)
        draft.compiled = self.step
        return DraftSlot(draft, cache, draft.target_ids(), DraftStats(self.max_gamma), expected)

    def set(self, draft: Eagle3Draft | None, workload: str, expected: dict[int, float] | None) -> None:
        """Queue a workload's draft, from any thread (None: back to the default draft, or, for the
        default, no speculation). `expected`: tau by gamma as the gate measured it, if known."""
        slot = None
        if draft is not None:
            pack_linears(int4_draft(draft))  # the slow parts happen here, off the engine's thread
            draft.layer_state  # noqa: B018 (made here too, not on the engine's first step)
            slot = self.new_slot(draft, expected)
        with self._lock:
            self._pending[workload] = slot

    def take_pending(self) -> dict[str, DraftSlot | None]:
        """The queued swaps, now due; the drafts they replace are kept to revert to."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for workload in pending:
            old = self.slots.get(workload)
            self.previous[workload] = (
                (old.draft, old.expected) if old is not None and not old.failures else None
            )
            self.degraded.pop(workload, None)
        return pending

    def apply(self, swaps: dict[str, DraftSlot | None]) -> None:
        for workload, slot in swaps.items():
            if slot is None:
                self.slots.pop(workload, None)
            else:
                self.slots[workload] = slot

    # -- failing drafts ------------------------------------------------------------------------------
    def failed(self, key: str, e: Exception) -> None:
        if key not in self._errors:
            log.warning("the draft of workload %s raised; this step goes without it: %r", key, e)
        self._errors[key] = f"{type(e).__name__}: {e}"[:300]

    def proposed(self, key: str) -> None:
        self._ok.add(key)

    def judge(self) -> dict[str, DraftSlot | None]:
        """After a step: a draft that raised in it counts one more failure, one that proposed starts
        over. The swaps due for drafts at `max_failures` (their workloads revert once the step is
        over: no step sees half)."""
        errors, ok = self._errors, self._ok
        self._errors, self._ok = {}, set()
        self.step_failures += len(errors)
        reverts: dict[str, DraftSlot | None] = {}
        for key, slot in self.slots.items():
            if key in errors:
                slot.failures += 1
            elif key in ok:
                slot.failures = 0
            if slot.failures < self.max_failures:
                continue
            prev = self.previous.pop(key, None)
            back = self.new_slot(*prev) if prev is not None else None
            to = back.version if back is not None else "no draft of its own"
            reason = f"draft {slot.version} raised on {slot.failures} steps in a row ({errors.get(key)}); reverted to {to}"
            log.error("workload %s: %s", key, reason)
            self.degraded[key] = reason
            self.reverts += 1
            reverts[key] = back
            if self.on_revert is not None:
                try:
                    self.on_revert(key, slot.version, reason)
                except Exception:
                    log.exception("the draft-revert callback failed")
        return reverts
