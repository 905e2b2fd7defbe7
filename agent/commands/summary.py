"""The capture summary: per endpoint, where the time went; the slowest requests by trace id;
an example trace tree for a server that makes its own spans and for one that does not; the loss
counters. Computed from tracejoin's request spans (SERVER, or INTERNAL "(kernel)" beside an
instrumented server) and their children, so `tracejoin report` recomputes it from the saved
OTLP-JSON file exactly as `capture` printed it.

Memory per request is a few floats (per-endpoint arrays), not the span: a capture that runs for
hours still summarises in bounded space per request. Every line fits in WIDTH columns.

The text goes to root's terminal (and summary.txt is meant to be `cat`-ed), while span names come
from any HTTP client and a report may read files from anywhere: every line is passed through
terminal_safe, and names are escaped before they are measured for the table.
"""

from __future__ import annotations

import heapq
import json
import math
import textwrap
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracejoin.core.metrics import AGG_BUCKET_BOUNDS
from tracejoin.core.model import KIND_INTERNAL, KIND_SERVER, STATUS_ERROR, Span
from tracejoin.core.text import terminal_safe
from tracejoin.pipeline.spans import GRPC_CODE_NAMES

WIDTH = 100
NAME = 20  # endpoint column; longer names get a line of their own
CELL = 10  # one component column: "p50/p99"
WORK_NAME, WORK_CELL = 16, 12  # the work-set table: its cells may read "~1.8k/~2.0k"
SLOWEST = 5

SPANS_FILE = "spans.otlp.jsonl"
SUMMARY_FILE = "summary.txt"
COUNTERS_FILE = "counters.json"
CAPTURE_FILE = "capture.json"
PERFETTO_FILE = "trace.perfetto.json"
CAPTURE_FILES = (SPANS_FILE, PERFETTO_FILE, SUMMARY_FILE, COUNTERS_FILE, CAPTURE_FILE)

Attrs = Mapping[str, object]


def _num(attrs: Attrs, key: str) -> float | None:
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _scaled(key: str, scale: float) -> Callable[[Attrs], float | None]:
    def get(attrs: Attrs) -> float | None:
        v = _num(attrs, key)
        return None if v is None else v * scale

    return get


def _faults(attrs: Attrs) -> float | None:
    minor = _num(attrs, "tracejoin.mm.minor_faults")
    major = _num(attrs, "tracejoin.mm.major_faults")
    if minor is None and major is None:
        return None
    return (minor or 0.0) + (major or 0.0)


def _tlb(attrs: Attrs) -> float | None:
    # One TLB signal per span (docs/attributes.md): hardware misses where a PMU exists,
    # else kernel-initiated flushes. The legend says which ones the capture had.
    v = _num(attrs, "tracejoin.tlb.dtlb_load_misses")
    return v if v is not None else _num(attrs, "tracejoin.tlb.flushes")


@dataclass(frozen=True, slots=True)
class Component:
    column: str
    legend: str
    value: Callable[[Attrs], float | None]


COMPONENTS: tuple[Component, ...] = (
    Component(
        "recvq ms",
        "recvq: receive-queue wait, bytes queued on the socket until the server read them",
        _scaled("tracejoin.tcp.receive_queue_wait_ns", 1e-6),
    ),
    Component(
        "runq ms",
        "runq: run-queue delay (runnable, not running) of the request's work set (its own part; "
        "the reading thread alone without the workset signal), summed",
        _scaled("tracejoin.sched.runq_wait_ns", 1e-6),
    ),
    Component(
        "faults",
        "faults: page faults of the work set (own part; the reading thread alone without the "
        "workset signal), minor + major",
        _faults,
    ),
    Component("tlb", "", _tlb),  # legend depends on the TLB signal: see _tlb_legend
    Component(
        "gpu %",
        "gpu: share of the request's time a GPU kernel ran (NVML, device-wide)",
        _scaled("tracejoin.gpu.kernel_active.ratio.avg", 100.0),
    ),
)


