"""Enriched record -> spans: one SERVER span per request in the caller's trace, plus child spans
for the intervals the kernel timed (receive-queue wait, long run-queue waits) and one per helper
thread of the request's work set.

When the serving process makes its own SERVER span (it is instrumented), the request's span is
the kernel's view of the same hop: kind INTERNAL, named "<method> <route> (kernel)", with the
same parent (the caller's span) and the same attributes, so the hop keeps one SERVER span
(docs/attributes.md, "Instrumented services").

A pure function of the enriched record and the live signal set: nothing here reads the host.
An attribute is emitted only when its signal was on, so an absent value never reads as a measured
zero ("0 retransmits" when tcp:tcp_probe was missing would be a lie).

Attribute names: docs/attributes.md. OTel semantic conventions where one exists; tracejoin's own
measurements under `tracejoin.*`, named for what was measured (a TLB flush is not a miss).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import cache, lru_cache

from tracejoin.core.model import (
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    AttrValue,
    Span,
)
from tracejoin.core.record import (
    CSIG_ALLOC_BYTES,
    CSIG_ALLOC_CALLS,
    CSIG_ERRORS,
    CSIG_FREE_CALLS,
    CSIG_GRAPH_LAUNCHES,
    CSIG_LAUNCHES,
    CSIG_MEMCPY_CALLS,
    CSIG_MEMCPY_D2D,
    CSIG_MEMCPY_D2H,
    CSIG_MEMCPY_H2D,
    CSIG_MEMCPY_OTHER,
    CSIG_SYNC_CALLS,
    CSIG_SYNC_NS,
    H2F_CLOSED,
    H2F_GOAWAY,
    H2F_LOST,
    H2F_RST,
    H2F_STREAM,
    H2F_UNRESOLVED,
    RUNQ_SLOTS,
    WS_SLOTS,
    WSF_CAP,
    WSF_CUDA,
    WSF_NO_GAP,
    WSF_STATS,
    WSF_TRACKED,
    WSIG_MAJFLT,
    WSIG_MINFLT,
    WSIG_OFFCPU,
    WSIG_ONCPU,
    WSIG_RUNQ,
    WSIG_SWITCHES,
    WSIG_TLB_A,
    WSIG_TLB_B,
)
from tracejoin.core.text import OTHER_METHOD, http_method, terminal_safe, url_path
from tracejoin.enrich.enricher import EnrichedRecord, process_name
from tracejoin.kernel.decode import (
    REQF_FIRST_ON_CONN,
    REQF_NO_RESPONSE,
    REQF_PATH_TRUNC,
    REQF_RESP_UNTERM,
    REQF_TLB_HW,
    HttpRecord,
)

# Path segments that look like identifiers become "{id}" in the span name, so a route like
# /users/123/orders/9f1c... names one operation, not one per user.
_ID_SEGMENT = re.compile(
    r"^(?:\d+|[0-9a-fA-F]{8,}|[0-9a-fA-F-]{32,36}|(?=[^/]*\d)[A-Za-z0-9_\-]{16,})$"
)
MAX_ROUTE_SEGMENTS = 4
KERNEL_SUFFIX = " (kernel)"  # the request span's name beside an instrumented server's own


# gRPC status codes a server span reports as an error (OTel RPC semantic conventions for gRPC).
GRPC_SERVER_ERRORS = frozenset({2, 4, 12, 13, 14, 15})
GRPC_CODE_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip


def grpc_call(path: str) -> tuple[str, str] | None:
    """(rpc.service, rpc.method) of a gRPC path "/package.Service/Method"; None otherwise."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def grpc_status_code(rec: HttpRecord) -> int | None:
    """An HTTP/2 stream's gRPC status code, when its trailers carried grpc-status (the kernel
    stores it + 1, 0 when none was seen)."""
    return rec.grpc_status - 1 if rec.grpc_status else None


def h2_call(rec: HttpRecord, path: str) -> tuple[int | None, tuple[str, str] | None]:
    """An HTTP/2 stream's gRPC status code (grpc_status_code) and, then, its (rpc.service,
    rpc.method) when the path is a gRPC one."""
    grpc_code = grpc_status_code(rec)
    return grpc_code, grpc_call(path) if grpc_code is not None else None


