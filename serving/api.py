"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn).

The engine runs in one background thread (`EngineLoop`); request handlers enqueue sequences and
await their tokens through asyncio queues fed thread-safely from the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from tide.config import default_draft_dir
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target, load_target
from tide.serving.engine import Engine, EngineConfig, Sequence
from tide.serving.sampling import SamplingParams

log = logging.getLogger("tide.serving")
MODEL_ID = "tide"


class ChatMessage(BaseModel):
    role: str
    content: str


class _Common(BaseModel):
    model: str = MODEL_ID
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1


class ChatRequest(_Common):
    messages: list[ChatMessage]


class CompletionRequest(_Common):
    prompt: str


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[list[int], bool]]


class EngineLoop:
    """Runs engine.step() in a thread while there is work; hands tokens to waiting requests."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.waiters: dict[str, _Waiter] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def submit(
        self, prompt: list[int], params: SamplingParams
    ) -> tuple[Sequence, asyncio.Queue[tuple[list[int], bool]]]:
        queue: asyncio.Queue[tuple[list[int], bool]] = asyncio.Queue()
        rid = f"req-{uuid.uuid4().hex[:16]}"
        self.waiters[rid] = _Waiter(asyncio.get_running_loop(), queue)
        try:
            seq = self.engine.add(prompt, params, request_id=rid)
        except Exception:
            self.waiters.pop(rid, None)
            raise
        self.wake.set()
        return seq, queue

    def _run(self) -> None:
        while not self.stopped:
            if not self.engine.has_work:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                for seq in list(self.engine.running):
                    self.engine.abort(seq)
                continue
            for out in outs:
                w = self.waiters.get(out.seq.request_id)
                if w is None:
                    continue
                w.loop.call_soon_threadsafe(w.queue.put_nowait, (out.new_tokens, out.seq.finished))
                if out.seq.finished:
                    self.waiters.pop(out.seq.request_id, None)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
    )


def build_app(model: str | None, draft: str | None, dtype: torch.dtype, cfg: EngineConfig) -> FastAPI:
    target = load_target(model, dtype)
    draft_dir = Path(draft) if draft else default_draft_dir(target.fingerprint)
    head = None
    if cfg.gamma > 0 and (draft or (draft_dir / "model.safetensors").exists()):
        head = Eagle3Draft.load(
            draft_dir, target.model.embed_tokens, target.config, target.fingerprint, dtype
        )
        log.info("draft %s loaded from %s", head.cfg.version, draft_dir)
    else:
        log.warning("no draft: serving without speculation (train one with `tide draft ensure-default`)")
    return make_app(target, Engine(target, head, cfg))


def make_app(target: Target, engine: Engine) -> FastAPI:
    loop = EngineLoop(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        loop.stop()

    app = FastAPI(title="TIDE", lifespan=lifespan)
    app.state.engine_loop = loop
    tok = target.tok

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "draft": engine.draft_version,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": MODEL_ID, "object": "model", "owned_by": "tide", "fingerprint": target.fingerprint}
            ],
        }

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        try:
            req: ChatRequest | CompletionRequest = (
                ChatRequest if chat else CompletionRequest
            ).model_validate(body)
        except ValidationError as e:
            return _error(400, f"invalid request: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}")
        if req.model != MODEL_ID:
            return _error(
                404,
                f"model {req.model!r} does not exist; this server serves {MODEL_ID!r}",
                "not_found_error",
                "model",
            )
        if req.n != 1:
            return _error(400, "only n=1 is supported", param="n")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if isinstance(req, ChatRequest):
            prompt = tok.chat_prompt([m.model_dump() for m in req.messages])
        else:
            prompt = tok.encode(req.prompt)
        max_tokens = (
            req.max_tokens
            if req.max_tokens is not None
            else max(1, min(512, engine.cfg.max_model_len - len(prompt)))
        )
        params = SamplingParams(req.temperature, req.top_p, req.top_k, req.seed, max_tokens, stop)
        try:
            seq, queue = loop.submit(prompt, params)
        except ValueError as e:
            return _error(400, str(e))
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + seq.request_id
        if req.stream:
            return StreamingResponse(
                _stream(request, seq, queue, rid, created, chat), media_type="text/event-stream"
            )
        try:
            while True:
                _, done = await queue.get()
                if done:
                    break
        except asyncio.CancelledError:
            engine.abort(seq)
            raise
        text = _final_text(seq)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(seq.output),
            "total_tokens": len(prompt) + len(seq.output),
        }
        reason = "length" if seq.finish_reason == "length" else "stop"
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
            }
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": MODEL_ID,
                "choices": [choice],
                "usage": usage,
            }
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": MODEL_ID,
            "choices": [choice],
            "usage": usage,
        }

    def _final_text(seq: Sequence) -> str:
        return (
            seq.stop_text
            if seq.params.stop and seq.finish_reason == "stop" and seq.stop_text
            else tok.decode(seq.output)
        )

    async def _stream(
        request: Request,
        seq: Sequence,
        queue: asyncio.Queue[tuple[list[int], bool]],
        rid: str,
        created: int,
        chat: bool,
    ) -> AsyncIterator[str]:
        sent = ""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str, reason: str | None) -> str:
            if chat:
                c: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": delta} if delta else {},
                    "finish_reason": reason,
                }
            else:
                c = {"index": 0, "text": delta, "finish_reason": reason}
            return (
                "data: "
                + json.dumps(
                    {"id": rid, "object": obj, "created": created, "model": MODEL_ID, "choices": [c]}
                )
                + "\n\n"
            )

        try:
            if chat:
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": MODEL_ID,
                            "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
                        }
                    )
                    + "\n\n"
                )
            while True:
                _, done = await queue.get()
                text = _final_text(seq) if done else tok.decode(seq.output)
                if not done:
                    # hold back an incomplete multi-byte character, and text a stop string may still claim
                    text = text.rstrip("\ufffd")
                    if seq.params.stop:
                        text = text[: max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)]
                if len(text) > len(sent) and text.startswith(sent):
                    yield chunk(text[len(sent) :], None)
                    sent = text
                if done:
                    yield chunk("", "length" if seq.finish_reason == "length" else "stop")
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not seq.finished:
                engine.abort(seq)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, False)

    return app
