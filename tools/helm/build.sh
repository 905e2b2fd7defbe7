#!/usr/bin/env bash
# Build the helm binary pinned in go.mod (once) into the cache and print its path.
# Same link flags as helm's own Makefile: its version, and the Kubernetes version it assumes
# for `helm template` / `helm lint` (without them a source build claims Kubernetes 1.20).
# Usage: tools/helm/build.sh   (env TRACEJOIN_CACHE, default /var/cache/tracejoin)
set -euo pipefail
cd "$(dirname "$0")"
CACHE=${TRACEJOIN_CACHE:-/var/cache/tracejoin}
mod_version() { sed -n "s|^[[:space:]]*$1 \(v[0-9][0-9.]*\).*|\1|p" go.mod | head -1; }
HELM=$(mod_version helm.sh/helm/v3)
K8S=$(mod_version k8s.io/client-go)   # v0.37.0 -> Kubernetes 1.37
[ -n "$HELM" ] && [ -n "$K8S" ] || { echo "build.sh: cannot read versions from go.mod" >&2; exit 1; }
MINOR=$(echo "$K8S" | cut -d. -f2)
OUT="$CACHE/helm-$HELM-k8s1.$MINOR"
if [ ! -x "$OUT" ]; then
    command -v go >/dev/null || { echo "build.sh: Go is needed to build helm" >&2; exit 1; }
    mkdir -p "$CACHE"
    echo "building helm $HELM (first run only; a few minutes)" >&2
    V=helm.sh/helm/v3
    go build -trimpath -o "$OUT.tmp.$$" -ldflags "-w -s \
        -X $V/internal/version.version=$HELM \
        -X $V/pkg/lint/rules.k8sVersionMajor=1 -X $V/pkg/lint/rules.k8sVersionMinor=$MINOR \
        -X $V/pkg/chartutil.k8sVersionMajor=1 -X $V/pkg/chartutil.k8sVersionMinor=$MINOR" \
        helm.sh/helm/v3/cmd/helm
    mv "$OUT.tmp.$$" "$OUT"
fi
ln -sfn "$(basename "$OUT")" "$CACHE/helm"
echo "$OUT"