def server_status(rec: HttpRecord, grpc_code: int | None) -> tuple[int, str]:
    """The server span's status and message: an error for no response, a 5xx, a gRPC code a
    server reports as its own error (OTel RPC conventions), or a stream reset or refused."""
    if rec.flags & REQF_NO_RESPONSE:
        return STATUS_ERROR, "connection closed before a response"
    if rec.status >= 500:
        return STATUS_ERROR, ""
    if grpc_code is not None and grpc_code in GRPC_SERVER_ERRORS:
        return STATUS_ERROR, GRPC_CODE_NAMES[grpc_code]
    if grpc_code is None and rec.h2_flags & (H2F_RST | H2F_GOAWAY):  # 0 for HTTP/1.x
        return STATUS_ERROR, f"stream ended by {_h2_ended_by(rec.h2_flags)}"
    return STATUS_UNSET, ""


def _h2_ended_by(flags: int) -> str | None:
    """How an HTTP/2 stream ended when not by the server's END_STREAM."""
    for bit, name in (
        (H2F_RST, "rst_stream"),
        (H2F_GOAWAY, "goaway"),
        (H2F_LOST, "framing_lost"),
        (H2F_CLOSED, "connection_close"),
    ):
        if flags & bit:
            return name
    return None


def http_span_name(method: str, path: str) -> str:
    """The request span's name: "<method> <route>" ("HTTP <route>" for an unknown method)."""
    return f"{'HTTP' if method == OTHER_METHOD else method} {route_of(path)}"


@lru_cache(maxsize=4096)  # paths repeat; the regex per segment costs microseconds
def route_of(path: str) -> str:
    """Bounded-cardinality route for span names: ids -> {id}, at most 4 segments."""
    if not path.startswith("/"):
        return path[:32] or "/"
    segs = path.split("/")[1:]
    out = ["{id}" if _ID_SEGMENT.match(s) else s for s in segs[:MAX_ROUTE_SEGMENTS]]
    route = "/" + "/".join(out)
    if len(segs) > MAX_ROUTE_SEGMENTS:
        route += "/{...}"
    return route


# Signal names as the probes report them (tracejoin.kernel.probes ProbeStatus.signals).
SIG_RECVQ, SIG_TCP_STATS, SIG_SCHED, SIG_FAULTS = "recvq", "tcp_stats", "sched", "page_faults"
SIG_WORKSET = "workset"
SIG_CUDA, SIG_CUDA_LAUNCHES = "cuda", "cuda_launches"
# What a thread did while it also worked for other open requests is under this prefix, never
# under the request's own attribute: `tracejoin.mm.minor_faults` -> `tracejoin.work.shared.mm...`
SHARED = "tracejoin.work.shared."


@dataclass(frozen=True)
class SpanOptions:
    signals: frozenset[str]  # the signals whose probes are loaded
    tlb_mode: str = "off"  # "hardware", "flush_fallback" or "off"
    runq_child_threshold_ns: int = 1_000_000
    # A receive-queue wait becomes a child span only from this long: a child belongs in the trace
    # when it explains something; the wait itself is always an attribute of the server span.
    recvq_child_threshold_ns: int = 0

    @classmethod
    def from_status(
        cls,
        signals: dict[str, str],
        tlb_mode: str,
        runq_child_threshold_ns: int,
        recvq_child_threshold_ns: int = 0,
    ) -> SpanOptions:
        live = frozenset(name for name, state in signals.items() if state == "on")
        return cls(live, tlb_mode, runq_child_threshold_ns, recvq_child_threshold_ns)


