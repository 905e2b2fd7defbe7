# Every target that runs code runs set-up first; set-up is idempotent and quick once done.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test unit lint bench capture ebpf clean

setup:
	./scripts/setup.sh

## All tests: unit, privileged (real BPF as root) and end-to-end (real Jaeger).
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

## Pure-logic tests only: no root, no BPF, no Jaeger.
unit: setup
	$(PY) -m pytest -m "not privileged and not e2e" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check agent exporters tests bench
	$(VENV)/bin/ruff format --check agent exporters tests bench
	$(VENV)/bin/mypy agent exporters

bench: setup
	$(PY) -m bench.run

## The README's first command: a short capture of real traffic on this host, no external service.
capture: setup
	./scripts/demo.sh

## Print the BPF C exactly as it is compiled (after -D substitution), for review.
ebpf: setup
	$(VENV)/bin/tracejoin ebpf

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache out
