"""/healthz, /readyz and /metrics for `tracejoin run`."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from tracejoin.core.metrics import Metrics

log = logging.getLogger(__name__)


class HealthServer:
    """/healthz (alive: the reader thread runs once started), /readyz (probes attached and not
    stopping), /metrics (Prometheus text). Binds at construction (a taken port is a start-up
    error); start/shutdown are idempotent."""

    def __init__(self, address: str, port: int, metrics: Metrics, pipeline: Any = None) -> None:
        self.metrics = metrics
        self.pipeline = pipeline
        self.loaded = False  # set once the probes are attached and the gauges say so
        self.stopping = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    alive = server.alive()
                    self._send(200 if alive else 503, "ok\n" if alive else "reader stopped\n")
                elif path == "/readyz":
                    ready = server.ready()
                    why = "stopping\n" if server.stopping else "starting\n"
                    self._send(200 if ready else 503, "ready\n" if ready else why)
                elif path == "/metrics":
                    server.refresh()
                    body = server.metrics.prometheus_text()
                    self._send(200, body, CONTENT_TYPE_PLAIN_0_0_4)
                else:
                    self._send(404, "not found\n")

            def _send(self, code: int, body: str, ctype: str = "text/plain") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:  # keep scrapes out of the log
                pass

        self._httpd = ThreadingHTTPServer((address, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def ready(self) -> bool:
        return self.loaded and not self.stopping

    def alive(self) -> bool:
        if self.pipeline is None or not self.loaded or self.stopping:
            return True
        return bool(self.pipeline.alive())

    def refresh(self) -> None:
        """Bring the gauges read at scrape time up to date; never fails the scrape."""
        self.metrics.set("ready", 1 if self.ready() else 0)
        if self.pipeline is not None:
            try:
                self.pipeline.kernel_counters()
            except Exception:  # maps closing under a concurrent shutdown
                log.debug("kernel counters unavailable", exc_info=True)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                daemon=True,
                name="tracejoin-health",
            )
            self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread = None
        self._httpd.server_close()
