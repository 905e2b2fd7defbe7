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
from tracejoin.app import Agent, build_agent, run_destinations, settle_gc
from tracejoin.commands.health import HealthServer
from tracejoin.commands.signals import Stop, stop_on_signals
from tracejoin.config import ConfigError, Settings
from tracejoin.core.metrics import Metrics
from tracejoin.kernel.probes import ProbeError

log = logging.getLogger(__name__)
HARD_EXIT_GRACE_S = 1.0
EXIT_OK, EXIT_START_FAILED, EXIT_HARD = 0, 2, 3


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
    metrics.set("build_info", 1, version=__version__)
    agent = build_agent(s, metrics, destinations, http2_after_ready=not s.http2_before_ready)

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
    started = threading.Event()

    def start() -> None:
        try:
            agent.start()
        except BaseException as exc:
            start_error.append(exc)
        finally:
            started.set()

    starter = threading.Thread(target=start, name="tracejoin-start", daemon=True)
    starter.start()
    # ready the moment start() returns; a signal is seen within 0.1 s
    while not started.wait(0.1) and not stop.event.is_set():
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
        metrics.set("probe_programs_from_cache", 1 if status.bpf_source == "cache" else 0)
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
        settle_gc()
        while not stop.event.wait(1.0):
            try:
                agent.tick()
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


__all__ = ["run_daemon"]
