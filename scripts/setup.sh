#!/usr/bin/env bash
# One-shot, idempotent set-up for a Debian host (run as root): system packages, kernel headers,
# tracefs, the project's virtualenv (which sees Debian's BCC binding) and the Jaeger binary the
# end-to-end tests run. A second run only checks and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TRACEJOIN_VENV:-$ROOT/.venv}
CACHE=${TRACEJOIN_CACHE:-/var/cache/tracejoin}
JAEGER_VERSION=$(sed -n 's/^\s*github.com\/jaegertracing\/jaeger \(v[0-9.]*\).*/\1/p' tools/jaeger/go.mod | head -1)
say() { printf 'setup: %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
    echo "setup: must run as root (it installs packages and mounts tracefs)" >&2
    exit 1
fi

# 1. System packages. BCC's Python binding is Debian's python3-bpfcc (the PyPI 'bcc' is unrelated).
PKGS="python3-bpfcc bpfcc-tools libbpfcc bpftool iproute2 curl wrk linux-headers-amd64 ethtool"
missing=$(for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || echo "$p"; done)
if [ -n "$missing" ]; then
    say "installing: $(echo $missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# 2. Kernel headers. BCC needs a kernel build tree to compile against. Production hosts have
# their own matching headers; where /lib/modules/$(uname -r)/build is absent (as in CI's VMs) we
# link Debian's generic headers. tracejoin's programs only read tracepoint arguments, whose
# layout BCC takes from tracefs at run time, so a header/kernel mismatch cannot skew a value.
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build" ]; then
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    if [ -z "$hdr" ] || [ -z "$common" ]; then
        echo "setup: no kernel headers found under /usr/src; install linux-headers-amd64" >&2
        exit 1
    fi
    mkdir -p "/lib/modules/$KREL"
    ln -sfn "$hdr" "/lib/modules/$KREL/build"
    ln -sfn "$common" "/lib/modules/$KREL/source"
    say "linked generic headers $(basename "$hdr") for kernel $KREL (not a match; see docs/operations.md)"
fi

# 3. tracefs (tracepoint formats and ids) and debugfs.
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing
mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug || true

# 4. The virtualenv. Prefer Debian's python3 (the one python3-bpfcc was built for); any >= 3.11 works
# because the binding is pure Python over libbcc.so.
PY=${TRACEJOIN_PYTHON:-}
if [ -z "$PY" ]; then
    for cand in /usr/bin/python3 python3; do
        if "$cand" -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then PY=$cand; break; fi
    done
fi
[ -n "$PY" ] || { echo "setup: need Python >= 3.11 with venv/ensurepip" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
stamp="$VENV/.tracejoin-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    say "installing tracejoin and its dev dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
    touch "$stamp"
fi
"$VENV/bin/python" -c 'import bcc' || { echo "setup: the virtualenv cannot import bcc" >&2; exit 1; }

# 5. Jaeger v2 for the end-to-end tests, built from the pinned tools module and cached outside the tree.
JAEGER="$CACHE/jaeger-$JAEGER_VERSION"
if [ ! -x "$JAEGER" ]; then
    command -v go >/dev/null || { echo "setup: Go is needed to build Jaeger for the tests" >&2; exit 1; }
    say "building Jaeger $JAEGER_VERSION (first run only; a few minutes)"
    mkdir -p "$CACHE"
    (cd tools/jaeger && go build -trimpath -o "$JAEGER.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
    mv "$JAEGER.tmp" "$JAEGER"
fi
ln -sfn "$JAEGER" "$CACHE/jaeger"

# 6. helm, the offline Kubernetes schema validator and the seccomp profile generator for
# tests/test_deploy.py, built once
# into the cache (helm's first build takes a few minutes).
tools/helm/build.sh >/dev/null
tools/k8sschema/build.sh >/dev/null
tools/seccomp/build.sh >/dev/null   # the seccomp profile generator (test_deploy.py)
say "ready (venv $VENV, jaeger $JAEGER)"