def build_spans(e: EnrichedRecord, opts: SpanOptions, new_id: Callable[[int], int]) -> list[Span]:
    rec = e.rec
    on: Collection[str] = opts.signals
    # hostile bytes stay inert: an unknown method is _OTHER, the path percent-encoded
    method, method_original = http_method(rec.method_bytes())
    path = url_path(rec.path_bytes())
    attrs: dict[str, AttrValue] = {
        "http.request.method": method,
        "url.path": path,
        "network.protocol.name": "http",
        "network.transport": "tcp",
        "thread.id": rec.tid,
        "http.request.size": rec.req_bytes,
        "http.response.size": rec.resp_bytes,
        "tracejoin.connection.id": rec.conn_id,
        "tracejoin.connection.request_seq": rec.seq,
    }
    if method_original is not None:
        attrs["http.request.method_original"] = method_original
    if rec.status:
        attrs["http.response.status_code"] = rec.status
    h2 = bool(rec.h2_flags & H2F_STREAM)
    name = http_span_name(method, path)
    grpc_code, call = h2_call(rec, path) if h2 else (None, None)
    if h2:
        attrs["network.protocol.version"] = "2"
        attrs["tracejoin.http2.stream_id"] = rec.seq
        ended_by = _h2_ended_by(rec.h2_flags)
        if ended_by:
            attrs["tracejoin.http2.ended_by"] = ended_by
        if rec.h2_flags & H2F_UNRESOLVED:
            attrs["tracejoin.http2.field_unresolved"] = True
        if grpc_code is not None:
            attrs["rpc.system"] = "grpc"
            attrs["rpc.grpc.status_code"] = grpc_code
        if call is not None:
            attrs["rpc.service"], attrs["rpc.method"] = call
            name = f"{call[0]}/{call[1]}"
    ep = e.endpoints
    if ep is not None:
        attrs["server.address"] = ep.local_addr
        attrs["server.port"] = ep.local_port
        attrs["client.address"] = ep.peer_addr
        attrs["client.port"] = ep.peer_port
    if e.service_name_source:
        attrs["tracejoin.service_name.source"] = e.service_name_source
    if e.instrumented:
        attrs["tracejoin.instrumented.source"] = e.instrumented
    if e.rejected is not None:
        attrs["tracejoin.traceparent.rejected"] = e.rejected
    if rec.flags & REQF_PATH_TRUNC:
        attrs["tracejoin.http.path_truncated"] = True
    if _queued(rec, on):
        attrs["tracejoin.tcp.receive_queue_wait_ns"] = rec.read_ns - rec.arrival_ns
    if rec.flags & REQF_FIRST_ON_CONN and 0 < rec.est_ns <= rec.read_ns:
        attrs["tracejoin.tcp.handshake_to_first_read_ns"] = rec.read_ns - rec.est_ns
    if rec.resp_start_ns:
        attrs["tracejoin.http.time_to_first_response_byte_ns"] = max(
            0, rec.resp_start_ns - rec.read_ns
        )
    if SIG_TCP_STATS in on:
        attrs["tracejoin.tcp.retransmits"] = rec.retrans
        if rec.srtt_us:
            attrs["tracejoin.tcp.srtt_us"] = rec.srtt_us
        if rec.unacked_max:
            attrs["tracejoin.tcp.unacked_max_bytes"] = rec.unacked_max
    # With the work set on, the kernel signals are sums over it (its own part); without it, the
    # reading thread's deltas. A set the kernel lost, or counters it never took at the read, give
    # no values, and an absent value must not read as a measured zero.
    tracked = _tracked(rec, on)
    measured = tracked if SIG_WORKSET in on else bool(rec.ws_flags & WSF_STATS)
    if SIG_SCHED in on and measured:
        attrs["tracejoin.sched.runq_wait_ns"] = rec.runq_ns
        attrs["tracejoin.sched.runq_wait_max_ns"] = rec.runq_max_ns
        attrs["tracejoin.sched.offcpu_ns"] = rec.offcpu_ns
        attrs["tracejoin.sched.context_switches"] = rec.nr_switches
    if SIG_FAULTS in on and measured:
        attrs["tracejoin.mm.minor_faults"] = rec.minflt
        attrs["tracejoin.mm.major_faults"] = rec.majflt
    tlb = _tlb_names(rec, opts)
    if measured:
        attrs.update(zip(tlb, (rec.tlb_a, rec.tlb_b), strict=False))
    if tracked:
        attrs.update(_work_attributes(rec, on, tlb))
    if _cuda(rec, on, tracked):
        attrs.update(_cuda_attributes(rec, on))
    if rec.flags & REQF_RESP_UNTERM:
        attrs["tracejoin.http.response_unframed"] = True
    attrs.update(e.gpu)

    status, message = server_status(rec, grpc_code)
    server = Span(
        trace_id=e.trace_id,
        span_id=new_id(64),
        parent_span_id=e.parent_id,
        name=f"{name}{KERNEL_SUFFIX}" if e.instrumented else name,
        kind=KIND_INTERNAL if e.instrumented else KIND_SERVER,
        start_ns=e.epoch_ns(e.start_mono_ns),
        end_ns=e.epoch_ns(e.end_mono_ns),
        resource=e.resource,
        attributes=attrs,
        status_code=status,
        status_message=message,
        trace_flags=e.trace_flags,
    )
    return [server, *child_spans(e, server, opts, new_id)]