def _grpc_name(code: int) -> str:
    return GRPC_CODE_NAMES[code] if 0 <= code < len(GRPC_CODE_NAMES) else str(code)


def _others_cpu_ms(attrs: Attrs) -> float | None:
    total = _num(attrs, "tracejoin.work.on_cpu_ns")
    reader = _num(attrs, "tracejoin.work.reader_on_cpu_ns")
    return None if total is None or reader is None else max(0.0, total - reader) * 1e-6


def _shared(key: str, scale: float) -> Callable[[Attrs], float | None]:
    """A shared part: 0 for a request whose work set shared nothing, None without a work set."""

    def get(attrs: Attrs) -> float | None:
        if _num(attrs, "tracejoin.work.shared_with_max") is None:
            return None
        return (_num(attrs, key) or 0.0) * scale

    return get


_shared_minor = _shared("tracejoin.work.shared.mm.minor_faults", 1.0)
_shared_major = _shared("tracejoin.work.shared.mm.major_faults", 1.0)


def _shared_faults(attrs: Attrs) -> float | None:
    minor = _shared_minor(attrs)
    return None if minor is None else minor + (_shared_major(attrs) or 0.0)


@dataclass(frozen=True, slots=True)
class WorkColumn:
    column: str
    legend: str
    value: Callable[[Attrs], float | None]
    high: float = 99  # the second percentile shown (100: the maximum)
    shared: bool = False  # values not the request's own: shown with "~"


# The work set (docs/attributes.md "Work set"): where the requests' CPU time went, and what was
# shared with other open requests, never added to a request's own.
WORK_COLUMNS: tuple[WorkColumn, ...] = (
    WorkColumn(
        "reader ms",
        "reader: on-CPU of the thread that read the request, its own part",
        _scaled("tracejoin.work.reader_on_cpu_ns", 1e-6),
    ),
    WorkColumn(
        "others ms",
        "others: on-CPU of the threads and processes it woke (pools, workers), own part",
        _others_cpu_ms,
    ),
    WorkColumn(
        "~cpu ms",
        "~cpu, ~faults: on-CPU and page faults of work-set threads while they also served other "
        "open requests (an event loop, a batching worker): shared, not the request's own",
        _shared("tracejoin.work.shared.on_cpu_ns", 1e-6),
        shared=True,
    ),
    WorkColumn("~faults", "", _shared_faults, shared=True),
    WorkColumn(
        "unexpl ms",
        "unexpl: time the reader was blocked while no other work-set thread was runnable",
        _scaled("tracejoin.work.unexplained_wait_ns", 1e-6),
    ),
    WorkColumn(
        "threads",
        "threads, procs: work-set size (p50/max), the reader included",
        _scaled("tracejoin.work.threads", 1.0),
        high=100,
    ),
    WorkColumn("procs", "", _scaled("tracejoin.work.processes", 1.0), high=100),
)


def _cuda(key: str, scale: float = 1.0) -> Callable[[Attrs], float | None]:
    """A CUDA value: 0 for a request of a capture with --cuda that made no probed call (its span
    has the work set but no CUDA attribute), None for one without the work set."""

    def get(attrs: Attrs) -> float | None:
        if _num(attrs, "tracejoin.work.shared_with_max") is None:
            return None
        return (_num(attrs, key) or 0.0) * scale

    return get


