"""What the registry follower (`DraftSync`, `LiveCheck`) needs of a serving engine: the seam a second
engine plugs into. TIDE's `Engine` is one `DraftSink`; `vllm_adapter.drafts.VllmDrafts` is the other.

A sink checks a downloaded draft folder against its target (`read_draft`: raises `DraftLoadError` or
`DraftMismatchError`, never serves it), takes a checked draft for a workload (`set_draft`: None puts
the workload back on the draft it started with; raises `DraftLoadError` if the engine itself refuses
it) and says how a workload's draft does live (`acceptance`: the acceptance source).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tide.models.eagle3 import Eagle3Draft
from tide.registry.profile import StepProfile


@dataclass
class LiveAcceptance:
    version: str  # the draft's (its config's `version`)
    steps: int  # sequence-steps it drafted for since it was swapped in
    tokens_per_step: float  # over those steps: accepted draft tokens + 1


class DraftSink(Protocol):
    @property
    def fingerprint(self) -> str: ...  # the target's

    @property
    def gamma(self) -> int: ...  # the draft tokens per step it serves at now

    def workloads(self) -> set[str]: ...  # whose champions it takes

    def read_draft(self, path: str | Path) -> Eagle3Draft: ...

    def set_draft(
        self, draft: Eagle3Draft | None, workload: str = "default", expected: dict[int, float] | None = None
    ) -> None: ...

    def acceptance(self, workload: str) -> LiveAcceptance | None: ...

    def step_profile(self) -> StepProfile | None: ...  # step times for the gate, None if it cannot tell
