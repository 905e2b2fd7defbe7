"""Enriched record -> the request's server span as OTLP protobuf bytes, with no `Span` object and
no attribute dict: the object-free twin of spans.build_spans, for destinations that only send
OTLP protobuf (`tracejoin run`, a capture whose destinations all accept encoded spans).

Two writers of the same bytes. Where `_span_bytes.c` was compiled at install, its server_span
writes a record's span in one call (HTTP/1.x and HTTP/2): it reads the kernel's struct itself
(the probes' own header) and writes the ids, times, every int and flag attribute and the
status, while the strings stay here, encoded once and cached (per request line the span name
with the method and path fields and a gRPC call's service and method; the addresses; the
process's sources), and are passed in as bytes (`_request_prefix` makes the per-request-line
ones for both writers). `_encode_py` is the reference and the fallback (no compiler; CUDA sums;
a value beyond int64): constant parts are encoded once at import (each attribute key with its
KeyValue/AnyValue framing for every varint length, the fixed network.* pair, kinds, statuses),
and per record it lists the span's parts (bytes, and each int attribute as its IntKey and the
value) for one join, compiled or `_join_py`. build_spans stays the reference of both:
`test_span_bytes` builds all three over a varied set of records and compares the request bytes,
so the attribute order here, and in the C, follows build_spans' line by line; a change to one
must be made to all.

Child spans (a long receive-queue wait, run-queue waits, work-set helpers, CUDA waits) keep the
object path: they are rare and their parent only lends its ids; the OTLP encoder takes a batch
that mixes both. The Python writers use build_spans' own helpers for what is decided rather than
copied (grpc_call, http_span_name, server_status); the C writes the same rules (test_span_bytes
holds it to them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from tracejoin.core.model import (
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_UNSET,
    AttrValue,
    EncodedSpan,
    ExportSpan,
    Resource,
    Span,
)
from tracejoin.core.otlp_wire import (
    INT64_MAX,
    T_ANY_INT,
    T_ANY_STRING,
    T_SPAN_ATTR,
    T_SPAN_KIND,
    T_SPAN_NAME,
    T_SPAN_STATUS,
    V1,
    append_attributes,
    key_field,
    kv_slow,
    ld,
    span_head,
    status_body,
    utf8,
    varint,
)
from tracejoin.core.record import H2F_STREAM, H2F_UNRESOLVED, WSF_CAP, WSF_NO_GAP, WSF_STATS
from tracejoin.core.text import http_method, url_path
from tracejoin.enrich.correlate import carried_addresses
from tracejoin.enrich.enricher import EnrichedRecord, Enricher, process_name
from tracejoin.kernel.decode import (
    REQF_FIRST_ON_CONN,
    REQF_PATH_TRUNC,
    REQF_RESP_UNTERM,
)
from tracejoin.pipeline.spans import (
    KERNEL_SUFFIX,
    SIG_CUDA,
    SIG_FAULTS,
    SIG_RECVQ,
    SIG_SCHED,
    SIG_TCP_STATS,
    SIG_WORKSET,
    SpanOptions,
    _cuda,
    _cuda_attributes,
    _h2_ended_by,
    _shared_work_attributes,
    _tlb_names,
    _tracked,
    child_spans,
    grpc_call,
    grpc_status_code,
    helper_thread_name,
    http_span_name,
    needs_children,
    server_status,
)

StrWriter = Callable[[str], bytes]

_CACHE_MAX = 4096  # per string attribute; cleared when full (bounded memory, as otlp_wire's)


class IntKey(bytes):
    """An int attribute in a span's parts (see _join_py): its KeyValue.key field and
    KeyValue.value tag; the part after it is the value. Made once per attribute name."""

    key: str  # the attribute name, for values beyond int64 (written as otlp_wire does)
    pre: tuple[bytes, ...]  # the framing up to the varint, for each varint length 1..10


def _int_key(key: str) -> IntKey:
    kp = key_field(key)  # KeyValue.key field + KeyValue.value tag
    if len(kp) + 12 >= 0x80:  # then a length below would not be a one-byte varint
        raise ValueError(f"attribute key too long for the pre-encoded framing: {key}")
    k = IntKey(kp)
    k.key = key
    # KeyValue length = key field + value tag + AnyValue length byte + (int tag + n varint bytes)
    k.pre = (
        b"",
        *(T_SPAN_ATTR + V1[len(kp) + 2 + n] + kp + V1[1 + n] + T_ANY_INT for n in range(1, 11)),
    )
    return k


def _join_py(parts: list[bytes | int]) -> bytes:
    """A span's parts -> the bytes of its OTLP Span message. A part is bytes, written as it is,
    or an IntKey followed by an int: that attribute's field. _span_bytes.c's join is the same in
    C."""
    out: list[bytes] = []
    add = out.append
    values = iter(parts)
    for x in values:
        if x.__class__ is IntKey:
            v: int = next(values)  # type: ignore[assignment]
            if 0 <= v <= INT64_MAX:
                b = V1[v] if v < 0x80 else varint(v)
                add(x.pre[len(b)] + b)
            else:  # beyond int64 (a string), as otlp_wire does
                add(T_SPAN_ATTR + kv_slow(x.key, v))
        else:
            add(x)  # type: ignore[arg-type]
    return b"".join(out)


try:  # compiled where a C compiler was, at install: the same bytes, faster
    from tracejoin.pipeline._span_bytes import IDS_PER_RECORD
    from tracejoin.pipeline._span_bytes import join as _join_c
    from tracejoin.pipeline._span_bytes import server_span as _server_span_c
    from tracejoin.pipeline._span_bytes import spans_batch as _spans_batch_c
except ImportError:  # pragma: no cover - the pure-Python fallback, under the same tests
    _join_c = _server_span_c = _spans_batch_c = None
    IDS_PER_RECORD = 0

_join: Callable[[list[bytes | int]], bytes] = _join_c or _join_py
_server_span = _server_span_c  # None: every span takes _encode_py (tests and bench switch it)
_spans_batch = _spans_batch_c  # None: every record goes through the stages (BatchWriter)
COMPILED = _server_span_c is not None  # which one encode_spans uses (bench, doctor)
ENCODERS = ("compiled", "server_span", "join", "python")


def use_encoder(which: str) -> None:
    """For the bench and tests: "compiled" (as installed: the batch writer, and server_span for
    the records it leaves), "server_span" (every record through the stages, its server span
    compiled: the path before the batch writer), "join" (the Python encoder on the compiled
    join) or "python" (an install without a C compiler)."""
    global _server_span, _spans_batch, _join
    if which not in ENCODERS:
        raise ValueError(f"encoder {which!r}: one of {', '.join(ENCODERS)}")
    if which != "python" and not COMPILED:
        raise RuntimeError("_span_bytes.c was not built (gcc, python3-dev: scripts/setup.sh)")
    _spans_batch = _spans_batch_c if which == "compiled" else None
    _server_span = _server_span_c if which in ("compiled", "server_span") else None
    _join = _join_c if which != "python" else _join_py


def _str_writer(key: str) -> StrWriter:
    """Span.attributes field for a string value of `key`; values repeat (methods, addresses,
    paths), so each field is kept, up to _CACHE_MAX per key."""
    kp = key_field(key)
    cache: dict[str, bytes] = {}

    def write(v: str) -> bytes:
        got = cache.get(v)
        if got is None:
            b = utf8(v)
            n = len(b)
            if len(kp) + 3 + n < 0x80:
                # KeyValue: key field, value tag, AnyValue length, AnyValue (string tag, len, b)
                got = T_SPAN_ATTR + V1[len(kp) + 3 + n] + kp + V1[2 + n] + T_ANY_STRING + V1[n] + b
            else:
                got = T_SPAN_ATTR + kv_slow(key, v)
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            cache[v] = got
        return got

    return write


def _attributes(attrs: Mapping[str, AttrValue]) -> bytes:
    """Span.attributes fields by the exporters' own attribute encoder."""
    parts: list[bytes] = []
    append_attributes(parts, T_SPAN_ATTR, attrs)
    return b"".join(parts)


