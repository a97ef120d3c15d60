# Two commands a new machine needs: `make test` and `make demo`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LINT_PATHS := $(wildcard src tests benchmarks scripts)
STAMP  := $(VENV)/.strop-installed
PYTEST_ARGS ?=

.PHONY: install test lint format demo clean

install: $(STAMP)

# torch goes in first, by exact version, so that nothing later resolves to a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[jax,torch,dev]"
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: $(STAMP)
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# The main job on the built-in default: LoRA-PPO on the shipped tiny math model (CPU).
demo: $(STAMP)
	$(BIN)/strop demo

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