# CUDA calls (docs/attributes.md "CUDA"), shown only when a request of the capture made one.
CUDA_COLUMNS: tuple[WorkColumn, ...] = (
    WorkColumn(
        "h2d B",
        "h2d, d2h: bytes the work set copied host to device and back (cudaMemcpy*, cuMemcpy*)",
        _cuda("tracejoin.cuda.memcpy.bytes.host_to_device"),
    ),
    WorkColumn("d2h B", "", _cuda("tracejoin.cuda.memcpy.bytes.device_to_host")),
    WorkColumn("copies", "copies: memcpy calls", _cuda("tracejoin.cuda.memcpy.count")),
    WorkColumn(
        "sync ms",
        "sync: host time blocked in CUDA synchronisation calls, own part",
        _cuda("tracejoin.cuda.sync.wait_ns", 1e-6),
    ),
    WorkColumn(
        "~sync ms",
        "~sync: the same by threads that also served other open requests (a batching GPU "
        "worker): shared, not the request's own",
        _cuda("tracejoin.work.shared.cuda.sync.wait_ns", 1e-6),
        shared=True,
    ),
    WorkColumn("graphs", "graphs: CUDA graph launches", _cuda("tracejoin.cuda.graph_launches")),
    WorkColumn("alloc B", "alloc: bytes allocated", _cuda("tracejoin.cuda.alloc.bytes")),
)