def _fixed(key: str, value: str | bool) -> bytes:
    return _attributes({key: value})


# One writer (strings) or IntKey (ints) per attribute of build_spans' server span, in its order.
_METHOD = _str_writer("http.request.method")
_PATH = _str_writer("url.path")
_NETWORK = _fixed("network.protocol.name", "http") + _fixed("network.transport", "tcp")
_TID = _int_key("thread.id")
_REQ_SIZE = _int_key("http.request.size")
_RESP_SIZE = _int_key("http.response.size")
_CONN_ID = _int_key("tracejoin.connection.id")
_SEQ = _int_key("tracejoin.connection.request_seq")
_METHOD_ORIGINAL = _str_writer("http.request.method_original")
_STATUS_CODE = _int_key("http.response.status_code")
_SERVER_ADDR = _str_writer("server.address")
_SERVER_PORT = _int_key("server.port")
_CLIENT_ADDR = _str_writer("client.address")
_CLIENT_PORT = _int_key("client.port")
_THREAD_NAME = _str_writer("thread.name")  # a helper span's (BatchWriter)
_SERVICE_SOURCE = _str_writer("tracejoin.service_name.source")
_INSTRUMENTED = _str_writer("tracejoin.instrumented.source")
_REJECTED = _str_writer("tracejoin.traceparent.rejected")
_PATH_TRUNCATED = _fixed("tracejoin.http.path_truncated", True)
_RECVQ_WAIT = _int_key("tracejoin.tcp.receive_queue_wait_ns")
_HANDSHAKE = _int_key("tracejoin.tcp.handshake_to_first_read_ns")
_TTFB = _int_key("tracejoin.http.time_to_first_response_byte_ns")
_RETRANS = _int_key("tracejoin.tcp.retransmits")
_SRTT = _int_key("tracejoin.tcp.srtt_us")
_UNACKED = _int_key("tracejoin.tcp.unacked_max_bytes")
_RUNQ = _int_key("tracejoin.sched.runq_wait_ns")
_RUNQ_MAX = _int_key("tracejoin.sched.runq_wait_max_ns")
_OFFCPU = _int_key("tracejoin.sched.offcpu_ns")
_SWITCHES = _int_key("tracejoin.sched.context_switches")
_MINFLT = _int_key("tracejoin.mm.minor_faults")
_MAJFLT = _int_key("tracejoin.mm.major_faults")
_WS_THREADS = _int_key("tracejoin.work.threads")
_WS_PROCESSES = _int_key("tracejoin.work.processes")
_WS_ONCPU = _int_key("tracejoin.work.on_cpu_ns")
_WS_READER_ONCPU = _int_key("tracejoin.work.reader_on_cpu_ns")
_WS_SHARED_WITH = _int_key("tracejoin.work.shared_with_max")
_WS_UNEXPLAINED = _int_key("tracejoin.work.unexplained_wait_ns")
_WS_REFUSED = _int_key("tracejoin.work.threads_refused")
_WS_UNSLOTTED = _int_key("tracejoin.work.helpers_without_span")
_UNFRAMED = _fixed("tracejoin.http.response_unframed", True)
_H2 = _fixed("network.protocol.version", "2")
_H2_STREAM = _int_key("tracejoin.http2.stream_id")
_H2_ENDED = _str_writer("tracejoin.http2.ended_by")
_H2_UNRESOLVED = _fixed("tracejoin.http2.field_unresolved", True)
_RPC_GRPC = _fixed("rpc.system", "grpc")
_GRPC_CODE = _int_key("rpc.grpc.status_code")
_RPC_SERVICE = _str_writer("rpc.service")
_RPC_METHOD = _str_writer("rpc.method")
_tlb_keys: dict[str, IntKey] = {}

