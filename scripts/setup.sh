#!/usr/bin/env bash
# Idempotent set-up for a Debian host. A second run only checks and returns in seconds.
#
#   setup.sh capture   what a capture needs (root): system packages, kernel headers, tracefs,
#                      and the project's virtualenv with its runtime dependencies
#   setup.sh test      the above, plus the test tools, the dev dependencies, and the Jaeger,
#                      helm and schema-validator binaries the tests run (built with Go)
#   setup.sh dev       only the virtualenv with the dev dependencies (no root): for lint, unit
#   setup.sh matrix    the kernel matrix's host tools (root): QEMU, mmdebstrap, e2fsprogs; the
#                      guest kernels and root image are fetched by tests/matrix/run.py itself
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TRACEJOIN_VENV:-$ROOT/.venv}
CACHE=${TRACEJOIN_CACHE:-/var/cache/tracejoin}
MODE=${1:-}
say() { printf 'setup: %s\n' "$*"; }

case "$MODE" in
    capture | test | dev | matrix) ;;
    *) echo "usage: $0 capture|test|dev|matrix" >&2; exit 2 ;;
esac

if [ "$MODE" != dev ] && [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then
        say "not root; re-running through sudo"
        exec sudo -- "$0" "$@"
    fi
    echo "setup: must run as root (it installs packages and mounts tracefs): run it from a root shell" >&2
    exit 1
fi

# System packages. BCC's Python binding is Debian's python3-bpfcc (the PyPI 'bcc' is unrelated);
# curl drives the capture demo. The tests and benchmarks add bpftool, wrk and the rest.
apt_install() {
    local missing
    missing=$(for p in "$@"; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || echo "$p"; done)
    [ -n "$missing" ] || return 0
    say "installing: $(echo $missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

# Kernel headers. BCC needs a kernel build tree to compile against. Production hosts have
# their own matching headers; where /lib/modules/$(uname -r)/build is absent (as in CI's VMs) we
# link Debian's generic headers. tracejoin's programs only read tracepoint arguments, whose
# layout BCC takes from tracefs at run time, so a header/kernel mismatch cannot skew a value.
link_headers() {
    local krel hdr common
    krel=$(uname -r)
    [ -e "/lib/modules/$krel/build" ] && return 0
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    if [ -z "$hdr" ] || [ -z "$common" ]; then
        echo "setup: no kernel headers found under /usr/src; install linux-headers-amd64" >&2
        exit 1
    fi
    mkdir -p "/lib/modules/$krel"
    ln -sfn "$hdr" "/lib/modules/$krel/build"
    ln -sfn "$common" "/lib/modules/$krel/source"
    say "linked generic headers $(basename "$hdr") for kernel $krel (not a match; see docs/operations.md)"
}

# tracefs (tracepoint formats and ids) and debugfs.
mount_tracefs() {
    mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing
    mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug || true
}

# The virtualenv, with tracejoin installed editable: $1 is "runtime" or "dev" (adds the dev
# extras). Prefer Debian's python3 (the one python3-bpfcc was built for); any >= 3.11 works
# because the binding is pure Python over libbcc.so.
venv() {
    local kind=$1 py=${TRACEJOIN_PYTHON:-} site stamp spec=.
    [ "$kind" = dev ] && spec=".[dev]"
    if [ -z "$py" ]; then
        for cand in /usr/bin/python3 python3; do
            if "$cand" -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then py=$cand; break; fi
        done
    fi
    [ -n "$py" ] || { echo "setup: need Python >= 3.11 with venv/ensurepip (Debian: python3-venv)" >&2; exit 1; }
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating virtualenv $VENV with $py"
        "$py" -m venv "$VENV"
    fi
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -d /usr/lib/python3/dist-packages/bcc ]; then
        ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
    fi
    # A dev install includes the runtime one: either stamp, if newer than pyproject.toml, will do.
    for stamp in "$VENV/.tracejoin-installed-dev" "$VENV/.tracejoin-installed-$kind"; do
        if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] \
            && [ "$stamp" -nt agent/pipeline/_span_bytes.c ] \
            && [ "$stamp" -nt agent/enrich/_trace_context.c ] \
            && [ "$stamp" -nt agent/enrich/plain_traceparent.h ] \
            && [ "$stamp" -nt bpf/http_record.h ] \
            && [ "$stamp" -nt agent/kernel/_ring_read.c ] \
            && [ "$stamp" -nt exporters/_request_bytes.c ] \
            && [ "$stamp" -nt agent/core/varint.h ]; then return 0; fi
    done
    say "installing tracejoin ($kind dependencies) into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"
    touch "$VENV/.tracejoin-installed-$kind"
}

if [ "$MODE" = dev ]; then
    venv dev
    say "ready (venv $VENV)"
    exit 0
fi

if [ "$MODE" = matrix ]; then
    # The guests run under QEMU (TCG: nested KVM fails on these VMs); their root image comes
    # from Debian through mmdebstrap and their disks are ext4 images made by mke2fs -d.
    apt_install qemu-system-x86 mmdebstrap e2fsprogs python3-pip
    say "ready for the kernel matrix (tests/matrix/run.py)"
    exit 0
fi

# gcc and python3-dev build span_bytes' compiled join at install (optional: without them the
# agent runs on the pure-Python one)
apt_install python3-bpfcc libbpfcc python3-venv linux-headers-amd64 curl gcc python3-dev
link_headers
mount_tracefs
if [ "$MODE" = capture ]; then
    venv runtime
else
    apt_install bpfcc-tools bpftool iproute2 wrk ethtool
    venv dev
fi
"$VENV/bin/python" -c 'import bcc' || { echo "setup: the virtualenv cannot import bcc" >&2; exit 1; }
if [ "$MODE" = capture ]; then
    say "ready for a capture (venv $VENV)"
    exit 0
fi

# Jaeger v2 for the end-to-end tests, built from the pinned tools module and cached outside the
# tree; then helm and the offline Kubernetes schema validator for tests/test_deploy.py.
JAEGER_VERSION=$(sed -n 's/^\s*github.com\/jaegertracing\/jaeger \(v[0-9.]*\).*/\1/p' tools/jaeger/go.mod | head -1)
JAEGER="$CACHE/jaeger-$JAEGER_VERSION"
if [ ! -x "$JAEGER" ]; then
    command -v go >/dev/null || { echo "setup: Go is needed to build Jaeger for the tests" >&2; exit 1; }
    say "building Jaeger $JAEGER_VERSION (first run only; a few minutes)"
    mkdir -p "$CACHE"
    (cd tools/jaeger && go build -trimpath -o "$JAEGER.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
    mv "$JAEGER.tmp" "$JAEGER"
fi
ln -sfn "$JAEGER" "$CACHE/jaeger"
tools/helm/build.sh >/dev/null
tools/k8sschema/build.sh >/dev/null
tools/seccomp/build.sh >/dev/null   # the seccomp profile generator (test_deploy.py)
say "ready for the tests (venv $VENV, jaeger $JAEGER)"
