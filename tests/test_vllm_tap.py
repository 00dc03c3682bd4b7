"""The vLLM tap's cutting of runner steps into tap events, against a stand-in for vLLM's model runner
(the boundary: the real one is exercised in test_vllm.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tide.producers.tap import TapEvent
from tide.serving.capture import CapturePolicy, parse_rules
from tide.serving.vllm_adapter.tap import VllmTap

D = 4
EOS = 2


class Runner:
    """What the tap reads of vLLM's model runner: the step's inputs, positions, batch order, requests."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.input_batch = SimpleNamespace(req_ids=[])
        self.input_ids = SimpleNamespace(gpu=torch.zeros(64, dtype=torch.int32))
        self.positions = torch.zeros(64, dtype=torch.int64)

    def add(self, rid: str, prompt: list[int], max_tokens: int, **extra: str) -> None:
        params = SimpleNamespace(max_tokens=max_tokens, eos_token_id=EOS, stop_token_ids=[], extra_args=extra)
        self.requests[rid] = SimpleNamespace(prompt_token_ids=prompt, sampling_params=params)


def step(tap: VllmTap, runner: Runner, rows: dict[str, tuple[list[int], int, list[int]]]) -> None:
    """One runner step: per request its scheduled tokens, the first one's position, and what was sampled."""
    ids: list[int] = []
    pos: list[int] = []
    sampled: list[list[int]] = []
    for tokens, first, out in rows.values():
        ids += tokens
        pos += range(first, first + len(tokens))
        sampled.append(out + [-1] * (4 - len(out)))
    n = len(ids)
    runner.input_ids.gpu[:n] = torch.tensor(ids)
    runner.positions[:n] = torch.tensor(pos)
    runner.input_batch.req_ids = list(rows)
    # each state holds its own position, so the test sees which positions an event carries
    states = torch.tensor(pos, dtype=torch.float32).unsqueeze(1).expand(n, D).clone()
    scheduled = SimpleNamespace(
        finished_req_ids=set(),
        total_num_scheduled_tokens=n,
        num_scheduled_tokens={r: len(v[0]) for r, v in rows.items()},
    )
    tap.step(scheduled, torch.tensor(sampled), states, [states, states, states])


def new_tap(capture: str = "*=on") -> tuple[VllmTap, Runner, list[TapEvent]]:
    runner, events = Runner(), list[TapEvent]()
    return VllmTap(runner, events.append, CapturePolicy(parse_rules(capture))), runner, events


def test_a_chunked_prompt_then_speculative_steps_cut_at_max_tokens() -> None:
    tap, runner, events = new_tap()
    runner.add("a", [10, 11, 12, 13, 14], max_tokens=4, tide_workload="code")
    step(tap, runner, {"a": ([10, 11, 12], 0, [99])})  # a prompt chunk: what it sampled is discarded
    step(tap, runner, {"a": ([13, 14], 3, [20])})  # the prompt's end: its first token
    step(tap, runner, {"a": ([20, 7, 8, 9], 5, [21, 22])})  # one draft accepted, then the bonus token
    step(tap, runner, {"a": ([22, 7, 8, 9], 7, [23, 24, 25])})  # max_tokens: only 23 is kept
    assert [e.tokens.tolist() for e in events] == [[10, 11, 12, 13], [13, 14, 20], [20, 21, 22], [22, 23]]
    assert [e.first_position for e in events] == [0, 3, 5, 7]
    assert [e.aux[:, 0].tolist() for e in events] == [[0, 1, 2], [3, 4], [5, 6], [7]]
    assert all(e.aux.shape[1] == 3 * D and e.hidden.shape[1] == D for e in events)
    assert [e.prefill for e in events] == [True, True, False, False]
    assert [e.final for e in events] == [False, False, False, True]
    assert {e.workload for e in events} == {"code"} and len({e.request_id for e in events}) == 1


def test_eos_ends_a_request_and_batches_are_cut_per_request() -> None:
    tap, runner, events = new_tap()
    runner.add("a", [10, 11], max_tokens=50)
    runner.add("b", [30, 31, 32], max_tokens=50)
    step(tap, runner, {"a": ([10, 11], 0, [20]), "b": ([30, 31, 32], 0, [40])})
    step(tap, runner, {"a": ([20, 5, 6, 7], 2, [21, EOS]), "b": ([40, 5, 6, 7], 3, [41])})
    by = {rid: [e for e in events if e.request_id.endswith(f"-{rid}")] for rid in "ab"}
    assert [e.tokens.tolist() for e in by["a"]] == [[10, 11, 20], [20, 21, EOS]]
    assert by["a"][-1].final and not by["b"][-1].final
    assert [e.aux[:, 0].tolist() for e in by["b"]] == [[0, 1, 2], [3]]


def test_opted_out_and_uncaptured_workloads_leave_nothing() -> None:
    tap, runner, events = new_tap("*=on,chat=off")
    runner.add("a", [10, 11], max_tokens=5, tide_capture="off")
    runner.add("b", [10, 11], max_tokens=5, tide_workload="chat")
    step(tap, runner, {"a": ([10, 11], 0, [20]), "b": ([10, 11], 0, [20])})
    assert events == [] and tap.events == 0


def test_a_failing_capture_leaves_the_request_served_uncaptured() -> None:
    def broken(ev: TapEvent) -> None:
        raise RuntimeError("the sink is gone")

    runner = Runner()
    tap = VllmTap(runner, broken, CapturePolicy())
    runner.add("a", [10, 11], max_tokens=5)
    step(tap, runner, {"a": ([10, 11], 0, [20])})  # does not raise
    step(tap, runner, {"a": ([20, 5, 6, 7], 2, [21])})
    assert tap.failures == 1  # and the request is not captured again