_KIND = {k: T_SPAN_KIND + V1[k] for k in (KIND_SERVER, KIND_INTERNAL)}

_names: dict[tuple[str, str, bool], bytes] = {}  # (method, path, instrumented) -> name field
_statuses: dict[tuple[int, str], bytes] = {}  # server_status() -> status field (few messages)


def _name_field(method: str, path: str, instrumented: bool) -> bytes:
    """The span's name field: http_span_name's, or (method "", a gRPC call) service/method."""
    got = _names.get((method, path, instrumented))
    if got is None:
        name = http_span_name(method, path) if method else path
        b = utf8(f"{name}{KERNEL_SUFFIX}" if instrumented else name)
        got = T_SPAN_NAME + varint(len(b)) + b
        if len(_names) >= _CACHE_MAX:
            _names.clear()
        _names[(method, path, instrumented)] = got
    return got


def _status_field(status: tuple[int, str]) -> bytes:
    got = _statuses.get(status)
    if got is None:
        got = b"" if status == (STATUS_UNSET, "") else ld(T_SPAN_STATUS, status_body(*status))
        if len(_statuses) >= _CACHE_MAX:
            _statuses.clear()
        _statuses[status] = got
    return got


def _tlb(name: str) -> IntKey:
    k = _tlb_keys.get(name)
    if k is None:
        k = _tlb_keys[name] = _int_key(name)
    return k


