"""A real S3-compatible server (Versity S3 Gateway, posix backend) for tests and the local stack.

The binary is built once with `go install` from the Go module proxy (no Docker, no release download) into the TIDE
cache; buckets are folders under data_dir/objects and objects are plain files, so a restart keeps everything.

    python -m tide.infra.s3.server [--data DIR] [--port N] [--bucket NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tide.config import cache_dir
from tide.infra.process import LocalService, free_port, log_tail

MODULE = "github.com/versity/versitygw"
VERSION = "v1.8.0"
# symbols stripped (-s -w) to keep the binary small; the version shows in `versitygw --version`
LDFLAGS = f"-s -w -X main.Version={VERSION}"


class S3Error(RuntimeError):
    """The S3 server could not be built, started or reached; the message ends with the relevant output."""


def versitygw_binary() -> Path:
    """The versitygw binary, built once per version into the TIDE cache (outside the repo)."""
    root = cache_dir() / "versitygw"
    dest = root / VERSION / "versitygw"
    if dest.is_file():  # only ever created by the rename below, so it is complete
        return dest
    go = shutil.which("go")
    if go is None:
        raise S3Error(
            f"`go` is not on PATH: install Go 1.25+ to build versitygw {VERSION} from the module proxy"
        )
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=root))
    log = root / f"build-{VERSION}.log"
    print(f"building versitygw {VERSION} with `go install` (about a minute, once); log: {log}",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        cmd = [go, "install", "-ldflags", LDFLAGS, f"{MODULE}/cmd/versitygw@{VERSION}"]
        with log.open("wb") as out:
            try:
                # cwd outside any module, so `go install pkg@version` ignores a go.mod around the caller
                res = subprocess.run(cmd, cwd=work, env={**os.environ, "GOBIN": str(work)},
                                     stdout=out, stderr=subprocess.STDOUT, timeout=1800)  # fmt: skip
            except subprocess.TimeoutExpired:
                raise S3Error(f"`go install` of versitygw timed out:\n{log_tail(log)}") from None
        built = work / "versitygw"
        if res.returncode != 0 or not built.is_file():
            raise S3Error(
                f"`go install` of versitygw failed (rc={res.returncode}, log {log}):\n{log_tail(log)}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(built, dest)  # atomic; a concurrent builder's identical binary may win, which is fine
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _xattrs_supported(path: Path) -> bool:
    """The posix backend keeps ETags and content types in user xattrs; without them it needs a sidecar dir."""
    try:
        os.setxattr(path, "user.tide-probe", b"1")
        os.removexattr(path, "user.tide-probe")
        return True
    except (AttributeError, OSError):  # AttributeError: no xattr calls on this OS
        return False


def _random_key() -> str:
    return secrets.token_hex(20)  # hex: safe in env files, URLs and command lines


@dataclass
class S3Server(LocalService):
    """One versitygw process serving the folders under data_dir/objects as buckets, with one root account
    (random keys unless given) and, with `users`, accounts of its own (`add_user`, kept in data_dir/iam).

    A port left as None is picked at start and then kept, so `restart()` comes back where clients expect it.
    """

    data_dir: Path
    port: int | None = None
    host: str = "127.0.0.1"
    access_key: str = field(default_factory=_random_key)
    secret_key: str = field(default_factory=_random_key, repr=False)
    region: str = "us-east-1"
    users: bool = False  # versitygw's internal IAM: per-role accounts besides root

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise S3Error("the S3 server has no port yet: call start() first")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What boto3 clients (MLflow's artifact store among them) need in their environment to reach this server."""
        return self.env_for(self.access_key, self.secret_key)

    def env_for(self, access_key: str, secret_key: str) -> dict[str, str]:
        """`env` for another account of this server (one made by `add_user`)."""
        return {
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    @property
    def log_path(self) -> Path:
        return self.data_dir / "s3.log"

    @property
    def objects_dir(self) -> Path:
        return self.data_dir / "objects"

    def command(self, binary: Path) -> list[str]:
        """The command line (the root keys travel in the environment, out of `ps`)."""
        meta: list[str] = []
        if not _xattrs_supported(self.objects_dir):  # the sidecar must live outside the gateway's root
            (self.data_dir / "meta").mkdir(exist_ok=True)
            meta = ["--sidecar", str(self.data_dir / "meta")]
        iam = ["--iam-dir", str(self.data_dir / "iam")] if self.users else []
        return [str(binary), "--port", f"{self.host}:{self.port}", "--region", self.region, "--quiet", *iam,
                "posix", *meta, str(self.objects_dir)]  # fmt: skip

    def start(self, timeout: float = 30) -> S3Server:
        if self.running:
            return self
        self.stop()  # a server that died on its own: reap it and close its log
        binary = versitygw_binary()
        self.data_dir = Path(self.data_dir).resolve()
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        if self.users:
            (self.data_dir / "iam").mkdir(mode=0o700, exist_ok=True)  # the accounts' secrets, in clear
        self.port = self.port or free_port()
        # the caller's VGW_* settings (an IAM dir, TLS, ...) would change what this server is
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGW_")}
        env |= {"ROOT_ACCESS_KEY_ID": self.access_key, "ROOT_SECRET_ACCESS_KEY": self.secret_key}
        self._launch(self.command(binary), env, timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1})
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise S3Error(f"versitygw exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                client.list_buckets()  # signed with our keys: proves the listener and the credentials
                return
            except (BotoCoreError, ClientError) as e:
                last = e
            if time.monotonic() > deadline:
                raise S3Error(f"versitygw did not answer within {timeout:.0f} s ({last}):\n{self.log_tail()}")
            time.sleep(0.1)

    def client(self, access_key: str | None = None, secret_key: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client for this server as root, or as the account given (path-style addressing;
        `config` goes to botocore's Config)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def add_user(self, access_key: str, secret_key: str, role: str = "user") -> None:
        """Create an account (versitygw's admin API, signed as root; the keys travel in the body, out of
        `ps`). A `user` sees only the buckets it owns or that a bucket policy opens to it."""
        import httpx
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        if not self.users:
            raise S3Error("add_user needs a server started with users=True")
        account = {
            "Access": access_key,
            "Secret": secret_key,
            "Role": role,
        }  # keys are hex: nothing to escape
        body = ("<Account>" + "".join(f"<{k}>{v}</{k}>" for k, v in account.items()) + "</Account>").encode()
        req = AWSRequest("PATCH", f"{self.endpoint_url}/create-user", data=body)
        S3SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", self.region).add_auth(req)
        res = httpx.request("PATCH", req.url, content=body, headers=dict(req.headers.items()), timeout=10)
        if res.status_code >= 400 and "already exists" not in res.text.lower():
            raise S3Error(f"create-user {access_key}: {res.status_code} {res.text}")

    def grant(self, bucket: str, readers: list[str], writers: list[str]) -> None:
        """The bucket's policy: `readers` may list and read its objects, `writers` also write and delete them."""
        read = ["s3:ListBucket", "s3:GetObject"]
        write = [*read, "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                 "s3:ListMultipartUploadParts"]  # fmt: skip
        resources = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
        statements = [{"Effect": "Allow", "Principal": {"AWS": keys}, "Action": actions, "Resource": resources}
                      for keys, actions in ((readers, read), (writers, write)) if keys]  # fmt: skip
        policy = {"Version": "2012-10-17", "Statement": statements}
        self.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))

    def ensure_bucket(self, name: str) -> None:
        from botocore.exceptions import ClientError

        client = self.client()
        try:
            client.head_bucket(Bucket=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise
            client.create_bucket(Bucket=name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tide.infra.s3.server", description="Run a local S3 server (versitygw) until Ctrl-C."
    )
    parser.add_argument("--data", type=Path, default=cache_dir() / "s3", help="data dir, kept")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: a free one)")
    parser.add_argument("--host", default=S3Server.host, help="listen address")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = parser.parse_args(argv)
    # a supervisor's SIGTERM must unwind through stop(): the server is in its own process group and would outlive us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = S3Server(args.data, args.port, args.host)
    try:
        with server:
            for bucket in args.bucket:
                server.ensure_bucket(bucket)
            print(
                f"S3 endpoint: {server.endpoint_url} data={server.data_dir} log={server.log_path}", flush=True
            )
            for k, v in server.env.items():
                print(f"  export {k}={v}", flush=True)
            while server.running:
                time.sleep(1)
            raise SystemExit(f"error: versitygw exited:\n{server.log_tail()}")
    except KeyboardInterrupt:
        print("stopping", flush=True)
    except S3Error as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
