#!/usr/bin/env bash
# The README's first command: a 15-second capture of real traffic on this host, needing no
# external service. It starts a small HTTP server, sends it requests, and captures them with
# tracejoin.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18555}
OUT=${OUT:-tracejoin-capture}
.venv/bin/python tests/servers/pyserver.py threaded "$PORT" >/dev/null &
srv=$!
trap 'kill $srv ${traffic:-} 2>/dev/null || true' EXIT
# Requests that carry W3C traceparents (some slow, some touching memory) until the capture
# ends: the probes compile first (seconds to tens of seconds on a busy machine), and whatever
# arrives before they attach is simply not seen.
(
    i=0
    while :; do
        i=$((i + 1))
        tid=$(printf '%08x%08x%08x%08x' $RANDOM$RANDOM $i $RANDOM $RANDOM)
        case $((i % 4)) in
            0) path="/sleep?ms=50" ;;
            1) path="/pages?n=512" ;;
            *) path="/orders/$i" ;;
        esac
        curl -s -o /dev/null -H "traceparent: 00-${tid}-00f067aa0ba902b7-01" \
            "http://127.0.0.1:$PORT$path" || true
        sleep 0.3
    done
) &
traffic=$!
.venv/bin/tracejoin capture --duration 15 --port "$PORT" --output-dir "$OUT"
