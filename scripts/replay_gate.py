"""Were the gate's decisions in a shift run right? Replays them against what came after.

Run after `tide bench shift --work-dir DIR`: `python scripts/replay_gate.py DIR > decisions.jsonl`.
It restarts the run's Kafka broker and MLflow server on their folders. For each candidate the gate
decided against a baseline, it prints one JSON line: the decision, the paired tau gain over the
baseline and its standard error on the held-out requests the gate judged on (those of the two
minutes before the decision, as the gate keeps them, joined from their records as the gate joins
them; `z` with requests as the paired units), and both drafts' tau on the traffic of the three
minutes after it. That later traffic counts only requests no trainer had learnt from before
they were served (held-out ones, and a prompt's first request): a draft that learnt a prompt's text
is not judged on it coming again. A promotion was right when `after_gain` is positive.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient

from tide.bench.shift import AGAIN
from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.models.loader import TargetHead, load_head
from tide.producers.assembler import RequestAssembler
from tide.producers.consumer import RecordConsumer
from tide.producers.records import HiddenStateRecord
from tide.registry.gate import Gate, GateConfig, parse_profile
from tide.registry.store import PROFILE_TAG
from tide.registry.tags import VersionTags, parse_time
from tide.trainers.examples import example_of, in_window
from tide.trainers.ttt import Example

AFTER_SECONDS = 180.0


def read_records(bootstrap: str, head: TargetHead, workload: str) -> list[tuple[str, bool, Example]]:
    """Every request of the workload's topic, joined from its records, oldest first, with its id and
    held-out status."""
    consumer = RecordConsumer(bootstrap, [workload], f"replay-{time.time()}", head.fingerprint)
    requests = RequestAssembler()
    joined: list[HiddenStateRecord] = []
    empty = 0
    while empty < (3 if joined or requests.pending else 20):  # the first polls wait for the group to form
        batch = consumer.poll(512, 3.0)
        empty = 0 if batch else empty + 1
        for c in batch:
            joined += requests.add(c.record)
    consumer.close()
    out = [
        (r.request_id, r.held_out, ex)
        for r in joined + requests.flush(everything=True)
        if (ex := example_of(r, head.lm_head)) is not None
    ]
    return sorted(out, key=lambda r: r[2].created_at)


def main(work: Path, workload: str = "default") -> None:
    if not (work / "kafka" / "ports.json").is_file() or not (work / "mlflow" / "mlflow.db").is_file():
        sys.exit(
            f"{work} is not the --work-dir of a finished `tide bench shift` (no kafka/ or mlflow/ state)"
        )
    head = load_head()
    with KafkaBroker(work / "kafka") as kafka, MlflowServer(work / "mlflow") as registry:
        records = read_records(kafka.bootstrap, head, workload)
        cfg = GateConfig(registry.url, kafka.bootstrap, Path(tempfile.mkdtemp(prefix="replay-gate-")))
        gate = Gate(cfg, head)
        client = MlflowClient(registry.url)
        for rm in client.search_registered_models():
            profile = parse_profile((rm.tags or {}).get(PROFILE_TAG))
            versions = {v.version: v for v in client.search_model_versions(f"name = '{rm.name}'")}
            for v in sorted(versions.values(), key=lambda v: int(v.version)):
                verdict = VersionTags.from_tags(v.tags).verdict
                if verdict is None or verdict.decision == "skipped" or verdict.baseline_version is None:
                    continue
                base = versions[verdict.baseline_version]
                when = parse_time(verdict.time)
                held = in_window([ex for _, held_out, ex in records if ex.created_at <= when and held_out],
                                 cfg.held_out, when)  # fmt: skip
                after = [
                    ex for rid, held_out, ex in records
                    if when < ex.created_at <= when + AFTER_SECONDS and (held_out or AGAIN not in rid)
                ]  # fmt: skip
                if not held or not after:
                    continue
                cand, old = gate.evaluate(v, held, profile), gate.evaluate(base, held, profile)
                gamma = cand.best_gamma
                gain, se = cand.gain_over(old, gamma)
                cand_after, old_after = gate.evaluate(v, after, profile), gate.evaluate(base, after, profile)
                row = {
                    "version": v.version, "baseline": base.version, "decision": verdict.decision,
                    "reason": verdict.reason, "held_out_requests": len(held), "gamma": gamma,
                    "gain": round(gain, 4), "standard_error": round(se, 4), "z": round(gain / se, 2) if se else None,
                    "after_examples": len(after), "after_tau": round(cand_after.tau[gamma - 1], 4),
                    "after_baseline_tau": round(old_after.tau[gamma - 1], 4),
                    "after_gain": round(cand_after.gain_over(old_after, gamma)[0], 4),
                }  # fmt: skip
                print(json.dumps(row), flush=True)
        gate.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
