"""What the registry says of a workload's candidates, for the capture advisor: since when its trainer
stopped improving (`saturated`), and since when the gate has refused what it makes (`outdone`).

Training is done for now when none of the last `patience` candidates beat the one before it by
`min_improvement` on the trainer's held-out examples; and, while the draft pays (the advisor's
call), when the gate refused the last `outdone_after` candidates it decided on. Each is dated by the
oldest candidate it counts: the advisor ends training only on candidates made after the workload
came to need it (refusals of the last traffic's candidates once ended a French phase's capture three
minutes in).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from tide.registry.tags import VersionTags


@dataclass
class HistoryConfig:
    patience: int = 3  # candidates without held-out improvement before training counts as done
    min_improvement: float = 0.01
    # gated candidates in a row that the gate refused before training counts as done while the
    # workload's draft pays: its trainer keeps "improving" on its own last candidate without ever
    # beating what serves (on code, thirteen in ten minutes), and every captured request costs
    outdone_after: int = 5


class RegistryCandidates:
    """The `CandidateHistory` a serving node reads from the registry (unix seconds by workload)."""

    def __init__(self, client: MlflowClient, cfg: HistoryConfig):
        self.client, self.cfg = client, cfg
        self.saturated: dict[str, float] = {}
        self.outdone: dict[str, float] = {}

    def check(self, workload: str, name: str) -> None:
        n, k = self.cfg.patience, self.cfg.outdone_after
        try:
            versions = self.client.search_model_versions(
                f"name = '{name}'", max_results=max(4 * n, 2 * k), order_by=["version_number DESC"]
            )
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return
            raise
        read = [(v, VersionTags.from_tags(v.tags)) for v in versions]
        made = [(v, t) for v, t in read if t.candidate is not None]  # the trainer's candidates
        last = made[:n]
        stalled = len(last) == n and max(t.candidate.held_out_gain for _, t in last if t.candidate) < (
            self.cfg.min_improvement
        )
        _dated(self.saturated, workload, [v for v, _ in last] if stalled else [])
        gated = [(v, t.verdict.decision) for v, t in made if t.verdict and t.verdict.decision != "skipped"][
            :k
        ]
        refused = len(gated) == k and all(d == "refused" for _, d in gated)
        _dated(self.outdone, workload, [v for v, _ in gated] if refused else [])


def _dated(moments: dict[str, float], workload: str, counted: list[ModelVersion]) -> None:
    """A condition on these candidates holds (none: it does not), dated by the oldest one's
    registration (the registry's clock, in unix seconds, as this node's)."""
    if counted:
        moments[workload] = min(int(v.creation_timestamp or 0) for v in counted) / 1000.0
    else:
        moments.pop(workload, None)
