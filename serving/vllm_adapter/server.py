"""A serving node on vLLM: its own OpenAI server (`tide serve --engine vllm`), with TIDE inside.

`TideHeaders` is given to vLLM's server as ASGI middleware (its `--middleware` option): once the
server has started it starts the `VllmNode` (the tap, the registry follower), it maps TIDE's request
headers onto the `vllm_xargs` the tap reads, and it appends TIDE's metrics to vLLM's `/metrics`.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

from tide.serving.capture import DEFAULT_WORKLOAD, check_workload
from tide.serving.vllm_adapter.config import WORKER_EXTENSION, VllmConfig, environment
from tide.serving.vllm_adapter.node import VllmNode

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")


def server_command(cfg: VllmConfig, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's OpenAI server on `cfg`, with the tap when it has one."""
    python, env = environment(cfg)
    cmd = [
        str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(cfg.model_dir), "--served-model-name", "tide", "--host", host, "--port", str(port),
        "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
        "--enforce-eager", "--middleware", "tide.serving.vllm_adapter.server.TideHeaders",
    ]  # fmt: skip
    if cfg.draft_dir is not None:
        spec = {"method": "eagle3", "model": str(cfg.draft_dir), "num_speculative_tokens": cfg.gamma}
        cmd += ["--speculative-config", json.dumps(spec)]
    if cfg.draft_dir is not None:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    return cmd, env


def _json_response(status: int, message: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    return start, body.encode()


class TideHeaders:
    """ASGI middleware for vLLM's OpenAI server (its `--middleware`). It starts the `VllmNode` once
    the server has started (its config comes in `TIDE_VLLM_NODE`) and stops it with the server; it
    turns the `X-Tide-Workload` and `X-Tide-Capture` headers of a generation request into the
    `vllm_xargs` the tap reads, as TIDE's own server reads them: an invalid workload name is refused
    (400), and a body cannot name a workload or opt in to capture by itself."""

    max_body_bytes = 1 << 20

    def __init__(self, app: Any):
        self.app = app
        self.node: VllmNode | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, self._lifespan(scope, receive), send)
        if scope["type"] == "http" and scope["method"] == "GET" and self.node is not None:
            node = self.node
            if scope["path"] == "/metrics":  # vLLM's, then TIDE's
                return await self._extended(scope, receive, send, lambda body: _appended(body, node))
            if scope["path"] == "/health":  # vLLM's verdict, TIDE's body
                return await self._extended(
                    scope, receive, send, lambda _: _health(node), b"application/json"
                )
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            workload = check_workload(headers.get("x-tide-workload", DEFAULT_WORKLOAD))
        except ValueError as e:
            return await self._refuse(send, 400, str(e))
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._refuse(send, 413, f"the body is over {self.max_body_bytes} bytes")
        body = self._with_xargs(body, workload, headers.get("x-tide-capture", "").lower() != "off")
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                 + [(b"content-length", str(len(body)).encode())]}  # fmt: skip
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            message: dict[str, Any] = await receive()
            return message

        await self.app(scope, replay, send)

    @staticmethod
    def _with_xargs(body: bytes, workload: str, capture: bool) -> bytes:
        """The body with the tap's `vllm_xargs`; a body that is not a JSON object goes on as it is
        (vLLM answers it)."""
        try:
            data = json.loads(body)
        except ValueError:
            return body
        if not isinstance(data, dict):
            return body
        xargs = data.get("vllm_xargs")
        xargs = (
            {k: v for k, v in xargs.items() if not k.startswith("tide_")} if isinstance(xargs, dict) else {}
        )
        xargs["tide_workload"] = workload
        if not capture:
            xargs["tide_capture"] = "off"
        data["vllm_xargs"] = xargs
        return json.dumps(data).encode()

    @staticmethod
    async def _refuse(send: Any, status: int, message: str) -> None:
        start, body = _json_response(status, message)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    def _lifespan(self, scope: dict[str, Any], receive: Any) -> Any:
        """`receive` for the lifespan: the node starts as the app starts, and stops as it stops."""

        async def wrapped() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message["type"] == "lifespan.startup":
                self.node = VllmNode.from_env(scope["app"].state.engine_client)
                if self.node is not None:
                    await self.node.start()
            elif message["type"] == "lifespan.shutdown" and self.node is not None:
                self.node.stop()
            return message

        return wrapped

    async def _extended(
        self,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        extend: Callable[[bytes], Awaitable[bytes]],
        content_type: bytes | None = None,
    ) -> None:
        """vLLM's answer (asked for uncompressed), its body given to `extend` when it is a 200 (then
        of `content_type`, when given)."""
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]
        start: dict[str, Any] = {}
        body = b""

        async def collect(message: dict[str, Any]) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                body += message.get("body", b"")

        await self.app({**scope, "headers": headers}, receive, collect)
        out = list(start.get("headers", []))
        if start.get("status") == 200:
            body = await extend(body)
            if content_type is not None:
                out = [(k, v) for k, v in out if k.lower() != b"content-type"] + [
                    (b"content-type", content_type)
                ]
        out = [(k, v) for k, v in out if k.lower() != b"content-length"]
        await send({**start, "headers": [*out, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _appended(body: bytes, node: VllmNode) -> bytes:
    return body + await node.metrics()


async def _health(node: VllmNode) -> bytes:
    return json.dumps(node.health()).encode()


def run_server(cfg: VllmConfig, host: str, port: int) -> int:
    """vLLM's OpenAI server in the foreground until it ends or this process is stopped (SIGINT or
    SIGTERM: the server is stopped with it, never left running)."""
    cmd, env = server_command(cfg, host, port)
    proc = subprocess.Popen(cmd, env=env)

    def stopped(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(proc)
        signal.signal(signal.SIGTERM, previous)


def _stop(proc: subprocess.Popen[Any]) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
