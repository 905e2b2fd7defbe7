# Every target that runs code sets up what it needs first (scripts/setup.sh: idempotent, and
# quick once done).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Targets that need root: they install packages, mount tracefs and load BPF.
ROOT_TARGETS := capture test bench ebpf setup setup-capture matrix setup-matrix

.PHONY: $(ROOT_TARGETS) setup-dev unit lint clean image image-lock requirements-lock seccomp-profile

ifneq ($(shell id -u),0)
# Not root: re-run the same target through sudo where it is installed, else say how to.
$(ROOT_TARGETS):
	@if command -v sudo >/dev/null 2>&1; then \
	    echo "make $@: not root; re-running it through sudo" >&2; \
	    exec sudo $(MAKE) $@ VENV='$(VENV)' PYTEST_ARGS='$(PYTEST_ARGS)' KERNELS='$(KERNELS)'; \
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

## The kernel matrix: boot each guest kernel under QEMU, run the smoke suite inside, print the
## table (out/matrix/matrix.md, .json) and write it into docs/operations.md. KERNELS=5.10,6.18
## picks some (default: all of tests/matrix/run.py's KERNELS).
KERNELS ?=
matrix: setup-matrix
	python3 tests/matrix/run.py $(if $(KERNELS),--kernels $(KERNELS),--docs docs/operations.md)

setup-matrix:
	./scripts/setup.sh matrix

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

## The agent image, on the base pinned in deploy/base-image.lock (IMAGE=repo:tag to name it).
IMAGE ?= registry.example.com/tracejoin:0.1.0
image:
	@grep -Eq '^[^ ]+@sha256:[0-9a-f]{64}$$' deploy/base-image.lock || \
		{ echo "deploy/base-image.lock holds no pinned base image: run make image-lock" >&2; exit 1; }
	docker build -f deploy/Dockerfile --build-arg BASE_IMAGE="$$(cat deploy/base-image.lock)" -t $(IMAGE) .

## Resolve debian:bookworm-slim's current digest into deploy/base-image.lock (needs a registry).
image-lock:
	./scripts/image-lock.sh

## Re-pin the image's Python dependencies, with hashes (needs pip-tools and PyPI).
requirements-lock:
	./scripts/requirements-lock.sh

## Regenerate the agent's seccomp profile and its copies in the chart and manifests.
seccomp-profile:
	./scripts/seccomp-profile.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache out
