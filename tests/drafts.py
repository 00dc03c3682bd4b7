"""Draft folders and registry versions for registry tests: good ones, and the bad kinds a registry
must never let reach serving (a wrong checksum, NaN weights, another target's draft)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from safetensors.torch import load_file, save_file

from tide.registry.gate import Gate
from tide.registry.store import SHA_TAG, register_version


def copy_draft(src: Path, dst: Path, version: str) -> Path:
    """The same draft under another version name (serving tells drafts apart by it)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["version"] = version
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def noisy_draft(src: Path, dst: Path, sigma: float, seed: int = 0) -> Path:
    """A worse draft: gaussian noise of sigma times each matrix's spread on every weight matrix."""
    copy_draft(src, dst, f"noisy-{sigma}")
    state = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point() and t.dim() > 1:
            noise = torch.randn(t.shape, generator=g) * sigma * t.float().std()
            state[name] = (t.float() + noise).to(t.dtype)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def nan_draft(src: Path, dst: Path) -> Path:
    copy_draft(src, dst, "nan")
    state = load_file(str(dst / "model.safetensors"))
    name = next(n for n, t in state.items() if t.is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(dst / "model.safetensors"))
    return dst


def foreign_draft(src: Path, dst: Path) -> Path:
    copy_draft(src, dst, "foreign")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["target_fingerprint"] = "0" * 64
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


class Registrar:
    """Registers draft folders as versions, the way trainers do (artifacts + sha256 tags)."""

    def __init__(self, url: str, fingerprint: str, workload: str):
        from tide.names import model_name

        self.client = MlflowClient(url)
        self.workload = workload
        self.name = model_name(fingerprint, workload)
        exp = self.client.get_experiment_by_name("tide-tests")
        exp_id = exp.experiment_id if exp else self.client.create_experiment("tide-tests")
        self.run_id = self.client.create_run(exp_id).info.run_id
        if not self.client.search_registered_models(f"name = '{self.name}'"):
            self.client.create_registered_model(self.name, tags={"workload": workload})

    def register(self, folder: Path, tags: dict[str, str] | None = None) -> ModelVersion:
        path = f"drafts/{uuid.uuid4().hex[:8]}"
        return register_version(self.client, self.name, self.run_id, folder, path, tags or {})

    def register_wrong_checksum(self, folder: Path) -> ModelVersion:
        mv = self.register(folder)
        self.client.set_model_version_tag(self.name, mv.version, f"{SHA_TAG}model.safetensors", "0" * 64)
        return self.client.get_model_version(self.name, mv.version)

    def champion(self, mv: ModelVersion) -> None:
        self.client.set_registered_model_alias(self.name, "champion", mv.version)

    def tags(self, mv: ModelVersion) -> dict[str, str]:
        return dict(self.client.get_model_version(self.name, mv.version).tags)

    def alias(self, alias: str) -> str | None:
        try:
            return str(self.client.get_model_version_by_alias(self.name, alias).version)
        except Exception:
            return None


def read_held_out(gate: Gate, workload: str, requests: int) -> None:
    """Drain until the gate holds all `requests` served held-out requests. A new consumer waits for
    its partitions on a busy broker, and until then the gate only waits for records: a test about
    what follows must not take that wait for its answer."""
    for _ in range(30):
        if len(gate._held_out(workload).examples) >= requests:
            return
    pytest.fail(f"the gate never read the {requests} held-out requests of {workload}")
