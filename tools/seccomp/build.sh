#!/usr/bin/env bash
# Build the seccomp profile generator into the cache, keyed by a hash of its sources (an edit
# or a containerd bump rebuilds; an unchanged tree reuses the binary), and print its path.
# Usage: tools/seccomp/build.sh   (env TRACEJOIN_CACHE, default /var/cache/tracejoin)
set -euo pipefail
cd "$(dirname "$0")"
CACHE=${TRACEJOIN_CACHE:-/var/cache/tracejoin}
HASH=$(cat go.mod go.sum ./*.go | sha256sum | cut -c1-12)
OUT="$CACHE/seccomp-$HASH"
if [ ! -x "$OUT" ]; then
    command -v go >/dev/null || { echo "build.sh: Go is needed to build the seccomp generator" >&2; exit 1; }
    mkdir -p "$CACHE"
    echo "building the seccomp profile generator $HASH (first run only; a few minutes)" >&2
    GOARCH=amd64 go build -trimpath -o "$OUT.tmp.$$" .
    mv "$OUT.tmp.$$" "$OUT"
fi
echo "$OUT"