def _encode_py(e: EnrichedRecord, opts: SpanOptions, span_id: int) -> bytes:
    """The server span's bytes, in Python: any record (server_span's reference)."""
    rec = e.rec
    on = opts.signals
    flags = rec.flags
    h2_flags = rec.h2_flags
    h2 = h2_flags & H2F_STREAM
    grpc_code = grpc_status_code(rec) if h2 else None
    pre, method_original, rpc = _request_prefix(
        rec.method_bytes(), rec.path_bytes(), grpc_code is not None, bool(e.instrumented)
    )
    # each ctypes field read makes a new int: read the times once (EnrichedRecord's
    # start_mono_ns/end_mono_ns, inline)
    arrival_ns, read_ns, off = rec.arrival_ns, rec.read_ns, e.clock_offset_ns
    queued = 0 < arrival_ns <= read_ns
    p: list[bytes | int] = [
        span_head(
            e.trace_id,
            span_id,
            e.parent_id,
            (arrival_ns if queued else read_ns) + off,
            max(rec.end_ns, read_ns) + off,
            e.trace_flags,
        ),
        pre,  # name, kind, method, url.path, network.*
        _TID,
        rec.tid,
        _REQ_SIZE,
        rec.req_bytes,
        _RESP_SIZE,
        rec.resp_bytes,
        _CONN_ID,
        rec.conn_id,
        _SEQ,
        rec.seq,
        method_original,  # b"" when the method is a known one
    ]
    status = rec.status
    if status:
        p += (_STATUS_CODE, status)
    if h2:  # build_spans' HTTP/2 block, in its order
        p += (_H2, _H2_STREAM, rec.seq)
        ended_by = _h2_ended_by(h2_flags)
        if ended_by:
            p.append(_H2_ENDED(ended_by))
        if h2_flags & H2F_UNRESOLVED:
            p.append(_H2_UNRESOLVED)
        if grpc_code is not None:
            p += (_RPC_GRPC, _GRPC_CODE, grpc_code)
        p.append(rpc)  # rpc.service, rpc.method: b"" unless a gRPC call
    ep = e.endpoints
    if ep is not None:
        p += (
            _SERVER_ADDR(ep.local_addr),
            _SERVER_PORT,
            ep.local_port,
            _CLIENT_ADDR(ep.peer_addr),
            _CLIENT_PORT,
            ep.peer_port,
        )
    p.append(_extra_fields(e))
    if flags & REQF_PATH_TRUNC:
        p.append(_PATH_TRUNCATED)
    if queued and SIG_RECVQ in on:
        p += (_RECVQ_WAIT, read_ns - arrival_ns)
    if flags & REQF_FIRST_ON_CONN and 0 < rec.est_ns <= read_ns:
        p += (_HANDSHAKE, read_ns - rec.est_ns)
    if rec.resp_start_ns:
        p += (_TTFB, max(0, rec.resp_start_ns - read_ns))
    if SIG_TCP_STATS in on:
        p += (_RETRANS, rec.retrans)
        if rec.srtt_us:
            p += (_SRTT, rec.srtt_us)
        if rec.unacked_max:
            p += (_UNACKED, rec.unacked_max)
    tracked = _tracked(rec, on)
    measured = tracked if SIG_WORKSET in on else bool(rec.ws_flags & WSF_STATS)
    if measured:
        if SIG_SCHED in on:
            p += (
                _RUNQ,
                rec.runq_ns,
                _RUNQ_MAX,
                rec.runq_max_ns,
                _OFFCPU,
                rec.offcpu_ns,
                _SWITCHES,
                rec.nr_switches,
            )
        if SIG_FAULTS in on:
            p += (_MINFLT, rec.minflt, _MAJFLT, rec.majflt)
    tlb = _tlb_names(rec, opts)
    if measured:
        for name, v in zip(tlb, (rec.tlb_a, rec.tlb_b), strict=False):
            p += (_tlb(name), v)
    if tracked:  # spans._work_attributes, in its order
        ws_flags, oncpu = rec.ws_flags, rec.oncpu_ns
        p += (
            _WS_THREADS,
            rec.ws_threads,
            _WS_PROCESSES,
            rec.ws_processes,
            _WS_ONCPU,
            oncpu,
            _WS_READER_ONCPU,
            max(0, oncpu - rec.helper_oncpu_ns),
            _WS_SHARED_WITH,
            rec.ws_shared_with_max,
        )
        if not ws_flags & WSF_NO_GAP:
            p += (_WS_UNEXPLAINED, rec.unexplained_wait_ns)
        if ws_flags & WSF_CAP:
            p += (_WS_REFUSED, rec.ws_refused)
        if rec.ws_unslotted:
            p += (_WS_UNSLOTTED, rec.ws_unslotted)
        # The shared parts and CUDA's sums vary in number and name (and are rarer): built as
        # build_spans builds them, written by the exporters' own attribute encoder.
        shared = _shared_work_attributes(rec, on, tlb)
        if shared:
            p.append(_attributes(shared))
    if _cuda(rec, on, tracked):
        p.append(_attributes(_cuda_attributes(rec, on)))
    if flags & REQF_RESP_UNTERM:
        p.append(_UNFRAMED)
    if e.gpu:  # tracejoin.gpu.*: no name above, so appending keeps build_spans' dict order
        p.append(_attributes(e.gpu))
    p.append(_status_field(server_status(rec, grpc_code)))
    try:
        return _join(p)
    except OverflowError:  # an int beyond int64: the compiled join leaves those to Python's
        return _join_py(p)


