"""`tracejoin run`: the unattended agent. Exports until SIGTERM, serves health and metrics,
and on SIGTERM detaches the probes and flushes within the configured bound."""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent.cli import (
    _builder_factory,
    _file_destination,
    _otlp_destination,
    install_signal_handlers,
    start_gpu_sampler,
)
from agent.config import Settings
from agent.metrics import Metrics
from agent.pipeline import Pipeline
from agent.probes import ProbeConfig, ProbeError

log = logging.getLogger(__name__)
DEFAULT_SPANS_FILE = Path("tracejoin-spans.otlp.jsonl")


class HealthServer:
    """/healthz (the process is alive and its reader thread runs), /readyz (probes attached),
    /metrics (Prometheus text). Start/shutdown are idempotent."""

    def __init__(self, address: str, port: int, metrics: Metrics, pipeline: Pipeline) -> None:
        self.metrics = metrics
        self.pipeline = pipeline
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._send(200, "ok\n")
                elif self.path == "/readyz":
                    ready = server.pipeline.ready.is_set()
                    self._send(200 if ready else 503, "ready\n" if ready else "starting\n")
                elif self.path == "/metrics":
                    server.pipeline.kernel_counters()
                    self._send(200, server.metrics.prometheus_text(), "text/plain; version=0.0.4")
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

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, daemon=True, name="tracejoin-health"
        )
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread = None
        self._httpd.server_close()


def run_daemon(s: Settings, probe_config: ProbeConfig, spans_file: Path | None) -> int:
    metrics = Metrics()
    destinations = []
    otlp = _otlp_destination(s, metrics)
    if otlp is not None:
        destinations.append(otlp)
    if spans_file is not None or otlp is None:
        destinations.append(_file_destination(spans_file or DEFAULT_SPANS_FILE, s, metrics))
    gpu = start_gpu_sampler(s, metrics)
    gpu_join = gpu.join if gpu is not None else None
    pipeline = Pipeline(probe_config, _builder_factory(s, metrics, gpu_join), destinations, metrics)
    health = None
    if s.metrics_port:
        health = HealthServer(s.metrics_address, s.metrics_port, metrics, pipeline)
        health.start()
        log.info("health and metrics on %s:%d", s.metrics_address, health.port)
    stop = threading.Event()
    install_signal_handlers(stop)
    try:
        pipeline.start()
    except ProbeError as exc:
        log.error("%s", exc)
        pipeline.shutdown(1.0)
        if health:
            health.shutdown()
        return 2
    log.info(
        "ready: probes loaded in %.1fs; signals %s; TLB %s",
        pipeline.probes.status.load_seconds,
        pipeline.probes.status.signals,
        pipeline.probes.status.tlb_mode,
    )
    while not stop.wait(1.0):
        pipeline.kernel_counters()
    t0 = time.monotonic()
    log.info("stopping: flushing for at most %.1fs", s.shutdown_timeout)
    pipeline.shutdown(s.shutdown_timeout)
    if gpu is not None:
        gpu.shutdown()
    if health:
        health.shutdown()
    log.info("stopped in %.2fs", time.monotonic() - t0)
    return 0
