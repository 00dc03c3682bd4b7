"""The engine's thread: runs `engine.step()` while there is work and hands each request its text.

Request handlers live on the asyncio loop; the engine runs in one thread of its own. A handler
submits a sequence and awaits `Delta`s on an asyncio queue that this thread feeds thread-safely.
Text is computed here, from the sequence's detokenizer, so handlers never touch engine state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass

from tide.serving.engine import Engine
from tide.serving.metrics import ServingMetrics
from tide.serving.sampling import SamplingParams
from tide.serving.sequence import Sequence

log = logging.getLogger("tide.serving")


class QueueFull(Exception):
    """More requests waiting than the queue allows: the caller answers 429."""


@dataclass
class Delta:
    text: str  # new text, safe to show (whole characters, no text a stop string may claim)
    completion_tokens: int  # tokens generated so far
    done: bool


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    sent: int = 0  # characters of seq.text already handed out


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServingMetrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.waiters: dict[str, _Waiter] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        workload: str,
        capture: bool,
        request_id: str | None = None,
        held_out: bool | None = None,
    ) -> tuple[Sequence, asyncio.Queue[Delta]]:
        """Queue a request (ValueError: it cannot be served; QueueFull: try again later)."""
        slots = self.engine.cfg.max_batch
        if len(self.waiters) >= slots + self.max_queue:  # every slot taken and the queue full
            raise QueueFull(f"all {slots} slots and {self.max_queue} queue places are taken")
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        rid = request_id or uuid.uuid4().hex[:24]
        self.waiters[rid] = _Waiter(asyncio.get_running_loop(), queue)
        try:
            seq = self.engine.add(prompt, params, rid, workload, capture, detokenize=True, held_out=held_out)
        except Exception:
            self.waiters.pop(rid, None)
            raise
        self.wake.set()
        return seq, queue

    def cancel(self, seq: Sequence) -> None:
        """The client went away: the sequence leaves its slot at the next step."""
        if not seq.finished:
            self.engine.abort(seq)
            self.metrics.aborted.inc()
        self.waiters.pop(seq.request_id, None)
        self.wake.set()

    def _run(self) -> None:
        while not self.stopped:
            if not self.engine.has_work:
                self.engine.swap_pending_drafts()  # an idle node shows its new draft right away
                self.engine.refresh_costs()
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # the engine fails a request alone; this is the last resort for a bug
                log.exception("engine step failed; failing the requests in flight")
                self._fail_running()
                continue
            try:
                self.metrics.observe_step(outputs)
            except Exception:
                log.exception("step metrics failed")
            for out in outputs:
                try:
                    self._deliver(out.seq)
                except Exception:  # its handler would wait forever: end it with an error
                    log.exception("could not deliver to request %s", out.seq.request_id)
                    self._deliver_error(out.seq)
            self.engine.refresh_costs(idle=False)  # after delivering: this step's tokens do not wait

    def _deliver_error(self, seq: Sequence) -> None:
        w = self.waiters.pop(seq.request_id, None)
        seq.finish_reason = "error"  # a running one leaves its slot at the next step
        if w is not None:
            with contextlib.suppress(RuntimeError):
                w.loop.call_soon_threadsafe(w.queue.put_nowait, Delta("", len(seq.output), True))

    def _deliver(self, seq: Sequence) -> None:
        w = self.waiters.get(seq.request_id)
        if w is None:
            return
        visible = seq.streamable_text
        delta = Delta(visible[w.sent :], len(seq.output), seq.finished)
        w.sent = max(w.sent, len(visible))
        if seq.finished:
            self.waiters.pop(seq.request_id, None)
        with contextlib.suppress(RuntimeError):  # the handler's event loop is gone (shutting down)
            w.loop.call_soon_threadsafe(w.queue.put_nowait, delta)

    def _fail_running(self) -> None:
        for seq in list(self.engine.running):
            seq.finish_reason = "error"  # the next step drops them from their slots
            self._deliver(seq)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)
