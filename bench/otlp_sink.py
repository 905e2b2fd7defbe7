"""A local OTLP/HTTP endpoint that accepts and discards: what the agent exports to in bench/run.py.

    python -m bench.otlp_sink PORT

Answers every POST /v1/traces with 200 and an empty body (a valid, empty
ExportTraceServiceResponse), over keep-alive HTTP/1.1, so the agent runs its production export
path (OTLP protobuf over HTTP) without a collector's CPU in the measurement. Prints "ready".
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main(argv: list[str]) -> int:
    server = ThreadingHTTPServer(("127.0.0.1", int(argv[0])), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