def _request_prefix(
    method_raw: bytes, path_raw: bytes, grpc: bool, instrumented: bool
) -> tuple[bytes, bytes, bytes]:
    """For both writers, per request line (and whether an HTTP/2 stream carried a grpc-status,
    grpc_status_code): the fields from the span's name to network.* (name, kind, method, url.path,
    network.*); the http.request.method_original field (or b""); rpc.service and rpc.method
    when the stream is a gRPC call (or b"")."""
    method, method_original = http_method(method_raw)
    path = url_path(path_raw)
    call = grpc_call(path) if grpc else None
    pre = (
        (
            _name_field(method, path, instrumented)
            if call is None
            else _name_field("", f"{call[0]}/{call[1]}", instrumented)
        )
        + _KIND[KIND_INTERNAL if instrumented else KIND_SERVER]
        + _METHOD(method)
        + _PATH(path)
        + _NETWORK
    )
    mo = b"" if method_original is None else _METHOD_ORIGINAL(method_original)
    rpc = b"" if call is None else _RPC_SERVICE(call[0]) + _RPC_METHOD(call[1])
    return pre, mo, rpc


# server_span's cache of _request_prefix (it bounds it) and the maker, per span kind
_Prefix = tuple[bytes, bytes, bytes]
_PREFIXES: dict[bool, tuple[dict[bytes, _Prefix], Callable[..., _Prefix]]]
_PREFIXES = {
    instrumented: ({}, partial(_request_prefix, instrumented=instrumented))
    for instrumented in (False, True)
}
_extras: dict[tuple[str | None, str | None, str | None], bytes] = {}

