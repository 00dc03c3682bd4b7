"""A vLLM engine in a child process, driven over a pipe: token ids in; token ids, seconds and vLLM's
speculation counters out. `VllmProcess` starts `python -m tide.serving.vllm_adapter.process` in
vLLM's virtualenv; the child builds a `vllm.LLM` on the target's Hugging Face folder
(`tide.models.hf_folder`), with the draft in vLLM's speculators format
(`trainers.export.export_speculators`) when one is given, and with the tap when `VllmConfig.tap`
says so.

The pipe carries one JSON object per line. The child's stdout is moved to stderr before vLLM is
imported (vLLM and its engine process print to stdout), so only replies travel on the pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from tide.serving.capture import DEFAULT_WORKLOAD
from tide.serving.vllm_adapter.config import (
    NODE_ENV,
    WORKER_EXTENSION,
    VllmConfig,
    VllmUnavailable,
    environment,
)


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


class VllmProcess:
    """A vLLM engine in its own process (its own virtualenv); `generate` sends it token ids."""

    def __init__(self, cfg: VllmConfig):
        python, env = environment(cfg)  # the config travels in it (`NODE_ENV`)
        self.proc = subprocess.Popen(
            [str(python), "-m", "tide.serving.vllm_adapter.process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        ready = self._reply()
        if not ready.get("ready"):
            self.close()
            raise VllmUnavailable(f"vLLM did not start: {ready.get('error', ready)}")

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
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

    def swap_draft(self, folder: Path) -> None:
        """The draft in `folder` (vLLM's speculators format) in place of the one serving, between two
        steps; raises (and the old one serves on) if vLLM refuses it."""
        self._call({"draft": str(folder)})

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


def _serve(cfg: VllmConfig, requests: IO[str], replies: IO[str]) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = None
    if cfg.draft_dir is not None:
        spec = {"method": "eagle3", "model": str(cfg.draft_dir), "num_speculative_tokens": cfg.gamma}
    tap = cfg.tap
    llm = LLM(
        model=str(cfg.model_dir),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        speculative_config=spec,
        enforce_eager=True,  # torch.compile on CPU takes minutes per shape, and the shapes vary
        disable_log_stats=False,  # the speculation counters are stats
        seed=0,
        worker_extension_cls=WORKER_EXTENSION if spec else "",
    )
    if tap is not None:
        llm.collective_rpc("tide_attach_tap", args=(json.dumps(asdict(tap)),))

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in requests:
        try:
            req = json.loads(line)
            if req.get("flush"):
                reply({"tap": llm.collective_rpc("tide_flush_tap")[0] if tap is not None else {}})
                continue
            if "draft" in req:
                llm.collective_rpc("tide_load_draft", args=(req["draft"],))
                llm.reset_prefix_cache()  # cached blocks hold the old draft's KV entries
                reply({"swapped": req["draft"]})
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
    cfg = VllmConfig.from_json(os.environ[NODE_ENV])
    try:
        _serve(cfg, sys.stdin, replies)
    except Exception as e:
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        replies.flush()
        raise


if __name__ == "__main__":
    main()
