"""What the local services (Kafka broker, MLflow server) share: a free port, a log tail, a clean stop."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path


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


def stop_group(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM the process's session (a clean shutdown flushes logs and metadata), SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()
