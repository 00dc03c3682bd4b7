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
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from tide.names import EXPERIMENT, model_name

log = logging.getLogger("tide.registry")

CHAMPION = "champion"
PREVIOUS = "previous"
SHA_TAG = "sha256."  # + relative file name
PROFILE_TAG = "serving.profile"  # a serving node's measured step times (JSON), read by the gate
CACHE_KEEP = 4  # downloaded versions kept per model (the champion, previous, a candidate or two)


class ArtifactRefused(RuntimeError):
    """A version's files cannot be used: `reason` is a short label for counters and tags."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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


def download_version(client: MlflowClient, mv: ModelVersion, root: Path, keep: int = CACHE_KEEP) -> Path:
    """A version's draft folder under `root`, downloaded once and checked against its sha256 tags.

    Every file of the folder must have a tag and every tag its file, with the same digest: anything
    else is deleted and refused (ArtifactRefused "checksum"; a file without a tag "unverified", as is a
    version without any). A cached copy that fails is downloaded again once, so a damaged cache does not
    refuse a good version. Download failures raise as they are: the caller tells an unreachable store
    from a bad artifact. The model's cache keeps the `keep` versions used last.
    """
    expected = {k[len(SHA_TAG) :]: v for k, v in (mv.tags or {}).items() if k.startswith(SHA_TAG)}
    if not expected:
        raise ArtifactRefused("unverified", f"{mv.name} version {mv.version} has no sha256 tags")
    out = root / mv.name / str(mv.version)
    artifact = _artifact_path(mv.source or "")
    local = out / Path(artifact).name  # where MLflow puts a downloaded folder
    cached = (local / "config.json").exists()
    if not cached:
        _download(client, mv, artifact, out, local)
    try:
        _verify(mv, expected, local)
    except ArtifactRefused:
        shutil.rmtree(out, ignore_errors=True)
        if not cached:
            raise
        _download(client, mv, artifact, out, local)
        try:
            _verify(mv, expected, local)
        except ArtifactRefused:
            shutil.rmtree(out, ignore_errors=True)
            raise
    os.utime(out)  # last used: what the cache's retention goes by
    prune_cache(out.parent, keep)
    return local


def _download(client: MlflowClient, mv: ModelVersion, artifact: str, out: Path, local: Path) -> None:
    # several processes may share the cache: each downloads into its own folder, the first
    # rename wins, and whichever copy stays is checked after
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


def _verify(mv: ModelVersion, expected: dict[str, str], local: Path) -> None:
    """The folder holds exactly the tagged files, each with its digest: a config, a weight file or an
    export that no tag covers could be anything."""
    actual = file_hashes(local)
    untagged = sorted(actual.keys() - expected.keys())
    if untagged:
        raise ArtifactRefused(
            "unverified", f"{mv.name} version {mv.version}: no sha256 tag for {', '.join(untagged)}"
        )
    wrong = sorted(f for f, digest in expected.items() if actual.get(f) != digest)
    if wrong:
        raise ArtifactRefused(
            "checksum", f"{mv.name} version {mv.version}: sha256 mismatch for {', '.join(wrong)}"
        )


def prune_cache(folder: Path, keep: int) -> None:
    """Keep the `keep` versions of a model used last (each use touches its folder); downloads left
    behind by a killed process go once they are an hour old."""
    if not folder.is_dir():
        return
    versions, stale = [], time.time() - 3600
    for p in folder.iterdir():
        try:
            if p.name.startswith("."):
                if p.stat().st_mtime < stale:
                    shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir():
                versions.append((p.stat().st_mtime, p))
        except FileNotFoundError:  # another process pruned it first
            continue
    for _, p in sorted(versions, reverse=True)[max(keep, 1) :]:
        shutil.rmtree(p, ignore_errors=True)


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
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp else client.create_experiment(EXPERIMENT)
    run = client.create_run(exp_id, run_name=f"registered-{workload}", tags={"workload": workload})
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name, tags={"workload": workload, "target_fingerprint": fingerprint})
    mv = register_version(client, name, run.info.run_id, folder, "draft", tags or {})
    client.set_terminated(run.info.run_id)
    return mv


def ensure_champion(
    client: MlflowClient, fingerprint: str, workload: str, folder: Path, tags: dict[str, str]
) -> ModelVersion | None:
    """Register `folder` as the workload's first champion, unless it has one; the new version, or None."""
    if alias_version(client, model_name(fingerprint, workload), CHAMPION) is not None:
        return None
    mv = register_folder(client, fingerprint, workload, folder, tags)
    move_alias(client, mv.name, CHAMPION, None, str(mv.version))
    return mv


class AliasMoved(RuntimeError):
    """An alias no longer points where its mover read it: someone else acted in between."""


def move_alias(client: MlflowClient, name: str, alias: str, expected: str | None, to: str | None) -> None:
    """Point `alias` at version `to` (None: remove it), only if it still points at `expected` (None:
    nowhere), read again just before: a compare-and-set as far as MLflow allows (it has no
    conditional write; the window shrinks from a whole decision to one round trip)."""
    now = alias_version(client, name, alias)
    if (str(now.version) if now is not None else None) != expected:
        where = f"v{now.version}" if now is not None else "nowhere"
        raise AliasMoved(f"{name}: {alias} points at {where} now, not v{expected}: left as it is")
    if to is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, to)


def set_tags(client: MlflowClient, mv: ModelVersion, tags: Mapping[str, object]) -> None:
    for k, v in tags.items():
        client.set_model_version_tag(mv.name, mv.version, k, v if isinstance(v, str) else json.dumps(v))
