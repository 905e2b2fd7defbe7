"""`tracejoin capture`: a one-off capture with a live view, a summary and files to keep.

Flow: start the destinations (OTLP-JSON file, Perfetto trace, optionally OTLP) and the probes;
say "capturing" once the probes are attached (the duration counts from then); while it runs,
show a live status (a redrawn line on a terminal, a plain line every few seconds otherwise) and
drain GPU samples into the Perfetto file; on the duration, SIGINT or SIGTERM, stop the probes,
drain the ring buffer, flush every destination under one deadline, then write the summary,
counters and capture details and print the summary. A signal never skips the writing.

Files (docs/capture.md): spans.otlp.jsonl, trace.perfetto.json, summary.txt, counters.json,
capture.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tracejoin.app import build_agent, capture_destinations, settle_gc
from tracejoin.commands.signals import Stop, stop_on_signals
from tracejoin.commands.summary import (
    CAPTURE_FILE,
    CAPTURE_FILES,
    COUNTERS_FILE,
    LOSS_COUNTERS,
    PERFETTO_FILE,
    SPANS_FILE,
    SUMMARY_FILE,
    Summary,
)
from tracejoin.config import Settings
from tracejoin.core.files import open_private, write_private
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import Span
from tracejoin.core.text import terminal_safe
from tracejoin.exporters.perfetto import PerfettoTraceWriter
from tracejoin.kernel.decode import HttpRecord
from tracejoin.kernel.probes import ProbeError
from tracejoin.pipeline.stages import RecordSource

log = logging.getLogger("tracejoin.capture")

TTY_REFRESH_S = 0.5
PLAIN_EVERY_S = 5.0
SHUTDOWN_S = 5.0

__all__ = ["PERFETTO_FILE", "SPANS_FILE", "run_capture"]


def _lost(m: Metrics) -> int:
    return int(
        sum(m.get(k) for k, _ in LOSS_COUNTERS if k.startswith("kernel_"))
        + m.total("decode_errors")
        + m.total("records_dropped_userspace")
        + m.total("spans_dropped")
    )


def _status_line(m: Metrics, elapsed: float, duration: float | None) -> str:
    left = f"  {max(0.0, duration - elapsed):.0f}s left" if duration else ""
    return terminal_safe(  # numbers only today; escaped so that stays true if text is added
        f"requests {int(m.get('records_received'))}  "
        f"spans written {int(m.get('spans_exported', exporter='file'))}  "
        f"lost {_lost(m)}  elapsed {elapsed:.0f}s{left}"
    )


class _Console:
    """The capture's output stream. A reader that goes away (`tracejoin capture | head`) must not
    stop the capture or the writing of its files: after the first failed write, output is
    dropped."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.broken = False
        try:
            self.tty = out.isatty()
        except (AttributeError, ValueError, OSError):
            self.tty = False

    def write(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            self.broken = True

    def line(self, text: str = "") -> None:
        self.write(text + "\n")


def _filters(s: Settings) -> str:
    parts = []
    if s.pid:
        parts.append("pid " + ", ".join(map(str, s.pid)))
    if s.port:
        parts.append("port " + ", ".join(map(str, s.port)))
    if s.comm:
        parts.append(f"comm {s.comm}")
    return "; ".join(parts)


def run_capture(
    s: Settings,
    out: TextIO | None = None,
    *,
    gpu_sampler: Any = None,
    source: RecordSource | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Run one capture; returns the exit status (0, 1 when files could not be written, 2 when
    the probes cannot load).

    `gpu_sampler`: a GpuSampler to use instead of opening NVML (tests pass one over an NVML
    double); `source`: a record source instead of the BPF probes; `on_ready`: called once the
    probes are attached, right after the "capturing" line.
    """
    with stop_on_signals() as stop:
        return _capture(s, out or sys.stdout, gpu_sampler, source, on_ready, stop)


def _capture(
    s: Settings,
    out: TextIO,
    gpu_sampler: Any,
    source: RecordSource | None,
    on_ready: Callable[[], None] | None,
    stop: Stop,
) -> int:
    con = _Console(out)
    tty = con.tty
    clear = "\r\x1b[2K" if os.environ.get("TERM") != "dumb" else "\r"
    metrics = Metrics()
    outdir = s.output_dir
    spans_path = outdir / SPANS_FILE
    perfetto = PerfettoTraceWriter(outdir / PERFETTO_FILE, time.time_ns(), close_on_shutdown=False)
    # first: a bad endpoint or setting fails before any file changes
    destinations = capture_destinations(s, metrics, spans_path, perfetto)
    summary = Summary()
    lock = threading.Lock()

    def on_spans(spans: list[Span], _rec: HttpRecord) -> None:
        with lock:
            for span in spans:  # the request's span, and its children for the example traces
                summary.add_span(span)

    agent = build_agent(
        s, metrics, destinations, source=source, gpu_sampler=gpu_sampler, observers=[on_spans]
    )
    try:
        outdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in CAPTURE_FILES:  # never mix the files of two captures
            (outdir / name).unlink(missing_ok=True)
        # present (and empty) even when nothing is captured; 0600, never through a symlink
        open_private(spans_path).close()
    except OSError as exc:  # before the probes load: nothing is lost
        print(f"tracejoin: cannot write the capture to {outdir}: {exc}", file=sys.stderr)
        return 1

    try:
        agent.start()
    except ProbeError as exc:
        print(f"tracejoin: {exc}", file=sys.stderr)
        agent.shutdown(1.0)
        perfetto.abandon()
        return 2
    settle_gc()
    status = agent.status
    gpu = agent.gpu
    notes = [f"{name} {state}" for name, state in status.signals.items() if state != "on"]
    if status.bpf_source == "compiled":  # the first start on this kernel, or nothing kept
        notes.append(f"probes {status.compile_text}")
    for note in [*notes, f"GPU: {agent.gpu_text}"]:
        con.line(textwrap.fill(note, 100, initial_indent="note: ", subsequent_indent="  "))
    until = f"for {s.duration:g}s" if s.duration else "until Ctrl-C"
    con.line(
        f"capturing {until} (probes ready in {status.load_seconds:.1f}s; "
        f"TLB signal: {status.tlb_mode}); Ctrl-C to stop"
    )
    if on_ready is not None:
        on_ready()
    t0 = time.monotonic()
    ready_ns = time.time_ns()
    elapsed = 0.0
    last_plain = t0
    try:
        while not stop.event.is_set():
            elapsed = time.monotonic() - t0
            if s.duration is not None and elapsed >= s.duration:
                break
            try:
                agent.refresh_metrics()
                if gpu is not None:
                    perfetto.add_gpu_samples(gpu.histories())
            except Exception:  # counted and logged; the capture goes on (principle 5)
                metrics.inc("capture_tick_errors")
                if metrics.get("capture_tick_errors") == 1:
                    log.exception("capture: reading counters or GPU samples failed")
            if tty:
                con.write(clear + _status_line(metrics, elapsed, s.duration))
            elif time.monotonic() - last_plain >= PLAIN_EVERY_S:
                con.line(_status_line(metrics, elapsed, s.duration))
                last_plain = time.monotonic()
            wait = TTY_REFRESH_S if tty else 0.5
            if s.duration is not None:
                wait = min(wait, max(0.0, s.duration - elapsed))
            stop.event.wait(wait)
        elapsed = time.monotonic() - t0
    finally:
        # Runs however the loop ended: the files are the point of a capture.
        agent.shutdown(SHUTDOWN_S)
        if gpu is not None:  # the histories outlive the sampler
            perfetto.add_gpu_samples(gpu.histories())
        try:
            perfetto.close({"filters": _filters(s), "gpu": agent.gpu_text})
        except OSError as exc:  # disk full, directory gone: the rest is still written
            log.error("capture: writing %s failed: %s", perfetto.path, exc)

    stopped_by = stop.first_signal or ("duration" if s.duration is not None else "?")
    final = (
        f"captured {elapsed:.1f}s (stopped by {stopped_by}): requests "
        f"{int(metrics.get('records_received'))}  spans written "
        f"{int(metrics.get('spans_exported', exporter='file'))}  lost {_lost(metrics)}"
    )
    con.line((clear if tty else "") + final)

    counters = _counters(metrics)
    summary.counters = counters
    summary.info = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ready_ns / 1e9)),
        "started_unix_ns": ready_ns,
        "duration_s": round(elapsed, 3),
        "stopped_by": stopped_by,
        "filters": _filters(s),
        "tlb_mode": status.tlb_mode,
        "signals": dict(status.signals),  # name -> "on" / "off: why" (the kernel matrix reads it)
        "gpu": agent.gpu_text,
    }
    with lock:
        text = summary.format()
        requests = summary.requests
    failed = []
    for name, content in (
        (SUMMARY_FILE, text + "\n"),
        (COUNTERS_FILE, json.dumps(counters, indent=2, sort_keys=True) + "\n"),
        (CAPTURE_FILE, json.dumps({**summary.info, "requests": requests}, indent=2) + "\n"),
    ):
        try:
            write_private(outdir / name, content)
        except OSError as exc:
            failed.append(f"{name}: {exc}")
    con.line()
    con.line(text)
    con.line()
    con.line(_files_text(outdir, any(d.name == "otlp" for d in destinations), s, metrics))
    for why in failed:  # the summary above is still whole
        print(f"tracejoin: could not write {why}", file=sys.stderr)
    return 1 if failed else 0


def _counters(metrics: Metrics) -> dict[str, float]:
    """Unlabelled series as they are; labelled ones summed under their name and kept apiece as
    name{label=value,...}."""
    out: dict[str, float] = {}
    for name, series in metrics.snapshot().items():
        for labels, value in series:
            if not labels:
                out[name] = value
                continue
            out[name] = out.get(name, 0) + value
            out[name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"] = value
    for name in ("spans_dropped", "records_dropped_userspace", "decode_errors"):
        out.setdefault(name, 0)
    return out


def _files_text(outdir: Path, otlp: bool, s: Settings, metrics: Metrics) -> str:
    lines = [f"Files in {outdir}/:"]
    for name, what in (
        (SPANS_FILE, "spans as OTLP/JSON, one ExportTraceServiceRequest per line"),
        (PERFETTO_FILE, "timeline (requests, kernel intervals, GPU): open in ui.perfetto.dev"),
        (SUMMARY_FILE, f"this summary; `tracejoin report {outdir}` prints it again"),
        (COUNTERS_FILE, "loss and self-metric counters"),
        (CAPTURE_FILE, "when, how long, filters, signals"),
    ):
        lines.append(f"  {name:<20} {what}")
    if otlp:
        sent = int(metrics.get("spans_exported", exporter="otlp"))
        dropped = int(
            sum(
                v
                for labels, v in metrics.snapshot().get("spans_dropped", [])
                if labels.get("exporter") == "otlp"
            )
        )
        where = s.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "OTLP")
        lines.append(f"Spans sent to {where}: {sent} accepted, {dropped} dropped.")
    return "\n".join(line if len(line) <= 100 else line[:97] + "..." for line in lines)
