"""The composition root: builds the agent from settings, in one place."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click
from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.kernel.probes import OPTIONAL_TRACEPOINTS, ProbeConfig

log = logging.getLogger("tracejoin")


def probe_config(s: Settings) -> ProbeConfig:
    unknown = [tp for tp in s.disable_tracepoint if tp not in OPTIONAL_TRACEPOINTS]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)} is not an optional tracepoint (choose from "
            f"{', '.join(OPTIONAL_TRACEPOINTS)})",
            param_hint="--disable-tracepoint",
        )
    return ProbeConfig(
        pids=s.pid,
        ports=s.port,
        comm=s.comm,
        runq_threshold_ns=int(s.runq_threshold_ms * 1e6),
        disabled_tracepoints=frozenset(s.disable_tracepoint),
        tlb_hardware={"auto": None, "hardware": True, "flush": False}[s.tlb],
    )


def otlp_destination(s: Settings, metrics: Metrics) -> Any | None:
    """An OTLP queue when an endpoint is configured (flag or OTEL_* variables)."""
    from tracejoin.exporters.config import exporter_from_env
    from tracejoin.exporters.queue import BatchExportQueue

    env = os.environ
    if not (
        s.otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    # the flag wins over the OTEL_* variables; errors name the flag's key
    overrides = {"endpoint": s.otlp_endpoint, "protocol": s.otlp_protocol}
    if s.otlp_endpoint:
        overrides["traces_endpoint"] = None
    try:
        exporter = exporter_from_env(env, overrides)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    return BatchExportQueue(exporter, metrics, max_queue_spans=s.queue_size, name="otlp")


def file_destination(path: Path, s: Settings, metrics: Metrics) -> Any:
    from tracejoin.exporters.file_sender import JsonLinesFileExporter
    from tracejoin.exporters.queue import BatchExportQueue

    return BatchExportQueue(
        JsonLinesFileExporter(path),
        metrics,
        max_queue_spans=s.queue_size,
        name="file",
        flush_interval_s=0.5,
    )


def start_gpu_sampler(s: Settings, metrics: Metrics) -> Any:
    """The NVML sampler when --gpu and NVML works; None otherwise (reported, never fatal)."""
    if not s.gpu:
        return None
    from tracejoin.enrich.gpu_sampler import GpuSampler

    sampler = GpuSampler(metrics, interval_s=1.0 / s.gpu_sample_hz)
    status = sampler.start()
    if not status.available:
        log.info("GPU signal off: %s", status.reason)
        sampler.shutdown()
        return None
    return sampler


def builder_factory(s: Settings, metrics: Metrics, resource_for_pid: Any = None) -> Any:
    from tracejoin.pipeline.spans import SpanBuilder

    def make(tlb_mode: str) -> SpanBuilder:
        return SpanBuilder(
            metrics,
            service_name=s.service_name,
            no_parent=s.no_parent,
            unsampled=s.unsampled,
            runq_child_threshold_ns=int(s.runq_threshold_ms * 1e6),
            tlb_mode=tlb_mode,
            resource_for_pid=resource_for_pid,
        )

    return make