def percentile(sorted_vals: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value v with at least p% of the values <= v."""
    if not sorted_vals:
        return math.nan
    rank = math.ceil(round(p * len(sorted_vals), 9) / 100)
    return sorted_vals[min(len(sorted_vals), max(1, rank)) - 1]


@dataclass
class EndpointStats:
    count: int = 0
    errors: int = 0
    durations_ms: array[float] = field(default_factory=lambda: array("d"))
    components: list[array[float]] = field(default_factory=lambda: [array("d") for _ in COMPONENTS])
    work: list[array[float]] = field(default_factory=lambda: [array("d") for _ in WORK_COLUMNS])
    grpc: dict[int, int] = field(default_factory=dict)  # gRPC status code -> calls
    cuda: list[array[float]] = field(default_factory=lambda: [array("d") for _ in CUDA_COLUMNS])


@dataclass(frozen=True, slots=True, order=True)
class Slow:
    duration_ns: int
    trace_id: str
    name: str
    status: int  # HTTP status, 0 when none


INSTRUMENTED_KEY = "tracejoin.instrumented.source"
EXAMPLE_CHILDREN = 4


@dataclass
class Example:
    """The first request of one case (instrumented or not), with its first children."""

    trace_id: str
    span_id: str
    parent_id: str  # "" for a new root
    name: str
    kind: str
    service: str
    service_source: str
    instrumented: str  # "" when not
    duration_ns: int
    children: list[str] = field(default_factory=list)


@dataclass
class Summary:
    endpoints: dict[str, EndpointStats] = field(default_factory=dict)
    slowest: list[Slow] = field(default_factory=list)  # a min-heap of the slowest SLOWEST
    counters: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # capture metadata (capture.json)
    tlb_kinds: set[str] = field(default_factory=set)
    source: str = ""  # where the spans came from, when there is no capture metadata
    examples: dict[bool, Example] = field(default_factory=dict)  # by "instrumented"
    cuda_seen: bool = False  # a request made a probed CUDA call: the CUDA table is shown

    @property
    def requests(self) -> int:
        return sum(e.count for e in self.endpoints.values())

    def add(
        self,
        name: str,
        trace_id: str,
        duration_ns: int,
        error: bool,
        status: int,
        attrs: Attrs,
    ) -> None:
        ep = self.endpoints.get(name)
        if ep is None:
            ep = self.endpoints[name] = EndpointStats()
        ep.count += 1
        ep.errors += error
        code = attrs.get("rpc.grpc.status_code")
        if isinstance(code, int) and not isinstance(code, bool):
            ep.grpc[code] = ep.grpc.get(code, 0) + 1
        ep.durations_ms.append(duration_ns / 1e6)
        for comp, values in zip(COMPONENTS, ep.components, strict=True):
            v = comp.value(attrs)
            if v is not None:
                values.append(v)
        for col, values in zip(WORK_COLUMNS, ep.work, strict=True):
            v = col.value(attrs)
            if v is not None:
                values.append(v)
        if (
            "tracejoin.cuda.memcpy.count" in attrs
            or "tracejoin.work.shared.cuda.memcpy.count" in attrs
        ):
            self.cuda_seen = True
        for col, values in zip(CUDA_COLUMNS, ep.cuda, strict=True):
            v = col.value(attrs)
            if v is not None:
                values.append(v)
        if "tracejoin.tlb.dtlb_load_misses" in attrs:
            self.tlb_kinds.add("misses")
        elif "tracejoin.tlb.flushes" in attrs:
            self.tlb_kinds.add("flushes")
        item = Slow(duration_ns, trace_id, name, status)
        if len(self.slowest) < SLOWEST:
            heapq.heappush(self.slowest, item)
        elif item > self.slowest[0]:
            heapq.heapreplace(self.slowest, item)

    def add_span(self, span: Span) -> None:
        parent = f"{span.parent_span_id:016x}" if span.parent_span_id else ""
        if not is_request(span.kind, span.attributes):
            self.example_child(parent, span.name)
            return
        status = span.attributes.get("http.response.status_code", 0)
        status = status if isinstance(status, int) else 0
        error = span.status_code == STATUS_ERROR or status >= 500
        self.add(span.name, span.trace_id_hex, span.duration_ns, error, status, span.attributes)
        service = span.resource.get("service.name")
        self.example(span.trace_id_hex, span.span_id_hex, parent, span.name, span.kind,
                     str(service or "?"), span.duration_ns, span.attributes)  # fmt: skip

    def example(
        self,
        trace_id: str,
        span_id: str,
        parent_id: str,
        name: str,
        kind: int,
        service: str,
        duration_ns: int,
        attrs: Attrs,
    ) -> None:
        """Keep the first request of its case as that case's example trace."""
        instrumented = str(attrs.get(INSTRUMENTED_KEY) or "")
        case = bool(instrumented)
        if case not in self.examples:
            self.examples[case] = Example(
                trace_id, span_id, parent_id, name, _KIND_NAMES.get(kind, str(kind)), service,
                str(attrs.get("tracejoin.service_name.source") or "?"), instrumented, duration_ns,
            )  # fmt: skip

    def example_child(self, parent_id: str, name: str) -> None:
        for ex in self.examples.values():
            if ex.span_id == parent_id and len(ex.children) < EXAMPLE_CHILDREN:
                ex.children.append(name)

    # ---- text ----------------------------------------------------------------------------

    def format(self) -> str:
        lines: list[str] = []
        lines.extend(self._header())
        if not self.endpoints:
            lines.append("")
            lines.extend(_wrap(self._no_requests()))
        else:
            lines.append("")
            lines.extend(self._endpoint_table())
            lines.append("")
            lines.extend(self._legend())
            if any(values for ep in self.endpoints.values() for values in ep.work):
                lines.append("")
                lines.extend(self._work_table())
            if self.cuda_seen:
                lines.append("")
                lines.extend(self._cuda_table())
            lines.append("")
            lines.extend(self._slowest())
        if self.examples:
            lines.append("")
            lines.extend(self._examples())
        lines.append("")
        lines.extend(self._losses())
        lines.extend(self._budget())
        lines.extend(self._kept_in_kernel())
        return "\n".join(_fit(terminal_safe(line)) for line in lines)

    def _header(self) -> list[str]:
        i = self.info
        n = self.requests
        reqs = f"{n} request{'s' if n != 1 else ''}"
        if not i:
            return _wrap(f"{reqs} in {self.source or 'the spans given'}.")
        text = f"Capture of {i.get('duration_s', 0):.1f} s"
        if i.get("started_utc"):
            text += f" from {i['started_utc']}"
        if i.get("stopped_by"):
            text += f" (stopped by {i['stopped_by']})"
        text += f": {reqs}"
        unsampled = int(self.counters.get("requests_unsampled", 0))
        if unsampled:
            text += f" (and {unsampled} their callers did not sample: no span, not counted)"
        no_parent = int(self.counters.get("kernel_no_parent_aggregated", 0))
        if no_parent:
            text += f" (and {no_parent} without traceparent, --no-parent skip: no span)"
        text += f"; filters: {i.get('filters') or 'none (every process and port)'}"
        text += f"; TLB signal: {i.get('tlb_mode', '?')}; GPU: {i.get('gpu', '?')}."
        return _wrap(text)

    def _no_requests(self) -> str:
        filters = self.info.get("filters") or "none"
        duration = self.info.get("duration_s")
        during = f" during the {duration:.1f} s capture" if duration is not None else ""
        if any(k.startswith("requests_aggregated{") and v for k, v in self.counters.items()):
            return (
                f"No span was made{during}: the requests seen made none under the policies "
                "(--unsampled, --no-parent), and the kernel kept them (below)."
            )
        return (
            f"No HTTP requests were seen{during}. Check the filters ({filters}) and that "
            "HTTP/1.x traffic reached a process on this host while it ran."
        )

    def _endpoint_table(self) -> list[str]:
        head = f"{'endpoint':<{NAME}}{'count':>6}{'err':>5}{'p50 ms':>9}{'p99 ms':>9}"
        head += "".join(f"{c.column:>{CELL}}" for c in COMPONENTS)
        sub = " " * (NAME + 29) + f"{'p50/p99':>{CELL}}" * len(COMPONENTS)
        out = [head, sub, "-" * len(head)]
        order = sorted(self.endpoints.items(), key=lambda kv: (-kv[1].count, kv[0]))
        for raw_name, ep in order:
            name = terminal_safe(raw_name)
            durs = sorted(ep.durations_ms)
            nums = (
                f"{ep.count:>6}{ep.errors:>5}"
                f"{_ms(percentile(durs, 50)):>9}{_ms(percentile(durs, 99)):>9}"
            )
            for values in ep.components:
                vals = sorted(values)
                cell = f"{_short(percentile(vals, 50))}/{_short(percentile(vals, 99))}"
                nums += f"{cell if vals else '-':>{CELL}}"
            if len(name) < NAME:
                out.append(f"{name:<{NAME}}{nums}")
            else:
                out.append(name)
                out.append(" " * NAME + nums)
            if ep.grpc:  # a gRPC method (service/method): its calls by gRPC status
                codes = ", ".join(f"{_grpc_name(c)} {n}" for c, n in sorted(ep.grpc.items()))
                out.extend(
                    textwrap.wrap(
                        f"grpc status: {codes}",
                        WIDTH - 2,
                        initial_indent="  ",
                        subsequent_indent="    ",
                    )
                )
        return out

    def _work_table(self) -> list[str]:
        return self._column_table("work set", WORK_COLUMNS, lambda ep: ep.work)

    def _cuda_table(self) -> list[str]:
        return self._column_table("cuda", CUDA_COLUMNS, lambda ep: ep.cuda)

    def _column_table(
        self,
        title: str,
        columns: tuple[WorkColumn, ...],
        pick: Callable[[EndpointStats], list[array[float]]],
    ) -> list[str]:
        head = f"{title:<{WORK_NAME}}" + "".join(f"{c.column:>{WORK_CELL}}" for c in columns)
        sub = " " * WORK_NAME + "".join(
            f"{'p50/max' if c.high == 100 else 'p50/p99':>{WORK_CELL}}" for c in columns
        )
        out = [head, sub, "-" * len(head)]
        order = sorted(self.endpoints.items(), key=lambda kv: (-kv[1].count, kv[0]))
        for raw_name, ep in order:
            if not any(pick(ep)):
                continue
            name = terminal_safe(raw_name)
            nums = ""
            for col, values in zip(columns, pick(ep), strict=True):
                vals = sorted(values)
                lo, hi = percentile(vals, 50), percentile(vals, col.high)
                cell = f"{_mark(lo, col.shared)}/{_mark(hi, col.shared)}" if vals else "-"
                nums += f"{cell:>{WORK_CELL}}"
            if len(name) < WORK_NAME:
                out.append(f"{name:<{WORK_NAME}}{nums}")
            else:
                out.append(name)
                out.append(" " * WORK_NAME + nums)
        legend = " ".join(c.legend + "." for c in columns if c.legend)
        return out + _wrap(legend)

    def _legend(self) -> list[str]:
        lines = [
            "p50/p99: nearest-rank percentiles over the endpoint's requests (the p-th percentile "
            "is the smallest value at least p% of them do not exceed); err: 5xx or no response; "
            "-: no request had the signal.",
            *(c.legend + "." if c.legend else _tlb_legend(self.tlb_kinds) for c in COMPONENTS),
        ]
        out: list[str] = []
        for text in lines:
            out.extend(_wrap(text))
        return out

    def _slowest(self) -> list[str]:
        slow = sorted(self.slowest, reverse=True)
        out = [f"Slowest {len(slow)} requests (open the trace id in Jaeger):"]
        for s in slow:
            status = str(s.status) if s.status else "-"
            name = terminal_safe(s.name)
            out.append(f"  {_ms(s.duration_ns / 1e6):>9} ms  {status:>3}  {s.trace_id}  {name}")
        return out

    def _examples(self) -> list[str]:
        """One trace tree per case, as Jaeger shows it: the caller's span, then beside an
        instrumented server its own SERVER span (not tracejoin's) and tracejoin's INTERNAL."""
        out = ["Example traces (open the trace id in Jaeger):"]
        for case in (False, True):
            ex = self.examples.get(case)
            if ex is None:
                continue
            what = (
                f"instrumented server (detected by {ex.instrumented})"
                if case
                else "server without its own spans"
            )
            out.append(f"  {what}: trace {ex.trace_id}")
            out.append(f"    caller span {ex.parent_id}" if ex.parent_id else "    (new trace)")
            if case:
                out.append(
                    "    ├─ the app's own SERVER span, from its SDK "
                    "(in Jaeger, not in this capture)"
                )
            out.append(
                f"    └─ {ex.name}  {ex.kind}  {ex.service}  {_ms(ex.duration_ns / 1e6)} ms"
                f"  (service.name from {ex.service_source})"
            )
            out.extend(f"       └─ {child}  INTERNAL" for child in ex.children)
        return out

    def _losses(self) -> list[str]:
        c = self.counters
        lost = sum(int(c.get(k, 0)) for k, _ in LOSS_COUNTERS)
        out = [f"Losses: {'none' if lost == 0 else lost}"]
        for key, what in LOSS_COUNTERS:
            out.append(f"  {int(c.get(key, 0)):>8}  {what}")
            if key == "spans_dropped":
                for k in sorted(c):
                    if k.startswith("spans_dropped{") and c[k]:
                        out.append(f"  {int(c[k]):>8}    {k[len('spans_dropped') :]}")
        return out

    def _budget(self) -> list[str]:
        """What the CPU budget sampled out in the kernel: never a loss, so apart from them."""
        c = self.counters
        shed = int(c.get("kernel_sampled_out_budget", 0))
        ratio = c.get("sampling_ratio", 1.0)
        if not shed and ratio >= 1.0:
            return []
        out = [
            "",
            *_wrap(
                f"Sampled out by the CPU budget (not losses; the same trace ids on every "
                f"agent): {shed}; sampling ratio at the end {ratio:.4g}"
            ),
        ]
        for k in sorted(c):
            if k.startswith("requests_sampled_out{port=") and c[k]:
                port = k[len("requests_sampled_out{port=") : -1]
                secs = c.get(f"requests_sampled_out_seconds{{port={port}}}", 0.0)
                mean = f", mean {secs / c[k] * 1000:.2f} ms" if c[k] else ""
                out.append(f"  {int(c[k]):>8}  port {port}{mean}")
        return out

    def _kept_in_kernel(self) -> list[str]:
        """Requests no span was made of that the kernel counted and timed instead of sending
        (--unsampled follow, --no-parent skip), per server port: never a loss."""
        c = self.counters
        rows: list[str] = []
        for k in sorted(c):
            if not (k.startswith("requests_aggregated{") and c[k]):
                continue
            labels = dict(kv.split("=", 1) for kv in k[len("requests_aggregated{") : -1].split(","))
            port, why = labels.get("port", "?"), labels.get("why", "?")
            n = c[k]
            secs = c.get(f"requests_aggregated_seconds{{port={port},why={why}}}", 0.0)
            buckets = [
                (
                    le,
                    c.get(
                        f"requests_aggregated_latency_bucket{{le={le},port={port},why={why}}}", 0
                    ),
                )
                for le in AGG_BUCKET_BOUNDS
            ]
            rows.append(
                f"  {int(n):>8}  port {port}, {why.replace('_', ' ')}: mean "
                f"{secs / n * 1000:.2f} ms, p50 < {_bucket_ms(buckets, n * 0.5)}, "
                f"p99 < {_bucket_ms(buckets, n * 0.99)}"
            )
        if not rows:
            return []
        return [
            "",
            *_wrap(
                "Kept in the kernel, no span made of them (not losses; counted and timed per "
                "server port, latency from log2 buckets):"
            ),
            *rows,
        ]


def _bucket_ms(buckets: list[tuple[str, float]], rank: float) -> str:
    """The upper bound of the cumulative bucket that holds the rank-th request."""
    for le, cumulative in buckets:
        if cumulative >= rank:
            return "inf" if le == "+Inf" else f"{float(le) * 1000:.3g} ms"
    return "inf"


def _tlb_legend(kinds: set[str]) -> str:
    if kinds == {"misses"}:
        return "tlb: hardware dTLB load misses of the work set (own part)."
    if kinds == {"flushes"}:
        return "tlb: TLB flushes in the work set (no hardware PMU here: flushes, not misses)."
    if kinds:
        return "tlb: dTLB load misses where a PMU was available, else TLB flushes (not misses)."
    return "tlb: no TLB signal in this capture."


def _mark(v: float, shared: bool) -> str:
    """A shared value carries "~": it is not the request's own (a zero is just 0)."""
    return f"~{_short(v)}" if shared and v else _short(v)


def _ms(v: float) -> str:
    """At most 8 characters: 31.51, 12345, 1.2M (beyond a million milliseconds)."""
    if math.isnan(v):
        return "-"
    if v < 9999.995:
        return f"{v:.2f}"
    if v < 999_999.5:
        return f"{v:.0f}"
    return _short(v)


def _short(v: float) -> str:
    """At most 4 characters: 0.91, 31.5, 300, 4.2k, 12M."""
    if math.isnan(v):
        return "-"
    a = abs(v)
    if a < 999.5:
        digits = 2 if a < 9.995 else 1 if a < 99.95 else 0
        r = round(v, digits)
        # whole numbers stay whole: counts (faults, TLB events), and 40 % rather than 40.0
        return f"{r:.0f}" if r == int(r) else f"{r:.{digits}f}"
    for div, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        if a / div < 9.95:
            return f"{v / div:.1f}{suffix}"
        if a / div < 999.5:
            return f"{v / div:.0f}{suffix}"
    return f"{v:.0e}"


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False) or [""]


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


