# Every target that runs code sets up what it needs first (scripts/setup.sh: idempotent, and
# quick once done).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Targets that need root: they install packages, mount tracefs and load BPF.
ROOT_TARGETS := capture test bench ebpf setup setup-capture

.PHONY: $(ROOT_TARGETS) setup-dev unit lint clean

ifneq ($(shell id -u),0)
# Not root: re-run the same target through sudo where it is installed, else say how to.
$(ROOT_TARGETS):
	@if command -v sudo >/dev/null 2>&1; then \
	    echo "make $@: not root; re-running it through sudo" >&2; \
	    exec sudo $(MAKE) $@ VENV='$(VENV)' PYTEST_ARGS='$(PYTEST_ARGS)'; \
	fi; \
	echo "make $@ needs root (packages, tracefs, BPF) and there is no sudo: run it from a root shell (su -)" >&2; \
	exit 1
else

## The README's first command: set up what a capture needs, then a 15 s capture of real
## traffic on this host, with no external service.
capture: setup-capture
	./scripts/demo.sh

## All tests: unit, privileged (real BPF as root) and end-to-end (real Jaeger).
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.run

## Print the BPF C exactly as it is compiled (after -D substitution), for review.
ebpf: setup-capture
	$(VENV)/bin/tracejoin ebpf

## Everything the tests need: packages, headers, tracefs, dev venv, Jaeger, helm, validator.
setup:
	TRACEJOIN_VENV=$(VENV) ./scripts/setup.sh test

setup-capture:
	TRACEJOIN_VENV=$(VENV) ./scripts/setup.sh capture
endif

setup-dev:
	TRACEJOIN_VENV=$(VENV) ./scripts/setup.sh dev

## Pure-logic tests only: no root, no BPF, no Jaeger.
unit: setup-dev
	$(PY) -m pytest -m "not privileged and not e2e" $(PYTEST_ARGS)

## Style, types (mypy over the installed package layout) and the import layering contracts.
lint: setup-dev
	$(VENV)/bin/ruff check agent exporters tests bench scripts
	$(VENV)/bin/ruff format --check agent exporters tests bench scripts
	$(PY) scripts/lint_package.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache out