def _queued(rec: HttpRecord, on: Collection[str]) -> bool:
    """The receive-queue wait was measured (its signal on, and the arrival before the read)."""
    return SIG_RECVQ in on and 0 < rec.arrival_ns <= rec.read_ns


def _tracked(rec: HttpRecord, on: Collection[str]) -> bool:
    """The work set is on and the kernel kept this request's set."""
    return SIG_WORKSET in on and bool(rec.ws_flags & WSF_TRACKED)


def _cuda(rec: HttpRecord, on: Collection[str], tracked: bool) -> bool:
    return tracked and SIG_CUDA in on and bool(rec.ws_flags & WSF_CUDA)


# rec.runq as (start_ns, dur_ns) pairs read in one go: iterating the ctypes array makes an
# object per slot, which costs more than the rest of the check.
_RUNQ_PAIRS = struct.Struct(f"={2 * RUNQ_SLOTS}Q")
_RUNQ_OFFSET = HttpRecord.runq.offset


def needs_children(rec: HttpRecord, opts: SpanOptions) -> bool:
    """Whether child_spans can return anything for this record: the object-free path
    (span_bytes.py) makes a parent `Span` for them only then. Errs on the side of True."""
    on = opts.signals
    if _queued(rec, on) and rec.read_ns - rec.arrival_ns >= opts.recvq_child_threshold_ns:
        return True
    if SIG_SCHED in on:
        pairs = _RUNQ_PAIRS.unpack_from(rec, _RUNQ_OFFSET)
        if max(pairs[1::2]) >= opts.runq_child_threshold_ns:
            return True
    return _tracked(rec, on) and (rec.ws_nslots > 0 or bool(rec.ws_flags & WSF_CUDA))


def child_spans(
    e: EnrichedRecord, server: Span, opts: SpanOptions, new_id: Callable[[int], int]
) -> list[Span]:
    """The request's child spans under `server` (only its ids, resource and flags are read):
    a long receive-queue wait, long run-queue waits, the work set's helpers, CUDA waits."""
    rec = e.rec
    on = opts.signals
    spans = []
    if _queued(rec, on) and rec.read_ns - rec.arrival_ns >= opts.recvq_child_threshold_ns:
        spans.append(
            _child(
                server,
                new_id(64),
                "tcp.receive_queue_wait",
                e.epoch_ns(rec.arrival_ns),
                e.epoch_ns(rec.read_ns),
            )
        )
    if SIG_SCHED in on:
        for w in rec.runq:
            if w.dur_ns >= opts.runq_child_threshold_ns and w.start_ns:
                s0 = e.epoch_ns(w.start_ns)
                spans.append(_child(server, new_id(64), "sched.runq_wait", s0, s0 + w.dur_ns))
    tracked = _tracked(rec, on)
    helpers = _helper_spans(e, server, on, _tlb_names(rec, opts), new_id) if tracked else []
    spans.extend(helpers)
    if _cuda(rec, on, tracked):
        spans.extend(_cuda_wait_spans(e, server, helpers, new_id))
    return spans


def _tlb_names(rec: HttpRecord, opts: SpanOptions) -> tuple[str, ...]:
    """Attribute names of the record's two TLB values, for what was measured; () when off."""
    if rec.flags & REQF_TLB_HW:
        return ("tracejoin.tlb.dtlb_load_misses", "tracejoin.tlb.itlb_load_misses")
    if opts.tlb_mode == "flush_fallback":
        return ("tracejoin.tlb.flushes", "tracejoin.tlb.full_flushes")
    return ()