# server_span's signal bits (SIGM_* in _span_bytes.c)
_SIGNAL_BITS = {
    SIG_RECVQ: 0x01,
    SIG_TCP_STATS: 0x02,
    SIG_SCHED: 0x04,
    SIG_FAULTS: 0x08,
    SIG_WORKSET: 0x10,
    SIG_CUDA: 0x20,
}
_last_plan: tuple[SpanOptions | None, tuple[int, int, int, int]] = (None, (0, 0, 0, 0))


def _plan(opts: SpanOptions) -> tuple[int, int, int, int]:
    """server_span's view of the options; the agent has one SpanOptions, so the last is kept
    (hashing the frozen dataclass per record would cost more than this)."""
    global _last_plan
    if _last_plan[0] is not opts:
        bits = sum(bit for sig, bit in _SIGNAL_BITS.items() if sig in opts.signals)
        plan = (
            bits,
            int(opts.tlb_mode == "flush_fallback"),
            max(0, opts.recvq_child_threshold_ns),
            max(0, opts.runq_child_threshold_ns),
        )
        _last_plan = (opts, plan)
    return _last_plan[1]


def _extra_fields(e: EnrichedRecord) -> bytes:
    return extra_fields(e.service_name_source, e.instrumented, e.rejected)


def extra_fields(source: str | None, instrumented: str | None, rejected: str | None) -> bytes:
    """tracejoin.service_name.source, .instrumented.source and .traceparent.rejected: per process
    (and rejection reason), so cached together."""
    key = (source, instrumented, rejected)
    got = _extras.get(key)
    if got is None:
        parts = []
        if source:
            parts.append(_SERVICE_SOURCE(source))
        if instrumented:
            parts.append(_INSTRUMENTED(instrumented))
        if rejected is not None:
            parts.append(_REJECTED(rejected))
        got = b"".join(parts)
        if len(_extras) >= _CACHE_MAX:
            _extras.clear()
        _extras[key] = got
    return got


def encode_spans(
    e: EnrichedRecord, opts: SpanOptions, new_id: Callable[[int], int]
) -> list[Span | EncodedSpan]:
    """What build_spans(e, opts, new_id) makes, with the server span as bytes (same ids drawn
    from new_id in the same order, same attributes in the same order)."""
    rec = e.rec
    span_id = new_id(64)
    got = None
    if _server_span is not None:
        prefixes, make_prefix = _PREFIXES[bool(e.instrumented)]
        got = _server_span(
            rec,
            prefixes,
            make_prefix,
            e.trace_id,
            span_id,
            e.parent_id,
            e.trace_flags,
            e.clock_offset_ns,
            e.endpoints,
            _SERVER_ADDR,
            _CLIENT_ADDR,
            _extra_fields(e),
            _attributes(e.gpu) if e.gpu else b"",
            _plan(opts),
        )
    if got is None:  # no compiler, or a record server_span leaves to Python
        body, children = _encode_py(e, opts, span_id), needs_children(rec, opts)
    else:
        body, children = got
    out: list[Span | EncodedSpan] = [EncodedSpan(e.resource, body)]
    if children:
        # the children's parent: only its ids, resource and flags are read
        parent = Span(
            trace_id=e.trace_id,
            span_id=span_id,
            parent_span_id=e.parent_id,
            name="",
            kind=KIND_SERVER,
            start_ns=0,
            end_ns=0,
            resource=e.resource,
            trace_flags=e.trace_flags,
        )
        out += child_spans(e, parent, opts, new_id)
    return out


