"""`tide up` revives what dies: a killed part or service starts again; a part that cannot start is given up on."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pytest

import tide.stack
from tide.infra.process import LocalService
from tide.stack import Stack, StackConfig, StackError


@dataclass
class Sleeper(LocalService):
    """A stand-in service: a process that runs until it is stopped."""

    data: Path

    @property
    def log_path(self) -> Path:
        return self.data / "sleeper.log"

    def start(self, timeout: float = 120) -> Self:
        self._launch(["sleep", "600"], None, timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        pass


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    monkeypatch.setattr(tide.stack, "_tide", lambda: "sleep")  # a part's command: `sleep ARGS`
    s = Stack(StackConfig(tmp_path))
    yield s
    s.stop()


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_killed_part_and_a_killed_service_start_again(stack: Stack) -> None:
    stack._spawn("trainer:code", "trainer", ["600"])
    service = Sleeper(data=stack.cfg.data_dir).start()
    stack.services.append(service)
    assert stack.revive() == []
    part = stack.parts[0]
    part.started -= 120  # it had been running for minutes
    _kill(part.proc)
    _kill(service.process)
    assert stack.revive() == ["Sleeper", "trainer:code"]
    (again,) = stack.parts
    assert again.proc.pid != part.proc.pid and again.proc.poll() is None
    assert again.args == ["600"] and again.role == "trainer" and again.crashes == 0
    assert service.running


def test_a_part_that_cannot_start_is_given_up_on(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tide.stack, "MAX_BACKOFF", 0.0)
    stack._spawn("gate", "serving", ["0"])  # exits at once, every time
    with pytest.raises(StackError, match="gate exited 5 times"):
        for _ in range(200):
            stack.revive()
            time.sleep(0.05)
    assert stack.parts[0].crashes == tide.stack.MAX_CRASHES - 1


def test_parts_that_wait_on_a_job_start_when_it_ends_well(stack: Stack) -> None:
    """`tide up` on a machine without a draft: the trainers start once the draft job has made one."""
    stack._spawn("draft", "trainer", ["0.3"], job=True, then=[("trainer:code", "trainer", ["600"])])
    assert stack.finish_jobs() == [] and stack.revive() == []  # still running: nothing waits less
    deadline = time.monotonic() + 30
    while not (started := stack.finish_jobs()):
        assert time.monotonic() < deadline, "the job did not end"
        assert stack.revive() == []  # a job that ended well is not started again
        time.sleep(0.1)
    assert started == ["trainer:code"]
    (trainer,) = stack.parts
    assert trainer.name == "trainer:code" and trainer.args == ["600"] and not trainer.job


def test_a_job_that_fails_runs_again_and_keeps_what_waits_on_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tide.stack, "MAX_BACKOFF", 0.0)
    stack._spawn("draft", "trainer", ["not-a-number"], job=True, then=[("trainer:code", "trainer", ["600"])])
    stack.parts[0].proc.wait()
    assert stack.finish_jobs() == [] and stack.revive() == ["draft"]
    (again,) = stack.parts
    assert again.job and again.then == [("trainer:code", "trainer", ["600"])] and again.crashes == 1


def test_stopping_parts_signals_them_all_at_once_and_kills_what_lingers(tmp_path: Path) -> None:
    from tide.infra.process import stop_groups

    def stubborn(name: str) -> subprocess.Popen[bytes]:  # notes SIGTERM and runs on, as a hung part would
        note = tmp_path / name
        script = f"trap 'date +%s.%N > {note}' TERM; while :; do sleep 1 & wait; done"
        return subprocess.Popen(["bash", "-c", script], start_new_session=True)

    first, second = stubborn("first"), stubborn("second")
    polite, gone = subprocess.Popen(["sleep", "600"], start_new_session=True), subprocess.Popen(["true"])
    gone.wait()
    time.sleep(0.5)  # the traps are set
    stop_groups([first, None, second, polite, gone], 5)
    assert polite.returncode == -signal.SIGTERM
    assert first.returncode == second.returncode == -signal.SIGKILL
    # one deadline for all: the second heard SIGTERM with the first, not after the first's 5 s ran out
    heard = [float((tmp_path / n).read_text()) for n in ("first", "second")]
    assert abs(heard[1] - heard[0]) < 2.5
    # the sleeps in their sessions went with them: killed, and gone once init has reaped them (an
    # orphan stays a zombie, still in its group, until then; seconds on some machines)
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(first.pid, 0)
            time.sleep(0.1)