def _work_attributes(
    rec: HttpRecord, on: Collection[str], tlb: tuple[str, ...]
) -> dict[str, AttrValue]:
    """The work set on the server span: its size, its on-CPU time split by who, what it did
    not explain, and (only when a member also served other open requests) the shared parts."""
    a: dict[str, AttrValue] = {
        "tracejoin.work.threads": rec.ws_threads,
        "tracejoin.work.processes": rec.ws_processes,
        "tracejoin.work.on_cpu_ns": rec.oncpu_ns,
        "tracejoin.work.reader_on_cpu_ns": max(0, rec.oncpu_ns - rec.helper_oncpu_ns),
        "tracejoin.work.shared_with_max": rec.ws_shared_with_max,
    }
    if not rec.ws_flags & WSF_NO_GAP:
        a["tracejoin.work.unexplained_wait_ns"] = rec.unexplained_wait_ns
    if rec.ws_flags & WSF_CAP:
        a["tracejoin.work.threads_refused"] = rec.ws_refused
    if rec.ws_unslotted:
        a["tracejoin.work.helpers_without_span"] = rec.ws_unslotted
    a.update(_shared_work_attributes(rec, on, tlb))
    return a


def _shared_work_attributes(
    rec: HttpRecord, on: Collection[str], tlb: tuple[str, ...]
) -> dict[str, AttrValue]:
    """What the work set's threads did while they also served other open requests; {} when
    none did (the common case)."""
    a: dict[str, AttrValue] = {}
    sh = rec.shared
    if rec.ws_shared_with_max or any(sh):
        a[SHARED + "on_cpu_ns"] = sh[WSIG_ONCPU]
        a[SHARED + "on_cpu_apportioned_ns"] = rec.shared_apportioned_ns
        if SIG_SCHED in on:
            a[SHARED + "sched.runq_wait_ns"] = sh[WSIG_RUNQ]
            a[SHARED + "sched.offcpu_ns"] = sh[WSIG_OFFCPU]
            a[SHARED + "sched.context_switches"] = sh[WSIG_SWITCHES]
        if SIG_FAULTS in on:
            a[SHARED + "mm.minor_faults"] = sh[WSIG_MINFLT]
            a[SHARED + "mm.major_faults"] = sh[WSIG_MAJFLT]
        for name, idx in zip(tlb, (WSIG_TLB_A, WSIG_TLB_B), strict=False):
            a[SHARED + name.removeprefix("tracejoin.")] = sh[idx]
    return a


# CUDA sums by CSIG_* index: attribute name (under tracejoin.), and the signal it needs.
CUDA_ATTRIBUTES: tuple[tuple[int, str, str], ...] = (
    (CSIG_MEMCPY_H2D, "cuda.memcpy.bytes.host_to_device", SIG_CUDA),
    (CSIG_MEMCPY_D2H, "cuda.memcpy.bytes.device_to_host", SIG_CUDA),
    (CSIG_MEMCPY_D2D, "cuda.memcpy.bytes.device_to_device", SIG_CUDA),
    (CSIG_MEMCPY_OTHER, "cuda.memcpy.bytes.other", SIG_CUDA),
    (CSIG_MEMCPY_CALLS, "cuda.memcpy.count", SIG_CUDA),
    (CSIG_SYNC_NS, "cuda.sync.wait_ns", SIG_CUDA),
    (CSIG_SYNC_CALLS, "cuda.sync.count", SIG_CUDA),
    (CSIG_GRAPH_LAUNCHES, "cuda.graph_launches", SIG_CUDA),
    (CSIG_LAUNCHES, "cuda.launches", SIG_CUDA_LAUNCHES),
    (CSIG_ALLOC_BYTES, "cuda.alloc.bytes", SIG_CUDA),
    (CSIG_ALLOC_CALLS, "cuda.alloc.count", SIG_CUDA),
    (CSIG_FREE_CALLS, "cuda.free.count", SIG_CUDA),
    (CSIG_ERRORS, "cuda.errors", SIG_CUDA),
)


def _cuda_attributes(rec: HttpRecord, on: Collection[str]) -> dict[str, AttrValue]:
    """The CUDA calls the work set made for this request alone; calls made while a thread also
    worked for other open requests (a batching GPU worker) only under the shared prefix."""
    own, sh = rec.cuda.own, rec.cuda.shared
    a: dict[str, AttrValue] = {}
    for idx, name, needs in CUDA_ATTRIBUTES:
        if needs in on:
            a["tracejoin." + name] = own[idx]
    if any(sh):
        for idx, name, needs in CUDA_ATTRIBUTES:
            if needs in on:
                a[SHARED + name] = sh[idx]
    return a


