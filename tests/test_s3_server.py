"""The real S3 server (versitygw): objects in and out with boto3, kept across a restart, and MLflow artifacts in it."""

from __future__ import annotations

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


def test_mlflow_artifacts_in_s3(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "draft"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"layers": 1}')
    (src / "sub" / "weights.bin").write_bytes(b"\x00\x01" * 5000)
    bucket = "tide-s3-test"  # its own bucket: the session's S3 server holds other tests' artifacts
    with MlflowServer(tmp_path / "mlflow", s3=s3, bucket=bucket) as server:
        client = MlflowClient(server.url)
        exp = client.create_experiment("s3-artifacts")
        run = client.create_run(exp)
        assert run.info.artifact_uri.startswith(f"s3://{bucket}/mlflow/")
        client.log_artifacts(run.info.run_id, str(src), "draft")
        client.set_terminated(run.info.run_id)

        listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="mlflow/")
        keys = sorted(o["Key"] for o in listed["Contents"])
        prefix = run.info.artifact_uri.removeprefix(f"s3://{bucket}/")
        assert keys == [f"{prefix}/draft/config.json", f"{prefix}/draft/sub/weights.bin"]

        # the registry goes away and comes back where clients expect it
        url = server.url
        server.restart()
        assert server.url == url
        dst = Path(client.download_artifacts(run.info.run_id, "draft", str(tmp_path / "back")))
        assert (dst / "config.json").read_text() == '{"layers": 1}'
        assert (dst / "sub" / "weights.bin").read_bytes() == b"\x00\x01" * 5000
