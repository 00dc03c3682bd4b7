"""The tap inside vLLM's worker: each step's hidden states cut into `TapEvent`s.

`worker.TideWorker.tide_attach_tap` wraps the model runner's `propose_draft_token_ids`: the one call
that receives, every step, the target's final normed states and its EAGLE-3 aux states for all
scheduled tokens together with the tokens verification kept (its signature is one of the two vLLM
internals this adapter relies on). `VllmTap` cuts them as TIDE's engine does (positions whose next token the
request kept, cut where vLLM's scheduler will stop it) and hands them to the same `RecordPublisher`,
under the same capture rules (`CapturePolicy`). The tap needs EAGLE-3 running: vLLM computes aux
states only for its drafter. Stop strings are applied by vLLM's front end after the worker has seen
the tokens, so records of a request stopped by one carry a few tokens past where its text was cut.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from tide.producers.tap import TapCallback, TapEvent
from tide.serving.capture import DEFAULT_WORKLOAD, CaptureDecision, CapturePolicy

log = logging.getLogger("tide.serving.vllm")


class VllmTap:
    """Cuts each step of vLLM's model runner into `TapEvent`s, as TIDE's engine emits them."""

    def __init__(self, runner: Any, sink: TapCallback, policy: CapturePolicy):
        self.runner, self.sink, self.policy = runner, sink, policy
        self.node = uuid.uuid4().hex[:8]  # vLLM's request ids repeat across processes
        self.decisions: dict[str, tuple[CaptureDecision, str]] = {}  # by request: capture?, its workload
        self.outputs: dict[str, int] = {}  # completion tokens tapped so far, by request
        self.events = self.failures = 0

    def step(self, scheduled: Any, sampled: torch.Tensor | list[list[int]], hidden: torch.Tensor,
             aux: list[torch.Tensor]) -> None:  # fmt: skip
        for rid in scheduled.finished_req_ids:
            self.decisions.pop(rid, None)
            self.outputs.pop(rid, None)
        n = scheduled.total_num_scheduled_tokens
        ids = self.runner.input_ids.gpu[:n].to("cpu", torch.long)
        positions = self.runner.positions[:n].to("cpu")
        rows = sampled.tolist() if isinstance(sampled, torch.Tensor) else sampled
        start = 0
        for i, rid in enumerate(self.runner.input_batch.req_ids):
            count = scheduled.num_scheduled_tokens[rid]
            seg = slice(start, start + count)
            start += count
            try:
                self._emit(
                    rid, ids[seg], int(positions[seg.start]), [a[seg] for a in aux], hidden[seg], rows[i]
                )
            except Exception:  # capture is a side job: the request is served on, no longer captured
                log.exception("capture of vLLM request %s failed; it goes on uncaptured", rid)
                self.decisions[rid] = (CaptureDecision(False), DEFAULT_WORKLOAD)
                self.failures += 1

    def _emit(self, rid: str, ids: torch.Tensor, first: int, aux: list[torch.Tensor], hidden: torch.Tensor,
              sampled: list[int]) -> None:  # fmt: skip
        state = self.runner.requests[rid]
        prompt, params = state.prompt_token_ids, state.sampling_params
        extra = params.extra_args or {}
        if rid not in self.decisions:
            workload = self.policy.workloads.resolve(str(extra.get("tide_workload", DEFAULT_WORKLOAD)))
            opted_out = extra.get("tide_capture") == "off"
            self.decisions[rid] = (self.policy.decide(workload, opted_out, self._id(rid), prompt), workload)
        decision, workload = self.decisions[rid]
        if not decision.capture:
            return
        prefill = first < len(prompt)
        # in a prompt chunk each position is followed by the next prompt token, or the first sampled;
        # in a decode step the last committed token is followed by what verification kept
        inputs = ids if prefill else ids[:1]
        end = first + len(ids)
        if prefill and end < len(prompt):
            kept, final = prompt[end : end + 1], False
        else:
            kept, final = self._kept(rid, sampled, params)
        m = len(inputs) - 1 + len(kept)
        if m == 0:
            return
        tokens = torch.cat([inputs, torch.tensor(kept, dtype=torch.long)])
        # copies: vLLM writes its output buffers again next step
        states = torch.cat([a[:m] for a in aux], -1)
        event = TapEvent(self._id(rid), workload, first, tokens, states, hidden[:m].clone(), prefill, "vllm",
                         final, decision.held_out)  # fmt: skip
        self.sink(event)
        self.events += 1

    def _kept(self, rid: str, sampled: list[int], params: Any) -> tuple[list[int], bool]:
        """The sampled tokens the request keeps, cut as vLLM's scheduler stops it (`check_stop`), and
        whether it stopped."""
        done = self.outputs.get(rid, 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 30
        kept: list[int] = []
        for t in sampled:
            if t < 0:  # rejected draft positions
                break
            kept.append(t)
            done += 1
            if t == params.eos_token_id or t in (params.stop_token_ids or ()) or done >= max_tokens:
                self.outputs[rid] = done
                return kept, True
        self.outputs[rid] = done
        return kept, False

    def _id(self, rid: str) -> str:
        return f"vllm-{self.node}-{rid}"
