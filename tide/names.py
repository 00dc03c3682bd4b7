"""Every name two processes must agree on: Kafka topics and consumer groups, registered models, the
MLflow experiment and the gate's lease. Built here and nowhere else."""

from __future__ import annotations

TOPIC_PREFIX = "tide.hidden."  # + workload: one topic per workload, so a trainer reads one alone
EXPERIMENT = "tide-drafts"  # MLflow experiment of trainer runs and registered folders
MODEL_PREFIX = "tide-draft-"  # + fingerprint[:12] + "-" + workload
LEASE_PREFIX = "tide-gate-lease-"  # + fingerprint[:12] + "-" + epoch: the gate that holds it acts


def topic_for(workload: str) -> str:
    return TOPIC_PREFIX + workload


def workload_of(topic: str) -> str:
    return topic.removeprefix(TOPIC_PREFIX)


def every_topic() -> str:
    """Every workload's topic, those made later included (a Kafka subscription pattern)."""
    return "^" + TOPIC_PREFIX.replace(".", "\\.") + ".+"


def trainer_group(workload: str) -> str:
    """The consumer group whose committed offsets are a workload's trainer's progress."""
    return f"tide-trainer.{workload}"


def suffix_group(node: str) -> str:
    """A serving node reads every workload's token streams for its suffix indexes: its own group."""
    return f"tide-suffix.{node}"


def gate_group(workload: str, instance: str) -> str:
    """A gate reads held-out records from the start of retention on each start: its own group, never committed."""
    return f"tide-gate.{workload}.{instance}"


def model_prefix(fingerprint: str) -> str:
    return f"{MODEL_PREFIX}{fingerprint[:12]}-"


def model_name(fingerprint: str, workload: str) -> str:
    """One registered model per (target, workload)."""
    return model_prefix(fingerprint) + workload


def lease_prefix(fingerprint: str) -> str:
    return f"{LEASE_PREFIX}{fingerprint[:12]}-"
