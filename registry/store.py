"""The registry's contract, shared by trainers, the gate and serving nodes.

One registered model per (target fingerprint, workload), `tide-draft-<fp12>-<workload>`. The alias
`champion` is what serving runs and `previous` the champion before it. A version's tags carry the
sha256 of every file of its folder; the gate's and the serving nodes' evidence lands in tags too
(`gate.*`, `rollback.*`), so the MLflow UI shows why each version is where it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

log = logging.getLogger("tide.registry")

CHAMPION = "champion"
PREVIOUS = "previous"
SHA_TAG = "sha256."  # + relative file name
PROFILE_TAG = "serving.profile"  # a serving node's measured step times (JSON), read by the gate


class ArtifactRefused(RuntimeError):
    """A version's files cannot be used: `reason` is a short label for counters and tags."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def model_name(fingerprint: str, workload: str) -> str:
    return f"tide-draft-{fingerprint[:12]}-{workload}"


def model_prefix(fingerprint: str) -> str:
    return f"tide-draft-{fingerprint[:12]}-"


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _missing(e: MlflowException) -> bool:
    return e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def alias_version(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    """The version behind an alias; None when the model or the alias does not exist. Any other
    failure (registry unreachable) raises."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if _missing(e):
            return None
        raise


def _artifact_path(source: str) -> str:
    # "runs:/<run id>/<path>" -> "<path>"
    return source.split("/", 2)[2] if source.startswith("runs:/") else source


def download_version(client: MlflowClient, mv: ModelVersion, root: Path) -> Path:
    """A version's draft folder under `root`, downloaded once and checked against its sha256 tags.

    A folder whose files do not match their tags is deleted and refused (ArtifactRefused "checksum");
    a version without checksums is refused too ("unverified"). Download failures raise as they are:
    the caller tells an unreachable store from a bad artifact.
    """
    expected = {k[len(SHA_TAG) :]: v for k, v in (mv.tags or {}).items() if k.startswith(SHA_TAG)}
    if not expected:
        raise ArtifactRefused("unverified", f"{mv.name} version {mv.version} has no sha256 tags")
    out = root / mv.name / str(mv.version)
    artifact = _artifact_path(mv.source or "")
    local = out / Path(artifact).name  # where MLflow puts a downloaded folder
    if not (local / "config.json").exists():
        # several processes may share the cache: each downloads into its own folder, the first
        # rename wins, and whichever copy stays is checked below
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            client.download_artifacts(mv.run_id or "", artifact, str(tmp))
            if not (local / "config.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        except OSError:
            if not (local / "config.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    actual = file_hashes(local)
    wrong = sorted(f for f, digest in expected.items() if actual.get(f) != digest)
    if wrong:
        shutil.rmtree(out, ignore_errors=True)
        raise ArtifactRefused(
            "checksum", f"{mv.name} version {mv.version}: sha256 mismatch for {', '.join(wrong)}"
        )
    return local


def register_version(
    client: MlflowClient, name: str, run_id: str, folder: Path, artifact_path: str, tags: dict[str, str]
) -> ModelVersion:
    """Upload a draft folder to the run's artifacts and register it as a new version of `name`,
    with the sha256 of every file among its tags."""
    client.log_artifacts(run_id, str(folder), artifact_path)
    hashes = {f"{SHA_TAG}{f}": digest for f, digest in file_hashes(folder).items()}
    return client.create_model_version(
        name, f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags={**tags, **hashes}
    )


def register_folder(
    client: MlflowClient, fingerprint: str, workload: str, folder: Path, tags: dict[str, str] | None = None
) -> ModelVersion:
    """Register a draft folder by hand (an operator's bootstrap draft, a benchmark's starting point):
    its own run in experiment `tide-drafts`, the registered model created if missing."""
    name = model_name(fingerprint, workload)
    exp = client.get_experiment_by_name("tide-drafts")
    exp_id = exp.experiment_id if exp else client.create_experiment("tide-drafts")
    run = client.create_run(exp_id, run_name=f"registered-{workload}", tags={"workload": workload})
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name, tags={"workload": workload, "target_fingerprint": fingerprint})
    mv = register_version(client, name, run.info.run_id, folder, "draft", tags or {})
    client.set_terminated(run.info.run_id)
    return mv


def set_tags(client: MlflowClient, mv: ModelVersion, tags: dict[str, object]) -> None:
    for k, v in tags.items():
        client.set_model_version_tag(mv.name, mv.version, k, v if isinstance(v, str) else json.dumps(v))
