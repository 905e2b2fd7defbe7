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
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from tracejoin import __version__
from tracejoin.app import builder_factory, file_destination, otlp_destination, start_gpu_sampler
from tracejoin.commands.health import HealthServer
from tracejoin.config import ConfigError, Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue
from tracejoin.enrich.k8s import (
    K8sResolver,
    KubeletClient,
    expand_node_name,
    parse_resource_attributes,
    resource_hook,
)
from tracejoin.kernel.probes import ProbeConfig, ProbeError
from tracejoin.pipeline.stages import Pipeline

log = logging.getLogger(__name__)
DEFAULT_SPANS_FILE = Path("tracejoin-spans.otlp.jsonl")
HARD_EXIT_GRACE_S = 1.0
EXIT_OK, EXIT_START_FAILED, EXIT_HARD = 0, 2, 3


def build_resource_hook(
    s: Settings, metrics: Metrics, environ: Mapping[str, str] | None = None
) -> Callable[[int], dict[str, AttrValue]]:
    """SpanBuilder's resource_for_pid: container/Kubernetes metadata (agent/k8s.py) over the
    OTEL_RESOURCE_ATTRIBUTES defaults. Bad values raise ConfigError naming the key."""
    env = os.environ if environ is None else environ
    try:
        env_attrs = parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    except ValueError as exc:
        raise ConfigError(f"OTEL_RESOURCE_ATTRIBUTES: {exc}") from exc
    kubelet = None
    if s.kubelet_url:
        try:
            url = expand_node_name(s.kubelet_url, s.node_name)
        except ValueError as exc:
            raise ConfigError(f"kubelet_url (--kubelet-url): {exc}") from exc
        kubelet = KubeletClient(
            url,
            token_file=s.kubelet_token_file,
            ca_file=s.kubelet_ca_file,
            insecure_tls=s.kubelet_insecure_tls,
        )
        log.info("pod metadata from the kubelet at %s", url)
    resolver = K8sResolver(metrics, node_name=s.node_name, kubelet=kubelet)
    return resource_hook(resolver, env_attrs)


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


def run_daemon(s: Settings, probe_config: ProbeConfig, spans_file: Path | None) -> int:
    metrics = Metrics()
    resource_for_pid = build_resource_hook(s, metrics)
    destinations = []
    otlp = otlp_destination(s, metrics)
    if otlp is not None:
        destinations.append(otlp)
    if spans_file is not None or otlp is None:
        destinations.append(file_destination(spans_file or DEFAULT_SPANS_FILE, s, metrics))
    metrics.set("build_info", 1, version=__version__)

    health = None
    if s.metrics_port:
        try:
            health = HealthServer(s.metrics_address, s.metrics_port, metrics)
        except OSError as exc:
            raise ConfigError(
                f"metrics_port (--metrics-port): cannot listen on "
                f"{s.metrics_address}:{s.metrics_port}: {exc.strerror or exc}"
            ) from exc
        health.start()
        log.info("health and metrics on %s:%d", s.metrics_address, health.port)

    gpu = start_gpu_sampler(s, metrics)
    if gpu is None:  # off by configuration or unavailable (the reason is logged)
        metrics.set("gpu_sampler_running", 0)
        if not s.gpu:
            metrics.set("gpu_nvml_available", 0)
    pipeline = Pipeline(
        probe_config,
        builder_factory(s, metrics, resource_for_pid=resource_for_pid),
        destinations,
        metrics,
        gpu=gpu,
        gpu_hold_s=3.0 / s.gpu_sample_hz,
    )
    if health is not None:
        health.pipeline = pipeline

    stop = threading.Event()
    stop_at: list[float] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            hard_exit(EXIT_HARD, f"second {signal.Signals(signum).name}: exiting now")
        stop_at.append(time.monotonic())
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Compiling takes seconds and a C call cannot be interrupted: start in a thread so a
    # SIGTERM during start-up is still answered within the bound.
    start_error: list[BaseException] = []

    def start() -> None:
        try:
            pipeline.start()
        except BaseException as exc:
            start_error.append(exc)

    starter = threading.Thread(target=start, name="tracejoin-start", daemon=True)
    starter.start()
    while starter.is_alive() and not stop.wait(0.1):
        pass

    if not stop.is_set():
        if start_error:
            err = start_error[0]
            if isinstance(err, ProbeError):
                log.error("%s", err)
            else:
                log.error("start-up failed", exc_info=err)
            pipeline.shutdown(1.0)
            if gpu is not None:
                gpu.shutdown()
            if health is not None:
                health.shutdown()
            return EXIT_START_FAILED
        status = pipeline.probes.status
        metrics.set("probes_loaded", 1)
        metrics.set("probe_load_seconds", round(status.load_seconds, 3))
        metrics.set("ready", 1)
        if health is not None:
            health.loaded = True
        log.info(
            "ready: probes loaded in %.1fs; signals %s; TLB %s",
            status.load_seconds,
            status.signals,
            status.tlb_mode,
        )
        while not stop.wait(1.0):
            try:
                pipeline.kernel_counters()
            except Exception:
                log.exception("reading kernel counters failed")

    # ---- shutdown: bounded from the signal on
    t0 = stop_at[0] if stop_at else time.monotonic()
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
    pipeline.shutdown(max(0.1, deadline - time.monotonic()))
    log.debug("pipeline stopped at +%.2fs", time.monotonic() - t0)
    metrics.set("probes_loaded", 0)
    if gpu is not None:
        stopper = threading.Thread(target=gpu.shutdown, daemon=True, name="tracejoin-gpu-stop")
        stopper.start()
        stopper.join(max(0.1, deadline - time.monotonic()))
    if health is not None:
        health.shutdown()
    counters = " ".join(f"{k}={v}" for k, v in final_counters(metrics).items())
    log.info("stopped in %.2fs; %s", time.monotonic() - t0, counters)
    return EXIT_OK


__all__ = ["build_resource_hook", "run_daemon"]
