"""Spans and GPU samples -> Chrome trace-event JSON, the format ui.perfetto.dev and
chrome://tracing open (the "Trace Event Format", JSON Object Format:
{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}).

What goes where (docs/capture.md shows it in the UI):

- Each span is one "X" (complete) event: `ts` and `dur` in microseconds, `ts` counted from
  `origin_ns` (a Unix-epoch instant, kept in otherData.origin_unix_ns) so that doubles keep
  nanosecond precision. `args` carry the trace id, span id, parent span id, status and every
  span attribute, so clicking a slice shows what the span in Jaeger shows.
- Tracks: pid = the process that served the request (resource `process.pid`), tid = the thread
  that read it (`thread.id`). Child spans (`tcp.receive_queue_wait`, `sched.runq_wait`) go on
  their server span's track, nested under it; so do a CUDA synchronisation's (category
  "cuda", bpf/cuda.h) when the reader waited, else it goes on the helper's track. A work-set
  helper's span (a child carrying its own
  `process.pid` and `thread.id`: a pool thread, a worker process) goes on that thread's track, so
  each helper thread shows the slices of the requests it worked for.
- Slices on one track must nest. Requests that overlap on one thread without nesting (an event
  loop serving several connections, pipelining) go to overflow tracks of the same process,
  named "<thread> (overlapping requests k)", tid = k * LANE_STRIDE + thread id.
- "M" metadata events name each process (resource `service.name`, `process.executable.name`)
  and thread (span attribute `thread.name` where the span has one) and sort GPU processes after
  the served ones. Everything comes from the spans and histories given: nothing is read from
  /proc here (the process may be gone by the time a span is written, or be another one).
- GPU samples are "C" counter events in one process per GPU (pid GPU_PID_BASE + index): kernel
  active % and memory-controller busy % (NVML utilisation: share of time a kernel ran / memory
  was read or written -- not SM occupancy), and from each sampler tick memory used, power, SM
  clock and, where the GPU has them, GPM SM and DRAM-bandwidth utilisation. A utilisation sample
  describes the interval since the previous one, so its counter value starts at that interval's
  start; tick readings are placed at the tick.

`PerfettoTraceWriter` streams events to a file as spans arrive (memory stays bounded however
long the capture), behind a BatchExportQueue like any other SpanExporter; `trace_document`
builds the same document in memory.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tracejoin.core.files import open_private
from tracejoin.core.gpu import DeviceHistory
from tracejoin.core.model import KIND_SERVER, STATUS_ERROR, STATUS_OK, Span
from tracejoin.exporters.base import ExportResult

# Linux pid_max is at most 2^22: synthetic ids above it never collide with real pids/tids.
LANE_STRIDE = 1 << 22
GPU_PID_BASE = 1 << 23
MAX_LANES = 64  # beyond this many concurrent overlapping requests, the last lane is shared
_SPAN_TRACK_MEMORY = 65536  # recent server spans remembered, to place late children

_STATUS_TEXT = {STATUS_OK: "OK", STATUS_ERROR: "ERROR"}

# (counter name suffix, DeviceState field, scale, unit) for per-tick GPU readings.
_STATE_COUNTERS: tuple[tuple[str, str, float, str], ...] = (
    ("memory used", "memory_used", 1 / (1024 * 1024), "MiB"),
    ("power", "power_w", 1.0, "W"),
    ("SM clock", "sm_clock_mhz", 1.0, "MHz"),
    ("GPM SM util", "gpm_sm_util", 100.0, "%"),
    ("GPM DRAM bandwidth", "gpm_dram_bw_util", 100.0, "%"),
)


def _is_request(span: Span) -> bool:
    """A request's span: SERVER, or beside an instrumented server the INTERNAL "(kernel)" one
    (it says how the server was found instrumented)."""
    return span.kind == KIND_SERVER or "tracejoin.instrumented.source" in span.attributes


def _category(span: Span) -> str:
    """http: a request; cuda: a CUDA synchronisation it waited in; kernel: other intervals."""
    if _is_request(span):
        return "http"
    return "cuda" if "tracejoin.cuda.sync.wait_ns" in span.attributes else "kernel"


def _us(ns: int) -> float:
    """Nanoseconds -> microseconds, exact to the nanosecond in the JSON text."""
    return round(ns / 1000, 3)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _arg(value: object) -> object:
    return value if isinstance(value, str | int | float | bool) else str(value)


class TraceEventEncoder:
    """Turns spans and GPU histories into trace events, keeping the track state (lanes, names
    already emitted, GPU samples already written) between calls. Not thread-safe by itself."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self._named_processes: set[int] = set()
        self._named_threads: set[tuple[int, int]] = set()
        # (pid, tid) -> per lane, the latest end (ns) of a slice placed on it
        self._lanes: dict[tuple[int, int], list[int]] = {}
        # server span id -> (pid, track tid), for children that arrive in a later batch
        self._span_tracks: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        # (gpu index, series name) -> end of the newest sample already written
        self._gpu_done: dict[tuple[int, str], int] = {}

    # ---- spans ---------------------------------------------------------------------------

    def span_events(self, spans: Iterable[Span]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for span in spans:
            pid, tid = self._track(span, out)
            out.append(self._complete(span, pid, tid))
        return out

    def _track(self, span: Span, out: list[dict[str, Any]]) -> tuple[int, int]:
        pid = _int(span.resource.get("process.pid")) or 0
        helper_pid = _int(span.attributes.get("process.pid"))
        request = _is_request(span)
        helper = not request and bool(helper_pid) and "thread.id" in span.attributes
        if not request and not helper and span.parent_span_id in self._span_tracks:
            return self._span_tracks[span.parent_span_id]
        if helper and helper_pid != pid:
            pid = helper_pid or 0
            self._name_helper_process(pid, span, out)
        tid = _int(span.attributes.get("thread.id")) or pid
        self._name_process(pid, span, out)
        lanes = self._lanes.setdefault((pid, tid), [])
        lane = next((i for i, end in enumerate(lanes) if span.start_ns >= end), None)
        if lane is None:
            if len(lanes) < MAX_LANES:
                lanes.append(0)
            lane = len(lanes) - 1
        lanes[lane] = max(lanes[lane], span.end_ns)
        track = tid + lane * LANE_STRIDE
        self._name_thread(pid, tid, lane, span, out)
        self._span_tracks[span.span_id] = (pid, track)
        if len(self._span_tracks) > _SPAN_TRACK_MEMORY:
            self._span_tracks.popitem(last=False)
        return pid, track

    def _name_process(self, pid: int, span: Span, out: list[dict[str, Any]]) -> None:
        if pid in self._named_processes:
            return
        self._named_processes.add(pid)
        service = span.resource.get("service.name")
        exe = span.resource.get("process.executable.name")
        name = str(service or exe or f"pid {pid}")
        if exe and service and exe != service:
            name += f" ({exe})"
        out.append(_meta("process_name", pid, pid, {"name": name}))
        out.append(_meta("process_sort_index", pid, pid, {"sort_index": 0}))

    def _name_helper_process(self, pid: int, span: Span, out: list[dict[str, Any]]) -> None:
        """A worker process seen only through a helper span: named after it (process/thread)."""
        if pid in self._named_processes:
            return
        self._named_processes.add(pid)
        name = f"{span.name.split('/', 1)[0]} (pid {pid})"
        out.append(_meta("process_name", pid, pid, {"name": name}))
        out.append(_meta("process_sort_index", pid, pid, {"sort_index": 0}))

    def _name_thread(
        self, pid: int, tid: int, lane: int, span: Span, out: list[dict[str, Any]]
    ) -> None:
        if (pid, tid + lane * LANE_STRIDE) in self._named_threads:
            return
        self._named_threads.add((pid, tid + lane * LANE_STRIDE))
        comm = span.attributes.get("thread.name")
        name = f"{comm} {tid}" if isinstance(comm, str) and comm else f"thread {tid}"
        if lane:
            name += f" (overlapping requests {lane})"
        track = tid + lane * LANE_STRIDE
        out.append(_meta("thread_name", pid, track, {"name": name}))
        out.append(_meta("thread_sort_index", pid, track, {"sort_index": tid * MAX_LANES + lane}))

    def _complete(self, span: Span, pid: int, tid: int) -> dict[str, Any]:
        status = _STATUS_TEXT.get(span.status_code, "UNSET")
        if span.status_message:
            status += f": {span.status_message}"
        args: dict[str, Any] = {
            "trace_id": span.trace_id_hex,
            "span_id": span.span_id_hex,
        }
        if span.parent_span_id:
            args["parent_span_id"] = f"{span.parent_span_id:016x}"
        args["status"] = status
        for k, v in span.attributes.items():
            args[k] = _arg(v)
        return {
            "name": span.name,
            "cat": _category(span),
            "ph": "X",
            "ts": _us(span.start_ns - self.origin_ns),
            "dur": _us(max(0, span.end_ns - span.start_ns)),
            "pid": pid,
            "tid": tid,
            "args": args,
        }

    # ---- GPU -----------------------------------------------------------------------------

    def gpu_events(self, histories: Iterable[DeviceHistory]) -> list[dict[str, Any]]:
        """Counter events for the samples not written yet (call it repeatedly: the sampler's
        rings are bounded, so a long capture should drain them as it goes)."""
        out: list[dict[str, Any]] = []
        for h in histories:
            pid = GPU_PID_BASE + h.index
            with h.lock:
                kernel = self._new(h.index, "kernel", h.kernel_active.starts, h.kernel_active.ends)
                kernel_v = h.kernel_active.values[len(h.kernel_active) - len(kernel) :]
                membusy = self._new(h.index, "membusy", h.memory_busy.starts, h.memory_busy.ends)
                membusy_v = h.memory_busy.values[len(h.memory_busy) - len(membusy) :]
                ticks = self._new(h.index, "state", h.state.starts, h.state.ends)
                states = h.state.values[len(h.state) - len(ticks) :]
            if not (kernel or membusy or ticks):
                continue
            if pid not in self._named_processes:
                self._named_processes.add(pid)
                label = f"GPU {h.index}: {h.name} {h.uuid}".strip()
                out.append(_meta("process_name", pid, pid, {"name": label}))
                out.append(_meta("process_sort_index", pid, pid, {"sort_index": 1_000_000}))
            prefix = f"GPU {h.index}"
            for (start, _end), v in zip(kernel, kernel_v, strict=True):
                out.append(self._counter(pid, f"{prefix} kernel active", start, v * 100, "%"))
            for (start, _end), v in zip(membusy, membusy_v, strict=True):
                name = f"{prefix} memory controller busy"
                out.append(self._counter(pid, name, start, v * 100, "%"))
            for (_start, end), state in zip(ticks, states, strict=True):
                for suffix, fld, scale, unit in _STATE_COUNTERS:
                    value = getattr(state, fld)
                    if value is not None:
                        name = f"{prefix} {suffix}"
                        out.append(self._counter(pid, name, end, value * scale, unit))
        return out

    def _new(
        self, index: int, series: str, starts: Sequence[int], ends: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(start, end) of the samples newer than the last call's, oldest first."""
        done = self._gpu_done.get((index, series), 0)
        i = len(ends)
        while i > 0 and ends[i - 1] > done:
            i -= 1
        new = list(zip(starts[i:], ends[i:], strict=True))
        if new:
            self._gpu_done[(index, series)] = new[-1][1]
        return new

    def _counter(self, pid: int, name: str, t_ns: int, value: float, unit: str) -> dict[str, Any]:
        # The unit is the series key: Perfetto names the track "<name> <key>" ("GPU 0 power W"),
        # chrome://tracing shows the key as the series of the "<name>" counter.
        return {
            "name": name,
            "cat": "gpu",
            "ph": "C",
            "ts": _us(t_ns - self.origin_ns),
            "pid": pid,
            "tid": pid,
            "args": {unit: round(float(value), 3)},
        }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _other_data(origin_ns: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "producer": "tracejoin",
        "origin_unix_ns": origin_ns,
        "origin_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(origin_ns / 1e9)),
        "timestamps": "ts/dur in microseconds; ts counted from origin_unix_ns",
    }
    data.update(extra or {})
    return data


def trace_document(
    spans: Iterable[Span],
    histories: Iterable[DeviceHistory] = (),
    origin_ns: int | None = None,
) -> dict[str, Any]:
    """The whole trace-event document in memory. origin_ns None: the earliest span start."""
    spans = list(spans)
    if origin_ns is None:
        origin_ns = min((s.start_ns for s in spans), default=time.time_ns())
    enc = TraceEventEncoder(origin_ns)
    events = enc.span_events(spans) + enc.gpu_events(histories)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": _other_data(origin_ns),
    }


class PerfettoTraceWriter:
    """A SpanExporter that streams trace events to `path` (JSON Object Format).

    Events go to `<path>.partial` as they come; `close()` appends otherData, closes the JSON
    and renames the file into place, so `path` only ever holds a complete document. With
    `close_on_shutdown` (the default) the queue's shutdown closes it; a capture passes False
    so it can add the last GPU samples after the span queues have drained, then calls close().
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        origin_ns: int | None = None,
        *,
        close_on_shutdown: bool = True,
    ) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.origin_ns = origin_ns if origin_ns is not None else time.time_ns()
        self.close_on_shutdown = close_on_shutdown
        self._enc = TraceEventEncoder(self.origin_ns)
        self._lock = threading.Lock()
        self._file: Any = None
        self._first = True
        self._accepting = True
        self._closed = False
        self.events_written = 0

    def _write(self, events: list[dict[str, Any]]) -> None:
        """Append events; the caller holds the lock."""
        if self._file is None:
            self._file = open_private(self.partial, "w", errors="replace")  # 0600, no symlinks
            self._file.write('{"traceEvents":[\n')
        if not events:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False
        self._file.flush()
        self.events_written += len(events)

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        with self._lock:
            if not self._accepting:
                return ExportResult.fail("perfetto writer is shut down")
            try:
                self._write(self._enc.span_events(spans))
            except OSError as err:
                return ExportResult.fail(f"write {self.partial}: {err}")
        return ExportResult.SUCCESS

    def add_gpu_samples(self, histories: Iterable[DeviceHistory]) -> int:
        """Write the GPU samples recorded since the last call; returns how many events."""
        with self._lock:
            if self._closed:
                return 0
            events = self._enc.gpu_events(histories)
            self._write(events)
            return len(events)

    def shutdown(self) -> None:
        with self._lock:
            self._accepting = False
        if self.close_on_shutdown:
            self.close()

    def close(self, other_data: dict[str, Any] | None = None) -> Path:
        """Finish the document and move it into place. Idempotent."""
        with self._lock:
            self._accepting = False
            if self._closed:
                return self.path
            self._closed = True
            self._write([])
            tail = {"displayTimeUnit": "ms", "otherData": _other_data(self.origin_ns, other_data)}
            self._file.write("\n]," + json.dumps(tail)[1:] + "\n")
            f, self._file = self._file, None
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()
            os.replace(self.partial, self.path)
            return self.path

    def abandon(self) -> None:
        """Close without finishing (a failed start): leaves no file behind."""
        with self._lock:
            self._accepting = False
            self._closed = True
            f, self._file = self._file, None
        if f is not None:
            f.close()
        with contextlib.suppress(OSError):
            self.partial.unlink()

    def __repr__(self) -> str:
        return f"PerfettoTraceWriter({str(self.path)!r})"