LOSS_COUNTERS = (
    ("kernel_ringbuf_full", "records the kernel could not queue (ring buffer full)"),
    ("kernel_request_state_lost", "requests whose kernel state was evicted before the response"),
    ("kernel_pipeline_slots_full", "pipelined requests beyond the per-connection limit"),
    ("decode_errors", "malformed records"),
    ("records_dropped_userspace", "records read but not turned into spans"),
    ("spans_dropped", "spans not delivered to a destination"),
)


_KIND_NAMES = {KIND_SERVER: "SERVER", KIND_INTERNAL: "INTERNAL"}


def is_request(kind: int | str, attrs: Attrs) -> bool:
    """tracejoin's span for a request: the SERVER span, or beside an instrumented server the
    INTERNAL one that says how it was detected."""
    return kind in _SERVER_KINDS or (kind in _INTERNAL_KINDS and INSTRUMENTED_KEY in attrs)


# ---- reading saved files -----------------------------------------------------------------

_SERVER_KINDS = (KIND_SERVER, "SPAN_KIND_SERVER")
_INTERNAL_KINDS = (KIND_INTERNAL, "SPAN_KIND_INTERNAL")
_ERROR_CODES = (STATUS_ERROR, "STATUS_CODE_ERROR")


def add_otlp_json(summary: Summary, request: Mapping[str, Any]) -> int:
    """Add the request spans of one OTLP/JSON ExportTraceServiceRequest (and their children
    to the example traces); returns spans seen."""
    n = 0
    for rs in request.get("resourceSpans") or []:
        res = (rs.get("resource") or {}).get("attributes") or []
        service = next((a for a in res if a.get("key") == "service.name"), None)
        service_name = str(_json_value(service.get("value") or {})) if service else "?"
        for ss in rs.get("scopeSpans") or []:
            for sp in ss.get("spans") or []:
                n += 1
                kind = sp.get("kind")
                attrs = {
                    a["key"]: _json_value(a.get("value") or {}) for a in sp.get("attributes") or []
                }
                parent = str(sp.get("parentSpanId") or "").lower()
                if not is_request(kind, attrs):
                    summary.example_child(parent, sp.get("name", ""))
                    continue
                dur = int(sp.get("endTimeUnixNano", 0)) - int(sp.get("startTimeUnixNano", 0))
                status = attrs.get("http.response.status_code", 0)
                status = status if isinstance(status, int) else 0
                error = (sp.get("status") or {}).get("code") in _ERROR_CODES or status >= 500
                trace_id = sp["traceId"].lower()
                summary.add(sp["name"], trace_id, dur, error, status, attrs)
                kind_no = KIND_SERVER if kind in _SERVER_KINDS else KIND_INTERNAL
                summary.example(trace_id, str(sp.get("spanId", "")).lower(), parent, sp["name"],
                                kind_no, service_name, dur, attrs)  # fmt: skip
    return n