@cache
def cuda_api_names() -> dict[int, str]:
    """bpf/cuda.h's CUDA_APIS rows by number (the kernel names a wait's call by its row)."""
    from tracejoin.kernel.cuda import load_apis
    from tracejoin.kernel.probes import bpf_source_dir

    return {a.api: a.symbol for a in load_apis(bpf_source_dir() / "cuda.h")}


def _cuda_wait_spans(
    e: EnrichedRecord, server: Span, helpers: list[Span], new_id: Callable[[int], int]
) -> list[Span]:
    """One INTERNAL span per long synchronisation (the kernel keeps the longest, above
    --cuda-sync-threshold-ms): where the request's work waited on the GPU. Under the helper
    thread's span when a helper waited, else under the server span."""
    out = []
    names = cuda_api_names()
    # a helper's wait goes under that helper's span (in Jaeger and on its timeline track)
    by_tid = {h.attributes["thread.id"]: h for h in helpers}
    for w in e.rec.cuda.waits:
        if not (w.dur_ns and w.start_ns):
            continue
        s0 = e.epoch_ns(w.start_ns)
        parent = by_tid.get(w.tid, server)
        child = _child(parent, new_id(64), names.get(w.api, "cuda.sync"), s0, s0 + w.dur_ns)
        child.attributes["thread.id"] = w.tid
        child.attributes["tracejoin.cuda.sync.wait_ns"] = w.dur_ns
        if w.shared:  # the thread also worked for other open requests while it waited
            child.attributes["tracejoin.work.shared"] = True
        out.append(child)
    return out


def _helper_spans(
    e: EnrichedRecord,
    server: Span,
    on: Collection[str],
    tlb: tuple[str, ...],
    new_id: Callable[[int], int],
) -> list[Span]:
    """One INTERNAL span per reported helper thread, named process/thread, from when it was
    woken into the set until it replied or the response ended."""
    rec = e.rec
    out = []
    for m in rec.members[: min(rec.ws_nslots, WS_SLOTS)]:
        if not m.join_ns:
            continue
        thread = helper_thread_name(m.comm_bytes())
        if m.pid == rec.pid:
            process = process_name(e.resource, m.pid)
        else:
            process = e.process_names.get(m.pid, f"pid {m.pid}" if m.pid else "?")
        end = max(m.leave_ns or rec.end_ns, m.join_ns)
        child = _child(
            server,
            new_id(64),
            f"{process}/{thread}",
            e.epoch_ns(m.join_ns),
            e.epoch_ns(end),
        )
        a = child.attributes
        a["thread.id"] = m.tid
        a["thread.name"] = thread
        if m.pid:
            a["process.pid"] = m.pid
        a["tracejoin.work.on_cpu_ns"] = m.oncpu_ns
        if m.shared_oncpu_ns:
            a[SHARED + "on_cpu_ns"] = m.shared_oncpu_ns
        if SIG_SCHED in on:
            a["tracejoin.sched.runq_wait_ns"] = m.runq_ns
        if SIG_FAULTS in on:
            a["tracejoin.mm.minor_faults"] = m.minflt
            a["tracejoin.mm.major_faults"] = m.majflt
        a.update(zip(tlb, (m.tlb_a, m.tlb_b), strict=False))
        out.append(child)
    return out


def helper_thread_name(comm: bytes) -> str:
    """A helper thread's name on its span, from the kernel's comm (up to its NUL)."""
    return terminal_safe(comm.decode("utf-8", "backslashreplace")) or "?"


def _child(parent: Span, span_id: int, name: str, start_ns: int, end_ns: int) -> Span:
    return Span(
        trace_id=parent.trace_id,
        span_id=span_id,
        parent_span_id=parent.span_id,
        name=name,
        kind=KIND_INTERNAL,
        start_ns=start_ns,
        end_ns=end_ns,
        resource=parent.resource,
        attributes={"tracejoin.interval.kernel_measured": True},
        trace_flags=parent.trace_flags,
    )
