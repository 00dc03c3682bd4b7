"""A local MLflow tracking server: sqlite metadata, artifacts in a folder (or S3), job workers off.

MLflow's server starts about ten job-worker processes (~240 MB each) unless
`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`; on a machine shared with the engine, a broker and a
trainer they are the difference between fitting and swapping.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tide.infra.process import LocalService, free_port, wait_http_ok
from tide.infra.s3.server import S3Server


class MlflowServerError(RuntimeError):
    pass


@dataclass
class MlflowServer(LocalService):
    data_dir: Path
    port: int | None = None
    host: str = "127.0.0.1"
    artifacts: str | None = None  # local mode: where the server keeps artifacts; default: data_dir/artifacts
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the server
    s3: S3Server | None = None  # S3 mode: artifacts in s3://<bucket>/mlflow, reached by clients directly
    bucket: str = "tide-drafts"

    @property
    def url(self) -> str:
        if self.port is None:
            raise MlflowServerError("the server has no port yet: call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "mlflow.log"

    @property
    def artifact_root(self) -> str:
        if self.s3 is not None:
            return f"s3://{self.bucket}/mlflow"
        return self.artifacts or str(self.data_dir / "artifacts")

    def start(self, timeout: float = 120) -> MlflowServer:
        if self.running:
            return self
        self.stop()  # a server that died on its own: reap it and close its log
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        args = [sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri", f"sqlite:///{self.data_dir / 'mlflow.db'}",
                "--host", self.host, "--port", str(self.port), "--workers", "1"]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        if self.s3 is not None:
            if not self.s3.running:
                raise MlflowServerError("S3 mode: start the S3 server before the MLflow server")
            self.s3.ensure_bucket(self.bucket)
            # runs get s3:// artifact URIs: clients read and write the bucket themselves, with S3Server.env
            args += ["--default-artifact-root", self.artifact_root, "--no-serve-artifacts"]
            env |= self.s3.env
        else:
            args += ["--artifacts-destination", self.artifact_root]
        env |= self.env
        self._launch(args, env, timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        wait_http_ok(
            f"{self.url}/health", self.process, timeout, "mlflow server", self.log_tail, MlflowServerError
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a local MLflow tracking server, in the foreground")
    parser.add_argument("--data", type=Path, default=Path.home() / ".cache" / "tide" / "mlflow")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--host", default=MlflowServer.host, help="listen address (0.0.0.0: every interface)")
    parser.add_argument(
        "--s3", action="store_true", help="artifacts in a local S3 server (versitygw) in DATA/s3"
    )
    parser.add_argument("--bucket", default=MlflowServer.bucket, help="the S3 mode's bucket")
    args = parser.parse_args(argv)
    # a supervisor's SIGTERM must unwind through stop(): the servers are in their own process groups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    s3 = S3Server(args.data / "s3").start() if args.s3 else None
    server: MlflowServer | None = None
    try:
        server = MlflowServer(args.data, args.port, args.host, s3=s3, bucket=args.bucket).start()
        print(f"MLflow UI: {server.url}", flush=True)
        if s3 is not None:
            print(f"artifacts: {server.artifact_root} on {s3.endpoint_url}; clients need:", flush=True)
            for k, v in s3.env.items():
                print(f"  export {k}={v}", flush=True)
        while server.running:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()
        if s3 is not None:
            s3.stop()


if __name__ == "__main__":
    main()
