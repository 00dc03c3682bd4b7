"""Candidates into MLflow: one run per training session and workload, one model version per candidate.

The registered model is `tide-draft-<first 12 hex of the target fingerprint>-<workload>` (`tide.names.model_name`).
Each version carries, as tags, what the gate and the serving nodes check: workload, offset range,
records consumed, target fingerprint, draft version, and the sha256 of every file of the folder.
MLflow (or the S3 store behind it) being away when a trainer starts is waited out with backoff, for
`wait_s` at most; later failures are the trainer's to retry (`trainers.outbox.Outbox`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mlflow import MlflowClient

from tide.names import EXPERIMENT, model_name
from tide.registry.store import CHAMPION, alias_version, download_version, register_version
from tide.registry.tags import CandidateTags
from tide.trainers.export import export_all
from tide.trainers.outbox import Backoff, Candidate

log = logging.getLogger("tide.trainers")
START_WAIT_S = 300.0  # how long a starting trainer waits for MLflow to come back

T = TypeVar("T")


def with_backoff(
    what: str, call: Callable[[], T], wait_s: float = START_WAIT_S, backoff: Backoff | None = None
) -> T:
    """`call()`, tried again with capped exponential backoff while it raises, for `wait_s` at most
    (then its error is raised)."""
    backoff = backoff or Backoff(1.0, 30.0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except Exception as e:  # mlflow, requests and boto3 raise many types when a service is away
            delay = backoff.failed()
            if time.monotonic() + delay > deadline:
                raise
            log.warning("could not %s (%s: %s); trying again in %.0f s", what, type(e).__name__, e, delay)
            time.sleep(delay)


def champion_folder(
    client: MlflowClient, fingerprint: str, workload: str, state_dir: Path, wait_s: float = START_WAIT_S
) -> Path | None:
    """Download a workload's champion, if it has one, to start training from it."""

    def fetch() -> Path | None:
        mv = alias_version(client, model_name(fingerprint, workload), CHAMPION)
        return download_version(client, mv, state_dir / "champion") if mv is not None else None

    return with_backoff(f"read {workload}'s champion", fetch, wait_s)


class MlflowSink:
    """Called by the trainer with each candidate; owns the session's MLflow run."""

    def __init__(
        self,
        tracking_uri: str,
        workload: str,
        fingerprint: str,
        params: dict[str, Any],
        wait_s: float = START_WAIT_S,
    ):
        self.client = MlflowClient(tracking_uri)
        self.workload = workload
        self.fingerprint = fingerprint
        self.name = model_name(fingerprint, workload)
        self.run_id = with_backoff("start an MLflow run", lambda: self._start(params), wait_s)

    def _start(self, params: dict[str, Any]) -> str:
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT)
        run = self.client.create_run(
            exp_id,
            run_name=f"{self.workload}-{time.strftime('%Y%m%d-%H%M%S')}",
            tags={"workload": self.workload, "target_fingerprint": self.fingerprint},
        )
        run_id = str(run.info.run_id)
        for k, v in params.items():
            self.client.log_param(run_id, k, v)
        if not self.client.search_registered_models(f"name = '{self.name}'"):
            self.client.create_registered_model(
                self.name, tags={"workload": self.workload, "target_fingerprint": self.fingerprint}
            )
        return run_id

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.client.log_metric(self.run_id, k, v, step=step)

    def __call__(self, c: Candidate) -> None:
        step = c.ledger.steps
        metrics = {
            "eval_loss": c.metrics.loss,
            **{f"tau_gamma{i + 1}": t for i, t in enumerate(c.metrics.tau)},
        }
        metrics |= {f"top1_step{i + 1}": a for i, a in enumerate(c.metrics.top1)}
        self.log_step(step, metrics)
        export_all(c.folder)
        artifact_path = f"candidates/{c.version}"
        offsets = {k: [c.ledger.first_offsets.get(k, 0), v] for k, v in sorted(c.ledger.offsets.items())}
        tags = CandidateTags(
            workload=self.workload,
            target_fingerprint=self.fingerprint,
            draft_version=c.version,
            records_consumed=c.ledger.records,
            steps=step,
            offset_range=";".join(f"{k}={a}..{b}" for k, (a, b) in offsets.items()),
            held_out_tau=c.metrics.tau[-1],
            held_out_gain=c.gain,
        )
        mv = register_version(self.client, self.name, self.run_id, c.folder, artifact_path, tags.to_tags())
        log.info("candidate %s registered as %s version %s", c.version, self.name, mv.version)

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)
