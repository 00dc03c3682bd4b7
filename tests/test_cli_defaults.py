"""Each `tide` option that sets a config field defaults to that field's default: the dataclasses
hold the defaults, the CLI repeats them (it stays importable without MLflow and FastAPI), and
this test keeps the two from drifting apart."""

from __future__ import annotations

import dataclasses
from typing import Any

import typer

from tide.bench.faults import FaultsBenchConfig
from tide.bench.records import RecordsBenchConfig
from tide.bench.shift import ShiftBenchConfig
from tide.bench.spec import SpecBenchConfig
from tide.bench.training import TrainingBenchConfig
from tide.bench.weights import WeightsBenchConfig
from tide.cli import app
from tide.producers.publisher import PublisherConfig
from tide.producers.records import HeldOutWindow
from tide.registry.gate import GateConfig
from tide.serving.api import ServerConfig
from tide.serving.controller import ControllerConfig
from tide.serving.draft_sync import SyncConfig
from tide.serving.engine import EngineConfig
from tide.trainers.online import OnlineConfig

# command -> the configs its options set, and options named otherwise than their field
CONFIGS: dict[str, tuple[list[type], dict[str, str]]] = {
    "serve": (
        [EngineConfig, ServerConfig, PublisherConfig, SyncConfig, ControllerConfig],
        # --workloads is a comma-separated list ('': the first names seen)
        {"registry_poll": "poll_seconds", "rollback_steps": "rollback_min_steps", "workloads": ""},
    ),
    "train": ([OnlineConfig], {"vocab_warmup": "vocab_warmup_positions"}),
    "gate": ([GateConfig, HeldOutWindow], {"held_out_seconds": "seconds"}),
    "bench spec": ([SpecBenchConfig], {}),
    "bench shift": ([ShiftBenchConfig], {}),
    "bench records": ([RecordsBenchConfig], {}),
    "bench training": ([TrainingBenchConfig], {}),
    "bench faults": ([FaultsBenchConfig], {}),
    "bench weights": ([WeightsBenchConfig], {}),
}


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _command(path: str) -> Any:
    cmd: Any = typer.main.get_command(app)
    for part in path.split():
        cmd = cmd.commands[part]
    return cmd


def test_cli_defaults_are_the_configs() -> None:
    checked, differ = 0, []
    for path, (classes, renamed) in CONFIGS.items():
        fields: dict[str, Any] = {}
        for cls in classes:
            fields.update(_defaults(cls))
        for p in _command(path).params:
            name = renamed.get(p.name or "", p.name or "")
            if name in fields and p.default is not None and not isinstance(p.default, (tuple, list)):
                want = fields[name]
                if isinstance(want, tuple):  # a list option, comma-separated
                    want = ",".join(map(str, want))
                if not (p.default == want or str(p.default) == str(want)):
                    differ.append((path, p.name, p.default, want))
                checked += 1
    assert not differ
    assert checked >= 25, checked
