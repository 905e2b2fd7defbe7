#!/usr/bin/env bash
# Regenerate deploy/requirements.lock: every Python distribution the image installs, pinned
# with the sha256 of each of its files on PyPI, from pyproject.toml's runtime dependencies and
# deploy/build-requirements.in (the build backend). Run with the image's Python (3.11, Debian
# bookworm) so that environment markers resolve as they will there.
# Needs pip-tools (pip-compile), e.g. in a throw-away venv: python3 -m venv /tmp/pt &&
# /tmp/pt/bin/pip install pip-tools && PIP_COMPILE=/tmp/pt/bin/pip-compile scripts/requirements-lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_COMPILE=${PIP_COMPILE:-pip-compile}
# Only PyPI: a local --find-links would put hashes of local files in the lock.
env -u PIP_FIND_LINKS "$PIP_COMPILE" --quiet --upgrade --generate-hashes --allow-unsafe \
    --strip-extras --no-emit-index-url --no-emit-find-links \
    --output-file deploy/requirements.lock pyproject.toml deploy/build-requirements.in
