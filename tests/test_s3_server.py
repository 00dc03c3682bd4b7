"""The real S3 server (versitygw): objects in and out with boto3, kept across a restart, and MLflow artifacts in it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tide.infra.mlflow.server import MlflowServer
from tide.infra.s3.server import S3Server

BUCKET = "tide-test"


@pytest.fixture(autouse=True)
def _bucket(s3: S3Server) -> None:
    s3.ensure_bucket(BUCKET)


def test_put_get(s3: S3Server) -> None:
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="a/b/hello.txt", Body=b"hello")
    assert client.get_object(Bucket=BUCKET, Key="a/b/hello.txt")["Body"].read() == b"hello"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="a/")["Contents"]]
    assert keys == ["a/b/hello.txt"]
    assert BUCKET in [b["Name"] for b in client.list_buckets()["Buckets"]]
    s3.ensure_bucket(BUCKET)  # idempotent


def test_restart_keeps_port_and_objects(s3: S3Server) -> None:
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="kept.bin", Body=bytes(range(256)) * 1000)
    url, pid = s3.endpoint_url, s3.process.pid if s3.process else None
    s3.restart()
    assert s3.endpoint_url == url and s3.process is not None and s3.process.pid != pid
    # a client made before the restart keeps working: same endpoint, same keys
    assert client.get_object(Bucket=BUCKET, Key="kept.bin")["Body"].read() == bytes(range(256)) * 1000


def test_mlflow_artifacts_in_s3(registry: MlflowServer, s3: S3Server, tmp_path: Path) -> None:
    """The session's registry keeps run artifacts in the S3 server, where clients put and get them
    themselves (a registry that goes away and comes back: test_registry_serving)."""
    from mlflow.tracking import MlflowClient

    src = tmp_path / "draft"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"layers": 1}')
    (src / "sub" / "weights.bin").write_bytes(b"\x00\x01" * 5000)
    client = MlflowClient(registry.url)
    run = client.create_run(client.create_experiment(f"s3-artifacts-{uuid.uuid4().hex[:6]}"))
    assert run.info.artifact_uri.startswith(f"s3://{registry.bucket}/mlflow/")
    client.log_artifacts(run.info.run_id, str(src), "draft")
    client.set_terminated(run.info.run_id)

    prefix = run.info.artifact_uri.removeprefix(f"s3://{registry.bucket}/")
    listed = s3.client().list_objects_v2(Bucket=registry.bucket, Prefix=f"{prefix}/")
    keys = sorted(o["Key"] for o in listed["Contents"])
    assert keys == [f"{prefix}/draft/config.json", f"{prefix}/draft/sub/weights.bin"]
    dst = Path(client.download_artifacts(run.info.run_id, "draft", str(tmp_path / "back")))
    assert (dst / "config.json").read_text() == '{"layers": 1}'
    assert (dst / "sub" / "weights.bin").read_bytes() == b"\x00\x01" * 5000
