"""`tracejoin run`: the unattended agent. Exports until SIGTERM, serves health and metrics,
and on SIGTERM detaches the probes and flushes within the configured bound.

Shutdown bound (docs/operations.md): from SIGTERM (or SIGINT) the probes detach first, then the
destinations flush in parallel for what is left of --shutdown-timeout; the process is gone at
most HARD_EXIT_GRACE_S after that, whatever a destination or the interpreter does: a watchdog
then exits hard, and the kernel releases every BPF program and map with the process's file
descriptors. A second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

from tracejoin import __version__
from tracejoin.app import Agent, build_agent, run_destinations
from tracejoin.commands.health import HealthServer
from tracejoin.commands.signals import Stop, stop_on_signals
from tracejoin.config import ConfigError, Settings
from tracejoin.core.metrics import Metrics
from tracejoin.enrich import traceparent
from tracejoin.kernel.decode import KERNEL_COUNTERS
from tracejoin.kernel.probes import ProbeError

log = logging.getLogger(__name__)
HARD_EXIT_GRACE_S = 1.0
EXIT_OK, EXIT_START_FAILED, EXIT_HARD = 0, 2, 3

_KERNEL_HELP = {
    "records_submitted": "Records the kernel tried to put in the ring buffer.",
    "ringbuf_full": "Records lost in the kernel: the ring buffer had no room.",
    "pipeline_slots_full": "Requests not tracked: too many pipelined on one connection.",
    "non_http_connections": "Connections whose first read was not HTTP/1.x.",
    "request_state_lost": "Request state evicted from the kernel's LRU map before its response.",
    "read_copy_failed": "Request buffers the kernel could not copy from user memory.",
}


def declare_metrics(metrics: Metrics, exporters: list[str]) -> None:
    """HELP for every self-metric, and a zero for every counter series known up front, so
    dashboards and rate() see each series from the first scrape (docs/attributes.md)."""
    for name, text in _KERNEL_HELP.items():
        metrics.describe("kernel_" + name, text, kind="counter")
    for name in KERNEL_COUNTERS.values():
        if name not in _KERNEL_HELP:
            metrics.describe("kernel_" + name, "Kernel-side counter " + name, kind="counter")
        metrics.set("kernel_" + name, 0)  # until the probes are loaded and read
    metrics.describe(
        "probe_mode",
        "1 when a signal's probes are loaded, 0 when it is off; tlb_<mode> is the TLB signal "
        "in use (tlb_hardware, tlb_flush_fallback or tlb_off).",
    )
    metrics.describe("probes_loaded", "1 once the BPF programs are attached.")
    metrics.describe("probe_load_seconds", "Seconds compiling and attaching the BPF programs.")
    metrics.describe("ready", "1 while /readyz answers 200.")
    metrics.describe("build_info", "Always 1; the version label is tracejoin's.")
    for name, text in (
        ("records_received", "Records read from the kernel ring buffer."),
        ("spans_built", "Spans built (server and child spans)."),
        ("traceparent_rejected", "Requests whose traceparent broke the W3C rules, by reason."),
        ("requests_unsampled", "Requests whose caller did not sample them (no span)."),
        ("records_dropped_userspace", "Records read but not turned into spans, by reason."),
    ):
        metrics.describe(name, text)
    metrics.describe("decode_errors", "Ring-buffer records that could not be decoded, by reason.")
    metrics.describe("reader_errors", "Ring-buffer polls that raised (the reader goes on).")
    metrics.set("build_info", 1, version=__version__)
    metrics.set("ready", 0)
    metrics.set("probes_loaded", 0)
    for name in ("records_received", "spans_built", "requests_unsampled", "reader_errors"):
        metrics.inc(name, 0)
    for reason in traceparent.REASONS:
        metrics.inc("traceparent_rejected", 0, reason=reason)
    for reason in ("undecodable", "build_error"):
        metrics.inc("records_dropped_userspace", 0, reason=reason)
    for reason in ("empty", "unknown_type", "short"):
        metrics.inc("decode_errors", 0, reason=reason)
    for exporter in exporters:
        metrics.inc("spans_exported", 0, exporter=exporter)
        metrics.inc("export_retries", 0, exporter=exporter)
        metrics.inc("export_failures", 0, exporter=exporter)
        for reason in ("queue_full", "export_failed", "rejected", "shutdown"):
            metrics.inc("spans_dropped", 0, exporter=exporter, reason=reason)


def final_counters(metrics: Metrics) -> dict[str, int]:
    """The loss accounting, summed over labels, as logged when the agent stops."""
    names = (
        "records_received",
        "kernel_ringbuf_full",
        "records_dropped_userspace",
        "traceparent_rejected",
        "spans_built",
        "spans_exported",
        "spans_dropped",
        "export_failures",
        "export_retries",
    )
    snap = metrics.snapshot()
    return {n: int(sum(v for _, v in snap.get(n, []))) for n in names}


class _Watchdog:
    """Exits the process hard at a deadline unless the process has exited by itself."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._thread = threading.Thread(target=self._run, daemon=True, name="tracejoin-watchdog")
        self._thread.start()

    def _run(self) -> None:
        while (left := self.deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        hard_exit(EXIT_HARD, "shutdown overran its bound; exiting now")


def hard_exit(code: int, why: str) -> None:
    """Leave now: closing the process's descriptors detaches and unloads every BPF program."""
    log.error("%s", why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def run_daemon(s: Settings, spans_file: Path | None) -> int:
    metrics = Metrics()
    destinations = run_destinations(s, metrics, spans_file)
    declare_metrics(metrics, [d.name for d in destinations if d.name])
    agent = build_agent(s, metrics, destinations)

    health = None
    if s.metrics_port:
        try:
            health = HealthServer(s.metrics_address, s.metrics_port, metrics, agent)
        except OSError as exc:
            raise ConfigError(
                f"metrics_port (--metrics-port): cannot listen on "
                f"{s.metrics_address}:{s.metrics_port}: {exc.strerror or exc}"
            ) from exc
        health.start()
        log.info("health and metrics on %s:%d", s.metrics_address, health.port)

    def second_signal(name: str) -> None:
        hard_exit(EXIT_HARD, f"second {name}: exiting now")

    with stop_on_signals(on_repeat=second_signal) as stop:
        return _run(s, agent, metrics, health, stop)


def _run(
    s: Settings, agent: Agent, metrics: Metrics, health: HealthServer | None, stop: Stop
) -> int:
    # Compiling takes seconds and a C call cannot be interrupted: start in a thread so a
    # SIGTERM during start-up is still answered within the bound.
    start_error: list[BaseException] = []

    def start() -> None:
        try:
            agent.start()
        except BaseException as exc:
            start_error.append(exc)

    starter = threading.Thread(target=start, name="tracejoin-start", daemon=True)
    starter.start()
    while starter.is_alive() and not stop.event.wait(0.1):
        pass

    if not stop.event.is_set():
        if start_error:
            err = start_error[0]
            if isinstance(err, ProbeError):
                log.error("%s", err)
            else:
                log.error("start-up failed", exc_info=err)
            agent.shutdown(1.0)
            if health is not None:
                health.shutdown()
            return EXIT_START_FAILED
        status = agent.status
        metrics.set("probes_loaded", 1)
        metrics.set("probe_load_seconds", round(status.load_seconds, 3))
        metrics.set("ready", 1)
        if health is not None:
            health.loaded = True
        log.info(
            "ready: probes loaded in %.1fs; signals %s; TLB %s; GPU %s",
            status.load_seconds,
            status.signals,
            status.tlb_mode,
            agent.gpu_text,
        )
        while not stop.event.wait(1.0):
            try:
                agent.kernel_counters()
            except Exception:
                log.exception("reading kernel counters failed")

    # ---- shutdown: bounded from the signal on
    t0 = stop.first_at or time.monotonic()
    deadline = t0 + s.shutdown_timeout
    _Watchdog(deadline + HARD_EXIT_GRACE_S)  # lives until the process exits
    if health is not None:
        health.stopping = True
    metrics.set("ready", 0)
    log.info("stopping: detaching probes, flushing for at most %.1fs", s.shutdown_timeout)
    if starter.is_alive():
        starter.join(max(0.0, deadline - time.monotonic()))
        if starter.is_alive():
            hard_exit(EXIT_HARD, "still loading probes at the shutdown deadline; exiting now")
    agent.shutdown(max(0.1, deadline - time.monotonic()))
    log.debug("agent stopped at +%.2fs", time.monotonic() - t0)
    metrics.set("probes_loaded", 0)
    if health is not None:
        health.shutdown()
    counters = " ".join(f"{k}={v}" for k, v in final_counters(metrics).items())
    log.info("stopped in %.2fs; %s", time.monotonic() - t0, counters)
    return EXIT_OK


__all__ = ["declare_metrics", "run_daemon"]
