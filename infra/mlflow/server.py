"""A local MLflow tracking server: sqlite metadata, artifacts in a folder (or S3), job workers off.

MLflow's server starts about ten job-worker processes (~240 MB each) unless
`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`; on a machine shared with the engine, a broker and a
trainer they are the difference between fitting and swapping.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from tide.infra.process import free_port, log_tail, stop_group


class MlflowServerError(RuntimeError):
    pass


@dataclass
class MlflowServer:
    data_dir: Path
    port: int | None = None
    host: str = "127.0.0.1"
    artifacts: str | None = None  # e.g. s3://bucket/mlflow; default: data_dir/artifacts
    env: dict[str, str] = field(default_factory=dict)  # e.g. MLFLOW_S3_ENDPOINT_URL and AWS keys
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        if self.port is None:
            raise MlflowServerError("the server has no port yet: call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "mlflow.log"

    def start(self, timeout: float = 120) -> MlflowServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        artifacts = self.artifacts or str(self.data_dir / "artifacts")
        args = [sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri", f"sqlite:///{self.data_dir / 'mlflow.db'}",
                "--artifacts-destination", artifacts,
                "--host", self.host, "--port", str(self.port), "--workers", "1"]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env}
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MlflowServerError(f"mlflow server exited:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise MlflowServerError(f"mlflow server did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout: float = 30) -> None:
        proc, self.process = self.process, None
        stop_group(proc, timeout)  # the server and its workers
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a local MLflow tracking server, in the foreground")
    parser.add_argument("--data", type=Path, default=Path.home() / ".cache" / "tide" / "mlflow")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(argv)
    server = MlflowServer(args.data, args.port).start()
    print(f"MLflow UI: {server.url}", flush=True)
    try:
        while server.process is not None and server.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
