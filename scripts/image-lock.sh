#!/usr/bin/env bash
# Pin the image's base: resolve the tag's current digest (the multi-architecture index, so one
# pin serves amd64 and arm64 nodes) and write `name@sha256:...` to deploy/base-image.lock, which
# `make image` passes to deploy/Dockerfile as BASE_IMAGE. Needs registry access and one of
# crane, skopeo, or docker with buildx. Re-run to move to a newer base on purpose.
# Usage: scripts/image-lock.sh [IMAGE]   (default debian:bookworm-slim)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-debian:bookworm-slim}
LOCK=deploy/base-image.lock
if command -v crane >/dev/null; then
    digest=$(crane digest "$IMAGE")
elif command -v skopeo >/dev/null; then
    ref=$IMAGE
    [[ $ref == */* ]] || ref="docker.io/library/$ref"
    # the digest of the manifest (list) as the registry serves it
    digest="sha256:$(skopeo inspect --raw "docker://$ref" | sha256sum | cut -d' ' -f1)"
elif docker buildx version >/dev/null 2>&1; then
    digest=$(docker buildx imagetools inspect "$IMAGE" --format '{{json .Manifest.Digest}}' | tr -d '"')
else
    echo "image-lock: needs crane, skopeo or docker buildx to resolve $IMAGE" >&2
    exit 1
fi
if ! [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "image-lock: unexpected digest for $IMAGE: '$digest'" >&2
    exit 1
fi
echo "${IMAGE%@*}@$digest" > "$LOCK"
echo "image-lock: $LOCK = $(cat "$LOCK")" >&2