class BatchWriter:
    """The common request's spans straight from the ring's bytes, a batch in one C call
    (_span_bytes.c spans_batch): what decode, enrich and encode_spans would make of it, with no
    Python object per record but the spans. The common request is an HTTP/1.x or HTTP/2 record
    that decodes as it is, with one plain sampled version-00 traceparent, its tuple carried and
    no child span but its work set's helpers' (a GPU join is added when the hold releases them:
    write_held); every other record is returned for the stages, which stay the reference
    (tests/test_span_bytes.py compares the two). The process's resource and naming are the
    enricher's (once per pid a batch), the clock offset its clock's (once a batch), a helper
    span's names from the same resolver (once per thread a batch)."""

    def __init__(self, enricher: Enricher, opts: SpanOptions) -> None:
        self.enricher = enricher
        self.opts = opts
        self._conns: dict[int, tuple[bytes, bytes]] = {}
        self._prefixes = (_PREFIXES[False][0], _PREFIXES[True][0])
        self._makers = (_PREFIXES[False][1], _PREFIXES[True][1])

    @staticmethod
    def available() -> bool:
        return _spans_batch is not None

    def _resolve(self, pid: int) -> tuple[Resource, bytes, bool]:
        served = self.enricher.served(pid)
        extra = extra_fields(served.service_name_source or None, served.instrumented, None)
        return served.resource, extra, bool(served.instrumented)

    @staticmethod
    def _conn_fields(family: int, laddr: bytes, raddr: bytes) -> tuple[bytes, bytes]:
        local, peer = carried_addresses(family, laddr, raddr)
        return _SERVER_ADDR(local), _CLIENT_ADDR(peer)

    def _helper_fields(self, pid: int, comm: bytes) -> tuple[bytes, bytes]:
        """A helper span's name field ("process/thread") and thread.name field, named as
        spans._helper_spans names them (the reader's own process and any other alike)."""
        thread = helper_thread_name(comm.split(b"\0", 1)[0])
        process = process_name(self.enricher.served(pid).resource, pid) if pid else "?"
        name = utf8(f"{process}/{thread}")
        return T_SPAN_NAME + varint(len(name)) + name, _THREAD_NAME(thread)

    def write(self, records: list[bytes], spans: list[ExportSpan]) -> list[bytes]:
        """Appends the common records' spans to `spans`; returns the others, in order. When it
        raises, nothing was appended."""
        mine: list[ExportSpan] = []
        rest = self._write(records, mine, None, self.enricher.clock.offset_ns())
        spans += mine
        return rest

    def write_held(self, records: list[bytes]) -> tuple[list[WrittenSpans], list[bytes]]:
        """As write, each request's spans apart with what a GPU join needs (its process and
        times), to be held until the GPU samples cover it (stages.GpuHold)."""
        spans: list[ExportSpan] = []
        meta: list[tuple[int, int, int, int]] = []
        offset = self.enricher.clock.offset_ns()
        rest = self._write(records, spans, meta, offset)
        out, at = [], 0
        for pid, start, end, n in meta:
            out.append(WrittenSpans(spans[at : at + n], pid, start + offset, end + offset))
            at += n
        return out, rest

    def _write(
        self,
        records: list[bytes],
        spans: list[ExportSpan],
        meta: list[tuple[int, int, int, int]] | None,
        offset: int,
    ) -> list[bytes]:
        if _spans_batch is None:
            return records
        rest: list[bytes] = []
        _spans_batch(
            records,
            spans,
            rest,
            self._prefixes,
            self._makers,
            self._resolve,
            self._conns,
            self._conn_fields,
            EncodedSpan,
            offset,
            os.urandom(8 * IDS_PER_RECORD * len(records)),
            _plan(self.opts),
            self._helper_fields,
            meta,
        )
        return rest


@dataclass(slots=True)
class WrittenSpans:
    """One request the batch writer wrote, held for its GPU window: its spans (the server span
    first) and what the GPU join needs (times in Unix epoch ns)."""

    spans: list[ExportSpan]
    pid: int
    start_ns: int
    end_ns: int

    def with_gpu(self, gpu: Mapping[str, AttrValue]) -> None:
        """Add the GPU window's attributes to the server span. After its status field: a
        parser reads the same Span (repeated attributes concatenate; build_spans puts them
        last too)."""
        server = self.spans[0]
        if gpu and isinstance(server, EncodedSpan):
            self.spans[0] = EncodedSpan(server.resource, server.body + _attributes(gpu))