def _json_value(v: Mapping[str, Any]) -> object:
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    for k in ("stringValue", "boolValue"):
        if k in v:
            return v[k]
    return None


def read_otlp_json(path: Path) -> Iterator[dict[str, Any]]:
    """ExportTraceServiceRequests from an OTLP/JSON file: one per line (as tracejoin and the
    Collector's file exporter write), or one whole, possibly indented, document."""
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        yield doc
        return
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {no}: not OTLP/JSON: {exc.msg}") from None
        if not isinstance(req, dict):
            raise ValueError(f"{path}, line {no}: not an OTLP/JSON request object")
        yield req


def load_report(path: Path) -> Summary:
    """The summary of a capture directory, or of an OTLP/JSON spans file.

    A capture's other files (summary.txt, trace.perfetto.json, ...) stand for their directory.
    Counters and capture details come from counters.json and capture.json beside the spans.
    """
    if path.is_file() and path.name in CAPTURE_FILES and path.name != SPANS_FILE:
        path = path.parent
    if path.is_dir():
        spans_file = path / SPANS_FILE
        if not spans_file.is_file():
            raise ValueError(f"no {SPANS_FILE} in {path}: not a tracejoin capture directory")
    else:
        spans_file = path
    summary = Summary()
    for req in read_otlp_json(spans_file):
        try:
            add_otlp_json(summary, req)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{spans_file}: malformed OTLP/JSON span ({exc!r})") from None
    folder = spans_file.parent
    if spans_file.name == SPANS_FILE:
        counters, info = folder / COUNTERS_FILE, folder / CAPTURE_FILE
        if counters.is_file():
            summary.counters = json.loads(counters.read_text())
        if info.is_file():
            summary.info = json.loads(info.read_text())
    summary.source = str(spans_file)
    return summary
