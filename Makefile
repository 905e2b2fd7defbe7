# Every target that runs code runs set-up first; set-up is idempotent and quick once done.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test unit lint bench capture ebpf clean image image-lock requirements-lock seccomp-profile

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
