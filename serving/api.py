"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn).

`/v1/chat/completions` and `/v1/completions` (SSE streaming or not), `/v1/models`, `/health`,
`/metrics` (Prometheus) and the admin endpoints. A request's workload comes from the
`X-Tide-Workload` header; `X-Tide-Capture: off` keeps its hidden states out of capture. Nothing
here logs prompt or completion text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tide.models.loader import load_target
from tide.serving.admin import admin_router
from tide.serving.capture import CapturePolicy
from tide.serving.engine import Engine
from tide.serving.engine_loop import Delta, EngineLoop, QueueFull
from tide.serving.metrics import ServingMetrics
from tide.serving.node import NodeConfig, ServingNode, load_start_draft
from tide.serving.protocol import ChatRequest, CompletionRequest, describe, error_response
from tide.serving.sequence import Sequence

log = logging.getLogger("tide.serving")
MODEL_ID = "tide"


@dataclass
class ServerConfig:
    admin_token: str | None = None  # None: admin endpoints off
    max_queue: int = 64  # requests waiting for a slot; more get 429
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 512
    capture: CapturePolicy = field(default_factory=CapturePolicy)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def build_app(
    model: str | None,
    draft: str | None,
    dtype: torch.dtype,
    node: NodeConfig,
    server: ServerConfig,
    weights: str = "auto",
    compile: bool = True,
) -> FastAPI:
    """The server as `tide serve` runs it: it answers as soon as the model is loaded, and compiles
    its layers meanwhile."""
    target = load_target(model, dtype, weights=weights)
    if compile:
        target.compile_in_background()
    start = load_start_draft(target, draft, dtype) if node.engine.gamma > 0 or node.adaptive else None
    return make_app(ServingNode.build(target, start, node), server)


