#!/usr/bin/env bash
# Build the manifest validator into the cache, keyed by a hash of its sources (an edit
# rebuilds; an unchanged tree reuses the binary), and print its path.
# Usage: tools/k8sschema/build.sh   (env TRACEJOIN_CACHE, default /var/cache/tracejoin)
set -euo pipefail
cd "$(dirname "$0")"
CACHE=${TRACEJOIN_CACHE:-/var/cache/tracejoin}
HASH=$(cat go.mod go.sum ./*.go | sha256sum | cut -c1-12)
OUT="$CACHE/k8sschema-$HASH"
if [ ! -x "$OUT" ]; then
    command -v go >/dev/null || { echo "build.sh: Go is needed to build k8sschema" >&2; exit 1; }
    mkdir -p "$CACHE"
    echo "building k8sschema $HASH" >&2
    go build -trimpath -o "$OUT.tmp.$$" .
    mv "$OUT.tmp.$$" "$OUT"
fi
ln -sfn "$(basename "$OUT")" "$CACHE/k8sschema"
echo "$OUT"
