"""What the local services (Kafka broker, MLflow server, S3 server) share: a free port, a log tail,
a launch into their own session, a clean stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(text: str, lines: int = 40) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Maven colours its output even in batch mode
    return "\n".join(text.strip().splitlines()[-lines:])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return tail(path.read_text(errors="replace"), lines)
    except OSError:
        return f"(no log at {path})"


def wait_http_ok(
    url: str, proc: subprocess.Popen[bytes] | None, timeout: float, what: str, log: Callable[[], str],
    error: type[Exception] = RuntimeError,
) -> None:  # fmt: skip
    """Poll `url` until it answers 200; `error` with the log's tail if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise error(f"{what} exited:\n{log()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise error(f"{what} did not answer within {timeout:.0f} s:\n{log()}")


def stop_groups(procs: Sequence[subprocess.Popen[bytes] | None], timeout: float) -> None:
    """SIGTERM each process's session at once (a clean shutdown flushes logs and metadata), then
    SIGKILL those that linger past one shared deadline: stopping n parts takes `timeout`, not n times it."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already: its exit status is still to collect
        os.killpg(proc.pid, sig)


@dataclass
class LocalService:
    """A server process of ours, in its own session (Ctrl-C in a terminal reaches us, not it), logging
    to `log_path`. Subclasses build the command line in `start()` and say when it is ready."""

    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, kw_only=True)
    _log: IO[bytes] | None = field(default=None, repr=False, kw_only=True)

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 120) -> Self:
        raise NotImplementedError

    def _wait_ready(self, timeout: float) -> None:
        raise NotImplementedError

    def _launch(self, args: list[str], env: dict[str, str] | None, timeout: float) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout: float = 30) -> None:
        proc, self.process = self.process, None
        stop_groups([proc], timeout)  # the server and whatever it started
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout: float = 120) -> Self:
        """Stop and start again on the same ports and data."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
