"""`tracejoin capture`: a one-off capture with a live view, a summary and files to keep."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from agent.cli import (
    _builder_factory,
    _file_destination,
    _otlp_destination,
    install_signal_handlers,
    start_gpu_sampler,
)
from agent.config import Settings
from agent.decode import HttpRecord
from agent.metrics import Metrics
from agent.model import Span
from agent.pipeline import Pipeline
from agent.probes import ProbeConfig, ProbeError
from agent.summary import Summary

SPANS_FILE = "spans.otlp.jsonl"


def _status_line(m: Metrics, elapsed: float, duration: float | None) -> str:
    left = f", {max(0.0, duration - elapsed):.0f}s left" if duration else ""
    lost = (
        m.get("kernel_ringbuf_full")
        + m.total("spans_dropped")
        + m.total("records_dropped_userspace")
    )
    return (
        f"requests {int(m.get('requests_seen'))}  spans {int(m.get('spans_built'))}  "
        f"lost {int(lost)}  elapsed {elapsed:.0f}s{left}"
    )


def run_capture(s: Settings, probe_config: ProbeConfig, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    tty = out.isatty()
    metrics = Metrics()
    s.output_dir.mkdir(parents=True, exist_ok=True)
    spans_path = s.output_dir / SPANS_FILE
    spans_path.unlink(missing_ok=True)
    destinations = [_file_destination(spans_path, s, metrics)]
    otlp = _otlp_destination(s, metrics)
    if otlp is not None:
        destinations.append(otlp)
    summary = Summary()
    lock = threading.Lock()

    def on_spans(spans: list[Span], _rec: HttpRecord) -> None:
        metrics.inc("requests_seen")
        with lock:
            summary.add_span(spans[0])

    gpu = start_gpu_sampler(s, metrics)
    gpu_join = gpu.join if gpu is not None else None
    pipeline = Pipeline(
        probe_config,
        _builder_factory(s, metrics, gpu_join),
        destinations,
        metrics,
        on_spans=on_spans,
    )
    stop = threading.Event()
    install_signal_handlers(stop)
    t0 = time.monotonic()
    try:
        pipeline.start()
    except ProbeError as exc:
        print(f"tracejoin: {exc}", file=sys.stderr)
        pipeline.shutdown(1.0)
        return 2
    for name, state in pipeline.probes.status.signals.items():
        if state != "on":
            print(f"note: {name} {state}", file=out)
    print(
        f"capturing (probes ready in {pipeline.probes.status.load_seconds:.1f}s; TLB signal: "
        f"{pipeline.probes.status.tlb_mode}); Ctrl-C to stop",
        file=out,
        flush=True,
    )
    last_line = 0.0
    try:
        while not stop.is_set():
            elapsed = time.monotonic() - t0
            if s.duration is not None and elapsed >= s.duration:
                break
            now = time.monotonic()
            pipeline.kernel_counters()
            if tty:
                out.write("\r\x1b[2K" + _status_line(metrics, elapsed, s.duration))
                out.flush()
            elif now - last_line >= 5.0:
                print(_status_line(metrics, elapsed, s.duration), file=out, flush=True)
                last_line = now
            stop.wait(0.5)
    finally:
        pipeline.shutdown(5.0)
        if gpu is not None:
            gpu.shutdown()
    if tty:
        out.write("\n")
    counters = {k: v for k, vals in metrics.snapshot().items() for labels, v in vals if not labels}
    counters["spans_dropped"] = metrics.total("spans_dropped")
    counters["records_dropped_userspace"] = metrics.total("records_dropped_userspace")
    counters["decode_errors"] = metrics.total("decode_errors")
    summary.counters = counters
    text = summary.format()
    (s.output_dir / "summary.txt").write_text(text + "\n")
    (s.output_dir / "counters.json").write_text(json.dumps(counters, indent=2, sort_keys=True))
    print(text, file=out)
    print(f"\nfiles: {spans_path} (OTLP-JSON), {s.output_dir / 'summary.txt'}", file=out)
    return 0
