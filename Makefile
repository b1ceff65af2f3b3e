# Development entry points. `make test` builds .venv on first use; later runs reuse it until
# pyproject.toml changes.

VENV ?= .venv
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch alone, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers: most tests wait rather than compute, so more workers than cores pay.
# `make test PYTEST_WORKERS=0` runs in one process (pdb, -x, ordered output).
PYTEST_WORKERS ?= 4

PY := $(VENV)/bin/python
STAMP := $(VENV)/.s3ckpt-installed

.PHONY: venv test test-fast lint demo bench bench-smoke smoke-wheel clean

venv: $(STAMP)

# torch goes in first and pinned: otherwise `torch>=2.6` lets pip pick whatever is newest.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(PY) -m pip install -e '.[test]'
	touch $@

test: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Everything but the multi-process tests (torchrun, PROCESS mode, killed children).
test-fast: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: venv
	$(PY) -m s3ckpt.tools.demo

bench: venv
	$(PY) -m benchmarks.bench_core

# Every benchmark at a tiny size (figures meaningless): none may rot between real runs.
bench-smoke: venv
	$(PY) -m benchmarks.smoke

# The packaging: the built wheel in a fresh venv drives the CLI from outside the checkout.
smoke-wheel:
	PYTHON="$(PYTHON)" TORCH_VERSION="$(TORCH_VERSION)" TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" \
		.ci/smoke_wheel.sh

# Leaves $(VENV) alone: rebuilding it takes minutes; delete it by hand to start over.
clean:
	rm -rf build .pytest_cache .ruff_cache .mypy_cache *.egg-info
	find . -path './.*' -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