async def _read_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BadRequest(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _BadRequest(413, f"request body exceeds the limit of {limit} bytes")
    try:
        # NaN and Infinity are not JSON; deep nesting (RecursionError) and ints of more digits than
        # Python converts (ValueError) are refused like any other malformed body
        parsed = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _BadRequest(400, "request body is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise _BadRequest(400, "request body must be a JSON object")
    return parsed


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _DraftFaultCollector(Collector):
    """Failing drafts: steps served without speculation because a draft raised, and reverts."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        e = self.engine
        yield CounterMetricFamily(
            "tide_draft_step_failures", "Steps on which a draft raised (served without it)",
            value=e.drafts.step_failures,
        )  # fmt: skip
        yield CounterMetricFamily(
            "tide_draft_reverts", "Drafts reverted after failing steps in a row", value=e.drafts.reverts
        )
        yield GaugeMetricFamily("tide_degraded", "1 while a reverted draft leaves a workload degraded",
                                value=float(bool(e.drafts.degraded)))  # fmt: skip


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Generation:
    """One generation request, from submission until its last token (or its client leaving)."""

    loop: EngineLoop
    metrics: ServingMetrics
    seq: Sequence
    queue: asyncio.Queue[Delta]
    request: Request
    chat: bool
    include_usage: bool
    start: float
    created: int = field(default_factory=lambda: int(time.time()))
    first_token: bool = True

    @property
    def endpoint(self) -> str:
        return "chat" if self.chat else "completions"

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.seq.request_id

    async def deltas(self) -> AsyncIterator[Delta]:
        """The request's deltas until done; cancels the request if the client disconnects."""
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            while True:
                get = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.loop.cancel(self.seq)
                    self.metrics.requests.labels(self.endpoint, "499").inc()
                    return
                delta = get.result()
                if self.first_token and delta.completion_tokens:
                    self.metrics.ttft.observe(time.perf_counter() - self.start)
                    self.first_token = False
                yield delta
                if delta.done:
                    status = "500" if self.seq.finish_reason == "error" else "200"
                    self.metrics.requests.labels(self.endpoint, status).inc()
                    self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - self.start)
                    return
        finally:
            gone.cancel()
            if not self.seq.finished:  # cancelled from outside (e.g. server shutdown)
                self.loop.cancel(self.seq)

    def usage(self) -> dict[str, int]:
        p, c = len(self.seq.prompt), len(self.seq.output)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def finish_reason(self) -> str:
        return "length" if self.seq.finish_reason == "length" else "stop"

    async def complete(self) -> Response:
        text = "".join([d.text async for d in self.deltas()])
        if not self.seq.finished or self.seq.finish_reason == "abort":
            return Response(status_code=499)  # nobody is listening
        if self.seq.finish_reason == "error":
            return error_response(500, "generation failed; see the server log", "server_error")
        if self.chat:
            choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice, obj = {"text": text, "logprobs": None}, "text_completion"
        return JSONResponse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": MODEL_ID,
                "choices": [{"index": 0, **choice, "finish_reason": self.finish_reason()}],
                "usage": self.usage(),
            }
        )

    def event(self, delta: dict[str, Any] | None, reason: str | None, usage: bool = False) -> str:
        choices: list[dict[str, Any]] = []
        if delta is not None:
            body = {"delta": delta} if self.chat else {"text": delta.get("content", ""), "logprobs": None}
            choices.append({"index": 0, **body, "finish_reason": reason})
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": MODEL_ID,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = self.usage() if usage else None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        if self.chat:
            yield self.event({"role": "assistant", "content": ""}, None)
        async for d in self.deltas():
            if d.text:
                yield self.event({"content": d.text}, None)
            if not d.done:
                continue
            if self.seq.finish_reason == "error":
                err = {"message": "generation failed; see the server log", "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                return
            yield self.event({}, self.finish_reason())
            if self.include_usage:
                yield self.event(None, None, usage=True)
            yield "data: [DONE]\n\n"


def make_app(node: ServingNode, server: ServerConfig | None = None) -> FastAPI:
    server = server or ServerConfig()
    target, engine = node.target, node.engine
    metrics = ServingMetrics(engine, node.publisher, node.sync, server.capture)
    node.advise(server.capture)
    loop = EngineLoop(engine, metrics, server.max_queue)
    tok = target.tok

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        node.start()
        yield
        loop.stop()
        node.stop()

    app = FastAPI(title="TIDE", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.metrics = metrics
    metrics.registry.register(_DraftFaultCollector(engine))
    app.include_router(admin_router(engine, server.capture, server.admin_token))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
        return error_response(e.status_code, str(e.detail), kind.get(e.status_code, "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if x != "body")
        return error_response(400, f"{loc}: {err['msg']}")

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Always 200 while the node answers requests. "status" is "degraded" once a workload's
        draft failed step after step and was reverted ("degraded" says which and why): that
        workload is served without the failing draft's speculation, which is slower but correct,
        so a load balancer should keep the node; alerts can watch the status."""
        degraded = dict(engine.drafts.degraded)
        return {
            "status": "degraded" if degraded else "ok",
            **({"degraded": degraded} if degraded else {}),
            "draft": engine.draft_version,
            "drafts": engine.draft_versions(),
            "gamma": engine.gamma,
            "adaptive": engine.adaptive,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
        }

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "tide"}
        return {"object": "list", "data": [{**card, "fingerprint": target.fingerprint}]}

    def parse(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
        try:
            return (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as e:
            message, param = describe(e)
            raise _BadRequest(400, message, param) from None
        except RecursionError:
            raise _BadRequest(400, "request body is nested too deeply") from None

    def tokenize(req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, CompletionRequest) and not isinstance(req.prompt, str):
            if not all(0 <= t < target.config.vocab_size for t in req.prompt):
                raise _BadRequest(400, "prompt token ids out of the vocabulary", "prompt")
            return req.prompt
        try:
            if isinstance(req, ChatRequest):
                return tok.chat_prompt([m.as_template_input() for m in req.messages])
            assert isinstance(req.prompt, str)  # token ids returned above
            return tok.encode(req.prompt)
        except Exception as e:  # e.g. a chat template that refuses this order of roles
            param = "messages" if isinstance(req, ChatRequest) else "prompt"
            log.info("a request's %s could not be tokenized: %s", param, type(e).__name__)
            raise _BadRequest(400, f"{param}: could not be tokenized ({type(e).__name__})", param) from None

    def submit(
        request: Request, req: ChatRequest | CompletionRequest
    ) -> tuple[Sequence, asyncio.Queue[Delta]]:
        if req.model != MODEL_ID:
            raise _BadRequest(
                404,
                f"model {req.model!r} does not exist; this server serves {MODEL_ID!r}",
                "model",
                "not_found_error",
            )
        try:
            workload = server.capture.workloads.resolve(request.headers.get("x-tide-workload", "default"))
        except ValueError as e:
            raise _BadRequest(400, f"X-Tide-Workload: {e}") from None
        opted_out = request.headers.get("x-tide-capture", "on").strip().lower() == "off"
        prompt = tokenize(req)
        room = engine.cfg.max_model_len - len(prompt)
        max_tokens = req.requested_max_tokens() or max(1, min(server.default_max_tokens, room))
        try:
            rid = uuid.uuid4().hex[:24]
            d = server.capture.decide(workload, opted_out, rid, prompt)
            seq, queue = loop.submit(prompt, req.sampling(max_tokens), workload, d.capture, rid, d.held_out)
        except QueueFull as e:
            metrics.rejected.labels("queue_full").inc()
            raise _BadRequest(429, f"server busy: {e}; retry later", kind="rate_limit_error") from None
        except ValueError as e:
            raise _BadRequest(400, str(e)) from None
        metrics.prompt_tokens.labels(workload).inc(len(prompt))
        return seq, queue

    async def handle(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        start = time.perf_counter()
        try:
            req = parse(await _read_body(request, server.max_body_bytes), chat)
            seq, queue = submit(request, req)
        except _BadRequest as e:
            metrics.requests.labels(endpoint, str(e.status)).inc()
            headers = {"Retry-After": "1"} if e.status == 429 else None
            resp = error_response(e.status, e.message, e.kind, e.param)
            if headers:
                resp.headers.update(headers)
            return resp
        call = Generation(loop, metrics, seq, queue, request, chat, req.include_usage, start)
        if req.stream:
            return StreamingResponse(call.stream(), media_type="text/event-stream")
        return await call.complete()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, False)

    return app
